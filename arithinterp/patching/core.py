"""Shared pieces of the patching analyses: the result type, its summary, scoring of whole answers,
the cell grid.

The functions here are the patching package's own building blocks; the package exports the
result type and the constants, not these helpers. What other analyses share with patching lives
lower down: the metric vocabulary in :mod:`arithinterp.metrics`, the pair checks in
:mod:`arithinterp.checks`, position resolution in :mod:`arithinterp.tasks`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from arithinterp import sites as site_lib
from arithinterp.drawing import draw
from arithinterp.intervals import bootstrap_counts
from arithinterp.metrics import DIRECTIONS, METRICS, metric_name, stolfo_ie
from arithinterp.engine.patches import UNIT_SITES  # heads / neurons per site, defined once
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.results import NON_NEGATIVE, Relation, Result, build_meta
from arithinterp.types import HookedModel, OpenUnitFloat, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs

PATCHING_SITES = (
    "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_z", "pattern", "mlp_pre", "mlp_post",
)
ATTRIBUTE_SITES = PATCHING_SITES
SCORINGS = ("first-token", "full-answer")  # as tasks.SCORING: what a metric scores of a multi-token answer
ATTRIBUTION_METHODS = ("attribution", "integrated-gradients")
COMPONENT_ABLATIONS = ("zero", "mean", "resample")
ELEMENT_BUDGET = 2**24  # floats per stacked activation tensor (64 MB in float32)


# =================================================================================================
# Result
# =================================================================================================


@dataclass(frozen=True)
class PatchResult(Result):
    """Patching (or attribution) effects of one site, per pair and per cell.

    The cell axes are a subset of ``("layer", "position", "head", "neuron")`` in that order
    (``cell_shape``). With ``normalized`` the values are ``(v − corrupt) / (mean clean − mean
    corrupt)``, each pair against its own corrupt run: a cell at 0 does what the corrupt run does,
    one at 1 restores the clean run on average.

    Attributes:
        values (Float[Tensor, "pair *cell_shape"]): The metric of each pair's patched run, per cell.
        mean (Float[Tensor, "*cell_shape"]): The mean over pairs.
        sem (Float[Tensor, "*cell_shape"]): Its standard error.
        ci_low (Float[Tensor, "*cell_shape"]): The lower end of the bootstrap percentile interval.
        ci_high (Float[Tensor, "*cell_shape"]): The upper end.
        clean_baseline (Float[Tensor, "pair"]): The metric on the unpatched clean runs.
        corrupt_baseline (Float[Tensor, "pair"]): The metric on the unpatched corrupt runs.
        axes: The names of the cell axes.
        layers: The label of each layer index.
        positions: Position names (``"a"``, ``"final"``) or integer indices as strings.
        heads: The head labels (empty without a head axis).
        neurons: The neuron labels (empty without a neuron axis).
        tokens: The token string at each entry of ``positions`` (the first pair's clean prompt).
        site: The patched site.
        metric: The metric's name.
        direction: ``"denoise"`` or ``"noise"``.
        method: ``"exact"``, ``"attribution"`` or ``"integrated-gradients"``.
        normalized: Whether the values are normalized as above.
        meta: Provenance (:func:`arithinterp.results.build_meta`) and the analysis's arguments.
    """

    values: torch.Tensor
    mean: torch.Tensor
    sem: torch.Tensor
    ci_low: torch.Tensor
    ci_high: torch.Tensor
    clean_baseline: torch.Tensor
    corrupt_baseline: torch.Tensor
    axes: list
    layers: list
    positions: list
    heads: list
    neurons: list
    tokens: list
    site: str
    metric: str
    direction: str
    method: str
    normalized: bool
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"values": "pair layer ...", "mean": "layer ...", "sem": "layer ...", "ci_low": "layer ...",
               "ci_high": "layer ...", "clean_baseline": "pair", "corrupt_baseline": "pair", "layers": "layer",
               "positions": "position", "tokens": "position"}
    _legal = {"axes": ("layer", "position", "head", "neuron"), "layers": NON_NEGATIVE, "heads": NON_NEGATIVE,
              "neurons": NON_NEGATIVE, "sem": NON_NEGATIVE, "direction": DIRECTIONS, "site": PATCHING_SITES,
              "method": ("exact", *ATTRIBUTION_METHODS)}
    _relations = (
        Relation("axes", "the names of the cell axes of 'mean', one per dimension, in the order layer, position, "
                 "head, neuron", lambda v: len(v["axes"]) == v["mean"].ndim and v["axes"]
                 == [a for a in ("layer", "position", "head", "neuron") if a in v["axes"]] and v["axes"][0] == "layer"),
        Relation("positions", "one label per entry of each cell axis (layers, positions, heads, neurons), and none "
                 "for an axis the cells lack", lambda v: all(
                     len(v[labels]) == (v["mean"].shape[v["axes"].index(axis)] if axis in v["axes"] else len(v[labels]))
                     and (axis in v["axes"] or axis == "position" or not v[labels])
                     for axis, labels in (("layer", "layers"), ("position", "positions"), ("head", "heads"),
                                          ("neuron", "neurons")))),
    )

    @property
    def n_pairs(self) -> int:
        """The number of pairs (axis 0 of :attr:`values`)."""
        return int(self.values.shape[0])

    def axis_labels(self, axis: str) -> list:
        """The labels of one cell axis.

        Args:
            axis: ``"layer"``, ``"position"``, ``"head"`` or ``"neuron"``.

        Returns:
            :attr:`layers`, :attr:`positions`, :attr:`heads` or :attr:`neurons`.
        """
        return {"layer": self.layers, "position": self.positions, "head": self.heads, "neuron": self.neurons}[axis]

    def headline(self) -> dict:
        """The strongest cell: the one whose patch moves the metric furthest from the run it patches
        (the corrupt run when denoising, the clean one when noising), and the two baselines.

        Returns:
            ``strongest`` (the cell's coordinates), ``cell_mean`` (its mean metric), ``gap_fraction``
            (where that mean lies between the corrupt baseline, 0, and the clean one, 1), ``clean``
            and ``corrupt`` (the baselines' means, in the metric's units).
        """
        clean, corrupt = float(self.clean_baseline.mean()), float(self.corrupt_baseline.mean())
        if self.normalized:
            start = 0.0 if self.direction == "denoise" else 1.0
        else:
            start = corrupt if self.direction == "denoise" else clean
        flat = (self.mean - start).reshape(-1).nan_to_num(0.0).abs()
        if flat.numel() == 0:
            return dict(clean=clean, corrupt=corrupt)
        cell = tuple(int(i) for i in torch.unravel_index(flat.argmax(), tuple(self.mean.shape)))
        where = " ".join(f"{axis} {self.axis_labels(axis)[i]}" for axis, i in zip(self.axes, cell))
        if "position" in self.axes:
            where += f" ({self.tokens[cell[self.axes.index('position')]]!r})"
        mean = float(self.mean[cell])
        fraction = mean if self.normalized else (mean - corrupt) / (clean - corrupt) if clean != corrupt else math.nan
        return dict(strongest=where, cell_mean=mean, gap_fraction=fraction, clean=clean, corrupt=corrupt)

    def to_frame(self):
        """One row per cell: the cell's coordinates, mean, sem, CI and pair count."""
        import itertools

        import pandas as pd

        labels = [self.axis_labels(a) for a in self.axes]
        flat = [t.reshape(-1).tolist() for t in (self.mean, self.sem, self.ci_low, self.ci_high)]
        rows = []
        for i, coords in enumerate(itertools.product(*labels)):
            row = dict(zip(self.axes, coords))
            if "position" in row:
                row["token"] = self.tokens[self.positions.index(row["position"])]
            row.update(mean=flat[0][i], sem=flat[1][i], ci_low=flat[2][i], ci_high=flat[3][i])
            rows.append(row)
        frame = pd.DataFrame(rows)
        frame["site"], frame["metric"], frame["method"] = self.site, self.metric, self.method
        frame["n_pairs"] = self.n_pairs
        return frame

    def plot(self, **kwargs):
        """Layer × position heatmap, layer × head grid, or per-layer lines.

        Args:
            **kwargs: Options of :func:`arithinterp.viz.patching.plot_patch_result`.

        Returns:
            The plotly figure.
        """
        return draw(self, **kwargs)


def _draw_counts(n: int, n_boot: int, seed: int) -> torch.Tensor:
    """:func:`arithinterp.intervals.bootstrap_counts` in float32 (the resampled means are float32 products)."""
    return bootstrap_counts(n, n_boot, seed).float()


_kept_counts = functools.lru_cache(maxsize=8)(_draw_counts)


def _bootstrap_counts(n: int, n_boot: int, seed: int) -> torch.Tensor:
    """:func:`_draw_counts`, kept when at most 4 MB (the same for the same arguments): read-only."""
    return _kept_counts(n, n_boot, seed) if n * n_boot <= 2**20 else _draw_counts(n, n_boot, seed)


@checked
def summarize(values: torch.Tensor, *, confidence: OpenUnitFloat = 0.95, n_boot: PositiveInt = 1000, seed: int = 0):
    """Mean, standard error and percentile-bootstrap interval over axis 0.

    Resampling is done with multinomial counts (``counts @ values``), so memory is
    ``n_boot × cells`` rather than ``n_boot × N × cells``.

    Args:
        values (Float[Tensor, "n ..."]): Per-pair values.
        confidence: The interval's confidence level.
        n_boot: The number of bootstrap resamples.
        seed: Seeds the resamples.

    Returns:
        ``(mean, sem, ci_low, ci_high)``, each ``[...]`` float32; the standard error is 0 for one pair.

    Raises:
        AnalysisError: ``values`` has no pair (a 0-d tensor, or none along axis 0).
    """
    if values.ndim == 0 or values.shape[0] == 0:  # no mean and no interval over no pairs
        raise AnalysisError(f"values must hold at least one pair along axis 0, got shape {tuple(values.shape)}")
    n = values.shape[0]
    flat = values.reshape(n, -1).double()
    mean = flat.mean(0)
    sem = flat.std(0, unbiased=True) / math.sqrt(n) if n > 1 else torch.zeros_like(mean)
    counts = _bootstrap_counts(n, n_boot, seed)
    # centred before the float32 product so the resampled means keep their precision
    boot = mean.float() + counts @ torch.nan_to_num(flat - mean).float() / n
    alpha = (1 - confidence) / 2
    low, high = torch.quantile(boot, torch.tensor([alpha, 1 - alpha]), dim=0)
    shape = values.shape[1:]
    return tuple(t.float().reshape(shape) for t in (mean, sem, low, high))


# =================================================================================================
# Scoring (the metric names and functions are arithinterp.metrics)
# =================================================================================================


def resolve_scoring(pairs, scoring: Optional[str], metric) -> str:
    """The scoring a sweep uses: ``scoring``, or (``None``) the one the prompts carry
    (``prompts.with_scoring(...)``) for a named metric and ``"first-token"`` for a callable;
    ``"full-answer"`` needs a named metric."""
    if scoring is None:  # a callable reads the final position's logits, whatever the prompts say
        scoring = "first-token" if callable(metric) else getattr(pairs.clean, "scoring", "first-token")
    if scoring not in SCORINGS:
        raise ConfigError(
            f"unknown scoring {scoring!r}; accepted: {accepted(SCORINGS)} or None (the prompts' own scoring)"
        )
    if scoring == "full-answer" and callable(metric):
        raise ConfigError(
            "scoring='full-answer' scores the named metrics over every answer token; a metric callable takes "
            f"final-position logits [B, V] only. Pass one of {accepted(METRICS)}, or scoring='first-token'"
        )
    return scoring


def warn_first_token_only(pairs, what: str) -> None:
    """Say so when prompts ask for full-answer scoring that ``what`` does not do (it reads the
    final position's logits only)."""
    if getattr(pairs.clean, "scoring", "first-token") == "full-answer":
        import warnings

        warnings.warn(
            f"{what} scores the first answer token only, although these prompts ask for full-answer scoring; "
            "patching.activation_patching(..., scoring='full-answer') scores every answer token",
            UserWarning,
            stacklevel=3,
        )


def answer_logprob(logits: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probability of whole answers: ``logits [*lead, R, K, V]`` at the ``K``
    positions that predict the answer tokens ``answers [R, K]`` (−1 padding scores 0), ``[*lead, R]``
    (float32): ``Σ_k log P(answer_k | prompt, answer_<k)``."""
    answers = answers.to(logits.device)
    logprobs = logits.float().log_softmax(-1)
    index = answers.clamp(min=0).expand(*logits.shape[:-1])[..., None]
    picked = logprobs.gather(-1, index)[..., 0]
    return (picked * (answers >= 0)).sum(-1)


@dataclass
class FullAnswer:
    """Full-answer scoring of a named metric on a batch of ``B`` pairs.

    Each answer the metric needs (``feeds``: the clean answer, and for ``logit_diff`` and ``ie``
    the corrupt one too) is teacher-forced after both the base and the source prompt, so every
    patched run is run once per fed answer: row ``f * B + b`` is pair ``b`` with answer ``f`` fed.
    ``answers`` is ``[F, B, K]`` (−1 padded); :meth:`fed` the tokens appended to the prompts
    ``[F * B, K − 1]``; :meth:`metric` maps each row's answer log-probability ``[*, F * B]`` to
    the metric per pair ``[*, B]``.
    """

    metric: str
    direction: str
    answers: torch.Tensor
    base_rows: Optional[torch.Tensor] = None  # [F * B] the unpatched base run's rows (for "ie")

    @classmethod
    def of(cls, metric: str, batch, direction: str) -> "FullAnswer":
        clean, corrupt = batch.clean.answer_tokens, batch.corrupt.answer_tokens
        K = max(clean.shape[1], corrupt.shape[1])
        pad = lambda a: torch.cat([a, a.new_full((a.shape[0], K - a.shape[1]), -1)], dim=1)  # noqa: E731
        feeds = [pad(clean)] if metric in ("prob", "logprob") else [pad(clean), pad(corrupt)]
        return cls(metric, direction, torch.stack(feeds))

    @property
    def n_feeds(self) -> int:
        return int(self.answers.shape[0])

    @property
    def n_answer(self) -> int:
        return int(self.answers.shape[2])

    def rows(self) -> torch.Tensor:
        """The answer scored on each row, ``[F * B, K]``."""
        return self.answers.flatten(0, 1)

    def fed(self) -> torch.Tensor:
        """The answer tokens appended to each row's prompt, ``[F * B, K − 1]`` (padding fed as 0)."""
        return self.rows()[:, :-1].clamp(min=0)

    def metric_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The metric per pair ``[*, B]`` from each row's answer log-probability ``rows [*, F * B]``."""
        lp = rows.float().unflatten(-1, (self.n_feeds, -1))  # [*, F, B]
        if self.metric == "logprob":
            return lp[..., 0, :]
        if self.metric == "prob":
            return lp[..., 0, :].exp()
        if self.metric == "logit_diff":
            return lp[..., 0, :] - lp[..., 1, :]
        # ie: r the base prompt's answer, r' the source's (Stolfo et al. 2023), whole answers
        if self.base_rows is None:
            raise AnalysisError("full-answer 'ie' needs the unpatched base run's answer log-probabilities first")
        base = self.base_rows.float().unflatten(-1, (self.n_feeds, -1)).to(lp.device).exp()
        b, s = (1, 0) if self.direction == "denoise" else (0, 1)  # feed index of the base / source answer
        p = lp.exp()
        return stolfo_ie(base[b], p[..., b, :], base[s], p[..., s, :])


# =================================================================================================
# Units and cells
# =================================================================================================


def resolve_units(model: HookedModel, site: str, heads, neurons) -> tuple[Optional[str], list[int]]:
    kind = UNIT_SITES.get(site)
    if kind is None:
        if heads is not None or neurons is not None:
            raise SiteError(f"site {site!r} has no heads or neurons; heads apply to 'attn_z' and 'pattern', "
                            "neurons to 'mlp_pre' and 'mlp_post'")
        return None, []
    if kind == "head":
        if neurons is not None:
            raise SiteError(f"site {site!r} is indexed by heads, not neurons")
        return kind, site_lib.check_index("head", heads, int(model.cfg.n_heads))
    if heads is not None:
        raise SiteError(f"site {site!r} is indexed by neurons, not heads")
    return kind, site_lib.check_index("neuron", neurons, int(model.cfg.d_mlp))



@dataclass
class Cells:
    """The patch cells of a sweep: flattened cell index -> (layer, position index, unit)."""

    layers: list
    n_pos: int  # 0 when not per position
    units: list  # [] when the site has no heads / neurons

    def shape(self) -> tuple:
        return (len(self.layers),) + ((self.n_pos,) if self.n_pos else ()) + ((len(self.units),) if self.units else ())

    def table(self) -> torch.Tensor:
        """``[n_cells, 3]``: layer index, position index (−1 = all), unit index (−1 = all)."""
        grids = torch.meshgrid(
            torch.arange(len(self.layers)),
            torch.arange(self.n_pos) if self.n_pos else torch.tensor([-1]),
            torch.arange(len(self.units)) if self.units else torch.tensor([-1]),
            indexing="ij",
        )
        return torch.stack([g.reshape(-1) for g in grids], dim=1)


def patch_result(model: HookedModel, pairs: PromptPairs, values, clean_base, corrupt_base, cells, pos_labels, pos_index,
                 site, metric, direction, method, normalize, seed, extra):
    if normalize:
        scale = clean_base.mean() - corrupt_base.mean()
        if abs(float(scale)) < 1e-8:
            raise AnalysisError(
                "clean and corrupt baselines have the same mean metric; normalize=True would divide by zero"
            )
        # paired: each pair's change from its own corrupt run, over the mean clean - corrupt gap
        values = (values - corrupt_base.reshape(-1, *([1] * (values.ndim - 1)))) / scale
    mean, sem, low, high = summarize(values, seed=seed)
    tokens = []
    if pos_index is not None:
        first = pairs.clean.tokens[0, pos_index[:, 0]].tolist()
        if pairs.clean.tokenizer is not None:
            tokens = pairs.clean.tokenizer.convert_ids_to_tokens(first)
        else:
            tokens = [str(t) for t in first]
    return PatchResult(
        values=values,
        mean=mean,
        sem=sem,
        ci_low=low,
        ci_high=high,
        clean_baseline=clean_base,
        corrupt_baseline=corrupt_base,
        axes=["layer"] + (["position"] if cells.n_pos else []) + ([extra.get("unit")] if cells.units else []),
        layers=list(cells.layers),
        positions=list(pos_labels),
        heads=list(cells.units) if extra.get("unit") == "head" else [],
        neurons=list(cells.units) if extra.get("unit") == "neuron" else [],
        tokens=[str(t) for t in tokens],
        site=site,
        metric=metric_name(metric),
        direction=direction,
        method=method,
        normalized=bool(normalize),
        meta=build_meta(model, n_pairs=len(pairs), vary=getattr(pairs, "vary", None), seed=seed, **extra),
    )
