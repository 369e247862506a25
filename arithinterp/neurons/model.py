"""Running the model: neuron importance, K / KV maps over the operand grid, and classification of
a model's important neurons."""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from arithinterp.checks import check_belongs, integer
from arithinterp import engine
from arithinterp.engine.patches import UNCHANGED
from arithinterp import sites as site_lib
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.neurons.scoring import check_threshold, classify_maps
from arithinterp.neurons.table import HeuristicTable
from arithinterp.results import Result, build_meta
from arithinterp.types import HookedModel

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs, PromptSet

IMPORTANCE_METHODS = ("attribution", "patching", "mean_ablation")
# old name -> the method it always was ("ablation" patched in the corrupt value; it never ablated)
_DEPRECATED_METHODS = {"ablation": "patching"}


# --- results -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NeuronImportance(Result):
    """Per-neuron importance for the answer, per layer (Nikankin et al. 2025).

    ``scores`` is ``[len(layers), d_mlp]``: mean + std over prompts of the per-prompt effect
    magnitude. ``top`` is ``[len(layers), top_k]``: the top-k neurons of each layer, best first.
    """

    layers: list
    scores: torch.Tensor
    top: torch.Tensor
    method: str
    meta: dict = dataclasses.field(default_factory=dict)

    def neurons(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(layer, neuron)`` LongTensors of every selected neuron, layer by layer."""
        k = self.top.shape[1]
        return torch.tensor(self.layers).repeat_interleave(k), self.top.flatten()

    def top_scores(self) -> torch.Tensor:
        return self.scores.gather(1, self.top)

    def to_frame(self) -> pd.DataFrame:
        L, D = self.scores.shape
        rank = torch.empty_like(self.scores, dtype=torch.long)
        rank.scatter_(1, torch.argsort(self.scores, dim=1, descending=True), torch.arange(D).expand(L, D))
        return pd.DataFrame(
            dict(
                layer=np.repeat(self.layers, D),
                neuron=np.tile(np.arange(D), L),
                score=self.scores.flatten().numpy(),
                rank=rank.flatten().numpy(),
                selected=(rank < self.top.shape[1]).flatten().numpy(),
            )
        )

    def plot(self, **kwargs):
        from arithinterp.viz import neurons as viz

        return viz.importance_figure(self, **kwargs)


@dataclasses.dataclass(frozen=True)
class NeuronMaps(Result):
    """K and KV maps of neurons over an operand grid (Nikankin et al. 2025).

    ``k_maps`` / ``kv_maps`` are ``[N, A, B]`` (NaN where the grid has no prompt); rows follow
    ``a_values``, columns ``b_values``; ``layer`` / ``neuron`` ([N]) name the neurons.
    """

    layer: torch.Tensor
    neuron: torch.Tensor
    a_values: list
    b_values: list
    k_maps: torch.Tensor
    kv_maps: torch.Tensor
    op: str
    modulus: Optional[int]
    meta: dict = dataclasses.field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        N, A, B = self.k_maps.shape
        return pd.DataFrame(
            dict(
                layer=self.layer.repeat_interleave(A * B).numpy(),
                neuron=self.neuron.repeat_interleave(A * B).numpy(),
                a=np.tile(np.repeat(self.a_values, B), N),
                b=np.tile(np.tile(self.b_values, A), N),
                k=self.k_maps.flatten().numpy(),
                kv=self.kv_maps.flatten().numpy(),
            )
        )

    def plot(self, index: int = 0, kind: str = "both", **kwargs):
        """Heatmaps of row ``index``'s maps over (a, b); ``kind``: ``"K"``, ``"KV"`` or ``"both"``."""
        from arithinterp.viz import neurons as viz

        return viz.maps_figure(self, index=index, kind=kind, **kwargs)

    def classify(self, threshold: float = 0.6, **kwargs) -> HeuristicTable:
        """:func:`classify_maps` on these maps."""
        return classify_maps(
            self.k_maps, self.kv_maps, self.a_values, self.b_values, self.op, threshold,
            modulus=self.modulus, layers=self.layer, neurons=self.neuron, meta=dict(self.meta), **kwargs,
        )


# --- running the model ---------------------------------------------------------------------------


def _check_model_layers(model: HookedModel, layers) -> list[int]:
    return site_lib.check_layers(model, "mlp_post", layers)


def final_position_batches(prompts, batch_size: int):
    """(indices, unpadded tokens, final positions) per same-length batch."""
    batch_size = integer("batch_size", batch_size, minimum=1)
    for group in prompts.length_groups():
        for idx in group.split(batch_size):
            tokens = prompts.unpadded(idx)
            final = prompts.positions["final"][idx] - prompts.offset(idx)
            yield idx, tokens, final


def check_prompts(prompts, name: str = "prompts") -> None:
    if not all(hasattr(prompts, attr) for attr in ("tokens", "a", "b", "answer_tokens", "positions")):
        raise AnalysisError(
            f"{name} must be a PromptSet from arithinterp.tasks.arithmetic, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise AnalysisError(f"{name} is empty")


def importance(
    model: HookedModel,
    pairs: PromptPairs,
    layers: Optional[Iterable[int]] = None,
    method: str = "attribution",
    top_k: Optional[int] = 200,
    *,
    batch_size: int = 256,
    progress: bool = False,
) -> NeuronImportance:
    """Rank MLP neurons by their effect on the answer (Nikankin et al. 2025).

    The metric is the logit difference clean answer − corrupt answer at the final position.
    Each method is named for what it does to a neuron's final-position ``mlp_post`` activation:

    * ``"attribution"``: attribution patching (Nanda 2023; Syed et al. 2023), effect = gradient
      of the metric on the clean run × (corrupt − clean) activation; works on frozen models.
    * ``"patching"``: exact activation patching: the clean run with the neuron's activation set
      to its value on the corrupt prompt, effect = metric after − before (neurons batched together).
    * ``"mean_ablation"``: the clean run with the neuron's activation set to its mean ablation
      value, :func:`arithinterp.engine.mean_activation` over the clean prompts at the final
      position (the mean over all of them), effect = metric after − before.

    ``"ablation"`` is a deprecated name of ``"patching"`` (it always patched in the corrupt value).

    A neuron's score is mean + std over prompts of ``|effect|`` (the paper's mean + std; the
    magnitude *(choice)* so neurons that push either way count). Returns the top ``top_k`` per
    layer (``None``: all neurons).

    Args:
        pairs: ``PromptPairs`` (clean / corrupt prompts with aligned positions).
        layers: layers to score (default all).

    Returns :class:`NeuronImportance` with ``scores`` ``[len(layers), d_mlp]``.
    """
    check_belongs(model, "neurons.importance", pairs=pairs)
    if method in _DEPRECATED_METHODS:
        warnings.warn(
            f"importance method {method!r} is deprecated: it patches in the corrupt value; call it "
            f"{_DEPRECATED_METHODS[method]!r} (or use 'mean_ablation' to ablate)", DeprecationWarning, stacklevel=2,
        )
        method = _DEPRECATED_METHODS[method]
    if method not in IMPORTANCE_METHODS:
        raise ConfigError(f"unknown importance method {method!r}; accepted: {accepted(IMPORTANCE_METHODS)}")
    if not hasattr(pairs, "clean") or not hasattr(pairs, "corrupt"):
        raise AnalysisError(f"pairs must be PromptPairs (from prompts.counterfactual()), got {type(pairs).__name__}")
    check_prompts(pairs.clean, "pairs.clean")
    chosen = _check_model_layers(model, layers)
    d_mlp = int(model.cfg.d_mlp)
    if top_k is None:
        top_k = d_mlp
    top_k = integer("top_k", top_k, minimum=1, maximum=d_mlp, hint=" (d_mlp) or None")
    if method == "attribution":
        effects = _attribution(model, pairs, chosen, batch_size, progress)
    elif method == "patching":
        effects = _patch_effects(model, pairs, chosen, batch_size, progress)
    else:
        effects = _mean_ablation_effects(model, pairs, chosen, batch_size, progress)
    magnitude = effects.abs()  # [P, L, d_mlp]
    scores = magnitude.mean(0) + (magnitude.std(0) if magnitude.shape[0] > 1 else 0)
    top = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :top_k]
    return NeuronImportance(
        layers=chosen, scores=scores, top=top, method=method,
        meta=build_meta(model, n_pairs=len(pairs), top_k=top_k, vary=getattr(pairs, "vary", None), metric="logit_diff"),
    )


def _final_metric(logits: torch.Tensor, good: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Logit difference good − bad ``[B]`` from final-position logits ``[B, V]``."""
    rows = torch.arange(len(good))
    return logits[rows, good] - logits[rows, bad]


def _final_reads(layers: Sequence[int], final: torch.Tensor) -> list:
    return [engine.Read("mlp_post", layer, final) for layer in layers]


def _attribution(model, pairs, layers, batch_size, progress) -> torch.Tensor:
    """Attribution-patching effects ``[P, len(layers), d_mlp]``: the gradient is read by the
    engine at each ``mlp_post`` (``engine.run(..., metric=...)``), so frozen models work."""
    clean, corrupt = pairs.clean, pairs.corrupt
    out = torch.zeros(len(clean), len(layers), int(model.cfg.d_mlp))
    good, bad = clean.answer_tokens[:, 0], corrupt.answer_tokens[:, 0]
    batches = list(final_position_batches(clean, batch_size))
    for idx, tokens, final in tqdm(batches, desc="attribution", disable=not progress):
        reads = _final_reads(layers, final)
        corrupt_acts = engine.run(model, corrupt.unpadded(idx), reads=reads, logits="none").reads
        g, b = good[idx], bad[idx]
        clean_run = engine.run(model, tokens, reads=reads, metric=lambda logits, g=g, b=b: _final_metric(logits, g, b))
        grads = clean_run.grads if clean_run.grads is not None else [None] * len(reads)  # always set with a metric
        for i, (clean_act, grad, corrupt_act) in enumerate(zip(clean_run.reads, grads, corrupt_acts)):
            if grad is None:  # the metric does not depend on this layer
                continue
            out[idx, i] = (grad * (corrupt_act - clean_act)).float().cpu()
    return out


@torch.inference_mode()
def _replacement_effects(model, prompts, answers, layers, values_for, batch_size, progress, desc) -> torch.Tensor:
    """Effect ``[P, len(layers), d_mlp]`` of setting each neuron's final-position ``mlp_post``
    on ``prompts`` to ``values_for(idx, final)[i]`` (``[B, d_mlp]`` for layer ``layers[i]``):
    metric after − before, one neuron per sequence, many sequences stacked in one
    :func:`arithinterp.engine.run`. ``answers`` is ``(good, bad)`` answer tokens ``[P]``."""
    d_mlp = int(model.cfg.d_mlp)
    out = torch.zeros(len(prompts), len(layers), d_mlp)
    good, bad = answers
    # every (prompt, neuron) patch is its own sequence: batch prompts x a block of neurons
    block = max(1, batch_size // 8)
    jobs = list(final_position_batches(prompts, block))
    bar = tqdm(total=len(jobs) * len(layers), desc=desc, disable=not progress)
    for idx, tokens, final in jobs:
        rows = torch.arange(len(idx))
        values = values_for(idx, final)
        base_logits = engine.run(model, tokens).logits
        assert base_logits is not None  # the final position's, by default
        base = _final_metric(base_logits, good[idx], bad[idx])
        chunk = max(1, 4096 // len(idx))
        for i, layer in enumerate(layers):
            for start in range(0, d_mlp, chunk):
                neurons = torch.arange(start, min(start + chunk, d_mlp))
                reps = len(neurons)
                prow = rows.repeat(reps)
                pneuron = neurons.repeat_interleave(len(idx))
                value = values[i][prow, pneuron]

                def set_neuron(current, pneuron=pneuron, value=value):  # [reps * B, d_mlp] at the final position
                    current = current.clone()
                    every_row = torch.arange(len(current))
                    current[every_row, pneuron.to(current.device)] = value.to(current.device, current.dtype)
                    return current

                patch = engine.Intervention("mlp_post", layer, final.repeat(reps), value=set_neuron)
                logits = engine.run(model, tokens.repeat(reps, 1), [patch]).logits
                assert logits is not None  # the final position's, by default
                metric = _final_metric(logits, good[idx].repeat(reps), bad[idx].repeat(reps))
                effect = (metric - base.repeat(reps)).view(reps, len(idx)).T
                out[idx[:, None], i, neurons[None, :]] = effect.float().cpu()
            bar.update(1)
    bar.close()
    return out


@torch.inference_mode()
def _patch_effects(model, pairs, layers, batch_size, progress) -> torch.Tensor:
    """``"patching"``: each neuron set to its value on the corrupt prompt, ``[P, len(layers), d_mlp]``.

    The engine's stacked patch cells (:class:`arithinterp.engine.PatchRunner`): one cell per
    neuron, resumed from the patched layer at the final position with the clean run's keys and
    values reused (whole forwards, with a warning, where the model cannot be stepped). A neuron
    whose corrupt activation equals its clean one leaves the run unchanged: its effect is 0."""
    clean, corrupt = pairs.clean, pairs.corrupt
    d_mlp = int(model.cfg.d_mlp)
    out = torch.zeros(len(clean), len(layers), d_mlp)
    good, bad = clean.answer_tokens[:, 0], corrupt.answer_tokens[:, 0]
    block = max(1, batch_size // 8)
    jobs = list(final_position_batches(clean, block))
    bar = tqdm(total=len(jobs) * len(layers), desc="patch neurons", disable=not progress)
    for idx, tokens, final in jobs:
        B = len(idx)
        stepper, _ = engine.stepper_for(model, tokens)
        runner = engine.PatchRunner(model, stepper, "mlp_post", tokens, corrupt.unpadded(idx))
        g, b = good[idx], bad[idx]
        base = _final_metric(runner.base_logits.float(), g, b)
        chunk = max(1, 4096 // B)
        for i, layer in enumerate(layers):
            for start in range(0, d_mlp, chunk):
                neurons = torch.arange(start, min(start + chunk, d_mlp))
                pos = final[None].expand(len(neurons), -1).to(runner.tokens.device)
                unit = neurons.to(runner.tokens.device)
                changed = runner.cell_states(layer, pos, unit).cpu() != UNCHANGED  # [C, B]
                run = torch.nonzero(changed.any(1)).flatten()
                if len(run) == 0:
                    continue
                logits = runner.patched(layer, pos[run], unit[run]).float()  # [C', B, V]
                C = len(run)
                metric = _final_metric(logits.flatten(0, 1), g.repeat(C), b.repeat(C)).view(C, B).cpu()
                effect = torch.where(changed[run], metric - base.cpu()[None], torch.zeros(()))
                out[idx[:, None], i, neurons[run][None, :]] = effect.T
            bar.update(1)
    bar.close()
    return out


def _mean_ablation_effects(model, pairs, layers, batch_size, progress) -> torch.Tensor:
    """``"mean_ablation"``: each neuron set to its mean ablation value over the clean prompts."""
    clean = pairs.clean
    mean = mean_final_activation(model, clean, layers, batch_size)  # [L, d_mlp]

    def mean_values(idx, final):
        return [mean[i][None].expand(len(idx), -1) for i in range(len(layers))]

    answers = (clean.answer_tokens[:, 0], pairs.corrupt.answer_tokens[:, 0])
    return _replacement_effects(model, clean, answers, layers, mean_values, batch_size, progress, "mean-ablate neurons")


def _grid_index(prompts) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    a_vals = torch.unique(prompts.a)
    b_vals = torch.unique(prompts.b)
    ai = torch.searchsorted(a_vals, prompts.a)
    bi = torch.searchsorted(b_vals, prompts.b)
    return a_vals.tolist(), b_vals.tolist(), ai, bi


def _neuron_index(model: HookedModel, neurons) -> tuple[torch.Tensor, torch.Tensor]:
    """``neurons``: a NeuronImportance, a (layers, indices) pair, or ``[N, 2]`` (layer, neuron)."""
    if isinstance(neurons, NeuronImportance):
        layer, neuron = neurons.neurons()
    elif isinstance(neurons, tuple) and len(neurons) == 2:
        layer, neuron = (torch.as_tensor(x).long().flatten() for x in neurons)
    else:
        t = torch.as_tensor(neurons).long()
        if t.ndim != 2 or t.shape[1] != 2:
            raise SiteError(
                "neurons must be a NeuronImportance, a (layers, indices) pair or an [N, 2] tensor of "
                f"(layer, neuron); got shape {tuple(t.shape)}"
            )
        layer, neuron = t[:, 0], t[:, 1]
    if layer.shape != neuron.shape or layer.numel() == 0:
        raise SiteError("neurons must name at least one (layer, neuron) pair, with as many layers as indices")
    site_lib.check_layers(model, "mlp_post", sorted(set(layer.tolist())))
    d_mlp = int(model.cfg.d_mlp)
    if (neuron < 0).any() or (neuron >= d_mlp).any():
        raise SiteError(f"neuron indices must be in 0..{d_mlp - 1} (d_mlp = {d_mlp})")
    return layer, neuron


@torch.inference_mode()
def final_activations(
    model: HookedModel, prompts, layers: list[int], batch_size: int, progress: bool = False
) -> torch.Tensor:
    """``mlp_post`` at the final position: [P, len(layers), d_mlp] (reads of the engine)."""
    out = torch.zeros(len(prompts), len(layers), int(model.cfg.d_mlp))
    batches = list(final_position_batches(prompts, batch_size))
    for idx, tokens, final in tqdm(batches, desc="activations", disable=not progress):
        reads = engine.run(model, tokens, reads=_final_reads(layers, final), logits="none").reads
        for i, read in enumerate(reads):
            out[idx, i] = read.float().cpu()
    return out


def mean_final_activation(
    model: HookedModel, prompts: PromptSet, layers: Sequence[int], batch_size: int = 512
) -> torch.Tensor:
    """The mean ablation value of ``mlp_post`` at the final position, ``[len(layers), d_mlp]``.

    :func:`arithinterp.engine.mean_activation` (the one definition: per position counted from
    the end of the prompt, over the reference prompts that have it) of ``prompts``' final-position
    activations; every prompt has a final position, so this is the mean over all of ``prompts``.
    """
    acts = final_activations(model, prompts, list(layers), batch_size)  # [P, L, d_mlp]
    return engine.mean_activation(acts[:, None])[0]  # a one-position frame: the final position


def maps(
    model: HookedModel, prompts: PromptSet, neurons: Any, *, batch_size: int = 512, progress: bool = False
) -> NeuronMaps:
    """K and KV maps of neurons over the operand grid of ``prompts`` (Nikankin et al. 2025).

    K map: the neuron's ``mlp_post`` at the final position for each (a, b). KV map: K ×
    ``(W_out[neuron] @ W_U)[answer token]``, the neuron's direct logit-lens contribution to the
    true answer's (first) token. Grid cells with no prompt (e.g. dropped by ``correct_only``) are
    NaN. Works for any operator: the grid is the sorted unique ``prompts.a`` × ``prompts.b``.

    Args:
        prompts: a PromptSet from :func:`arithinterp.tasks.arithmetic` covering a grid.
        neurons: a :class:`NeuronImportance` (its top-k), a ``(layers, indices)`` pair or an
            ``[N, 2]`` tensor of (layer, neuron).
    """
    check_belongs(model, "neurons.maps", prompts=prompts)
    check_prompts(prompts)
    layer, neuron = _neuron_index(model, neurons)
    layers = sorted(set(layer.tolist()))
    acts = final_activations(model, prompts, layers, batch_size, progress)  # [P, L, d_mlp]
    li = torch.tensor([layers.index(l) for l in layer.tolist()])
    k_values = acts[:, li, neuron].T  # [N, P]
    with torch.inference_mode():
        W_out = model.W_out.detach().float()  # [n_layers, d_mlp, d_model]
        W_U = model.W_U.detach().float()  # [d_model, d_vocab]
        value = W_out[layer, neuron] @ W_U  # [N, d_vocab]
    answer = prompts.answer_tokens[:, 0]
    kv_values = k_values * value[:, answer]
    a_vals, b_vals, ai, bi = _grid_index(prompts)
    N = len(layer)
    k_maps = torch.full((N, len(a_vals), len(b_vals)), float("nan"))
    kv_maps = torch.full_like(k_maps, float("nan"))
    k_maps[:, ai, bi] = k_values
    kv_maps[:, ai, bi] = kv_values
    missing = int(torch.isnan(k_maps[0]).sum())
    return NeuronMaps(
        layer=layer, neuron=neuron, a_values=a_vals, b_values=b_vals, k_maps=k_maps, kv_maps=kv_maps,
        op=prompts.op, modulus=prompts.modulus,
        meta=build_meta(model, n_prompts=len(prompts), missing_cells=missing, op=prompts.op, template=prompts.template),
    )


def classify(
    model: HookedModel,
    prompts: PromptSet,
    layers: Optional[Iterable[int]] = None,
    top_k: Optional[int] = 200,
    threshold: float = 0.6,
    *,
    importance_scores: Optional[NeuronImportance] = None,
    pairs: Optional[PromptPairs] = None,
    method: str = "attribution",
    vary: str = "a",
    bottom: Optional[bool] = None,
    families: Optional[Sequence[str]] = None,
    min_cells: int = 3,
    max_fraction: float = 0.5,
    fdr: Optional[float] = 0.05,
    shuffle_control: bool = True,
    registry: Any = None,
    seed: int = 0,
    batch_size: int = 512,
    progress: bool = False,
) -> HeuristicTable:
    """Classify a model's important MLP neurons into heuristics (Nikankin et al. 2025).

    Runs :func:`importance` (unless ``top_k`` is None — all neurons — or ``importance_scores``
    is given) on ``pairs`` (default ``prompts.counterfactual(vary, seed)``), :func:`maps` on
    ``prompts`` and :func:`classify_maps` (``fdr``, ``shuffle_control`` and ``registry`` are
    passed on: a label needs the 0.6 threshold and the cell-shuffle test at that false-discovery
    rate). ``bottom`` defaults to ``model.cfg.gated_mlp``.
    """
    check_belongs(model, "neurons.classify", prompts=prompts, pairs=pairs)
    check_prompts(prompts)
    threshold = check_threshold(threshold)
    chosen = _check_model_layers(model, layers)
    if importance_scores is None and top_k is not None:
        pairs = pairs if pairs is not None else prompts.counterfactual(vary=vary, seed=seed)
        importance_scores = importance(model, pairs, chosen, method=method, top_k=top_k, batch_size=batch_size,
                                       progress=progress)
    if importance_scores is not None:
        missing = [l for l in chosen if l not in importance_scores.layers]
        if missing:
            raise ConfigError(
                f"importance_scores has no scores for layers {missing}; it covers {importance_scores.layers}")
        rows = [importance_scores.layers.index(l) for l in chosen]
        top = importance_scores.top[rows]
        layer = torch.tensor(chosen).repeat_interleave(top.shape[1])
        neuron = top.flatten()
        imp = importance_scores.scores[rows].gather(1, top).flatten()
    else:
        d_mlp = int(model.cfg.d_mlp)
        layer = torch.tensor(chosen).repeat_interleave(d_mlp)
        neuron = torch.arange(d_mlp).repeat(len(chosen))
        imp = None
    neuron_maps = maps(model, prompts, (layer, neuron), batch_size=batch_size, progress=progress)
    if bottom is None:
        bottom = bool(getattr(model.cfg, "gated_mlp", False))
    return classify_maps(
        neuron_maps.k_maps, neuron_maps.kv_maps, neuron_maps.a_values, neuron_maps.b_values, prompts.op, threshold,
        modulus=prompts.modulus, families=families, bottom=bottom, min_cells=min_cells, max_fraction=max_fraction,
        layers=layer, neurons=neuron, importance=imp, seed=seed, progress=progress,
        fdr=fdr, shuffle_control=shuffle_control, registry=registry,
        meta=build_meta(model, n_prompts=len(prompts), top_k=top_k, method=method if imp is not None else None,
                        missing_cells=neuron_maps.meta.get("missing_cells")),
    )
