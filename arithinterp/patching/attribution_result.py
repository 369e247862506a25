"""The attribution estimates of several sites from one set of passes, as one result."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from arithinterp.drawing import draw
from arithinterp.errors import ConfigError, ResultFileError, accepted
from arithinterp.metrics import DIRECTIONS
from arithinterp.patching.core import ATTRIBUTE_SITES, PatchResult
from arithinterp.results import DISTINCT, JSON_FILE, NON_NEGATIVE, Result

if TYPE_CHECKING:
    from pathlib import Path

    import pandas as pd
    import plotly.graph_objects as go


@dataclass(frozen=True)
class AttributionResult(Result):
    """:func:`~arithinterp.patching.attribute_sites`: one :class:`PatchResult` per site, estimated from
    the same passes over the same pairs. ``result[site]`` is the site's PatchResult.

    The sites' cells differ in shape (per head at ``attn_z``, per neuron at ``mlp_post``), so each
    site's cells are flattened and laid end to end along one ``cell`` axis.

    Attributes:
        sites: The sites, in the order asked for.
        values: ``[pair, cell]``: every site's per-pair values, its cells flattened.
        mean: ``[cell]`` mean over pairs.
        sem: ``[cell]`` standard error.
        ci_low: ``[cell]`` lower end of the bootstrap interval.
        ci_high: ``[cell]`` upper end.
        cell_shapes: Per site, the shape of its cells (``[layer, position?, head_or_neuron?]``).
        axes: Per site, the names of its cell axes.
        layers: Per site, the layers scored.
        heads: Per site, the heads scored (empty where the site has none).
        neurons: Per site, the neurons scored (empty where the site has none).
        clean_baseline: ``[pair]`` the metric on the clean run.
        corrupt_baseline: ``[pair]`` the metric on the corrupt run.
        positions: The position labels every site shares.
        tokens: The token at each position (first pair's clean prompt).
        metric: The metric's name.
        direction: ``"denoise"`` or ``"noise"``.
        method: ``"attribution"`` or ``"integrated-gradients"``.
        normalized: Whether the values are normalized.
        site_meta: Per site, its PatchResult's ``meta``.
        meta: Provenance of the whole.
    """

    sites: list
    values: torch.Tensor
    mean: torch.Tensor
    sem: torch.Tensor
    ci_low: torch.Tensor
    ci_high: torch.Tensor
    cell_shapes: list
    axes: list
    layers: list
    heads: list
    neurons: list
    clean_baseline: torch.Tensor
    corrupt_baseline: torch.Tensor
    positions: list
    tokens: list
    metric: str
    direction: str
    method: str
    normalized: bool
    site_meta: list
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"sites": "site", "values": "pair cell", "mean": "cell", "sem": "cell", "ci_low": "cell",
               "ci_high": "cell", "cell_shapes": "site", "axes": "site", "layers": "site", "heads": "site",
               "neurons": "site", "site_meta": "site", "clean_baseline": "pair", "corrupt_baseline": "pair",
               "positions": "position", "tokens": "position"}
    _legal = {"sites": [DISTINCT], "sem": NON_NEGATIVE, "direction": DIRECTIONS}

    @classmethod
    def of(cls, parts: list[PatchResult], meta: Optional[dict] = None) -> "AttributionResult":
        """One result from the PatchResults of several sites over the same pairs and positions."""
        first = parts[0]
        return cls(
            sites=[p.site for p in parts],
            values=torch.cat([p.values.reshape(p.values.shape[0], -1) for p in parts], 1),
            mean=torch.cat([p.mean.reshape(-1) for p in parts]),
            sem=torch.cat([p.sem.reshape(-1) for p in parts]),
            ci_low=torch.cat([p.ci_low.reshape(-1) for p in parts]),
            ci_high=torch.cat([p.ci_high.reshape(-1) for p in parts]),
            cell_shapes=[list(p.mean.shape) for p in parts],
            axes=[list(p.axes) for p in parts],
            layers=[list(p.layers) for p in parts],
            heads=[list(p.heads) for p in parts],
            neurons=[list(p.neurons) for p in parts],
            clean_baseline=first.clean_baseline,
            corrupt_baseline=first.corrupt_baseline,
            positions=list(first.positions),
            tokens=list(first.tokens),
            metric=first.metric,
            direction=first.direction,
            method=first.method,
            normalized=first.normalized,
            site_meta=[dict(p.meta) for p in parts],
            meta=dict(meta if meta is not None else first.meta),
        )

    def __getitem__(self, site: str) -> PatchResult:
        """The PatchResult of ``site``."""
        if site not in self.sites:
            raise ConfigError(f"site {site!r} was not attributed; this result holds {accepted(self.sites)}")
        i = self.sites.index(site)
        start = sum(math.prod(shape) for shape in self.cell_shapes[:i])
        shape = list(self.cell_shapes[i])
        cells = slice(start, start + math.prod(shape))
        return PatchResult(
            values=self.values[:, cells].reshape(self.values.shape[0], *shape),
            mean=self.mean[cells].reshape(shape), sem=self.sem[cells].reshape(shape),
            ci_low=self.ci_low[cells].reshape(shape), ci_high=self.ci_high[cells].reshape(shape),
            clean_baseline=self.clean_baseline, corrupt_baseline=self.corrupt_baseline, axes=list(self.axes[i]),
            layers=list(self.layers[i]), positions=list(self.positions) if "position" in self.axes[i] else [],
            heads=list(self.heads[i]), neurons=list(self.neurons[i]),
            tokens=list(self.tokens) if "position" in self.axes[i] else [], site=site, metric=self.metric,
            direction=self.direction, method=self.method, normalized=self.normalized, meta=dict(self.site_meta[i]),
        )

    def __len__(self) -> int:
        return len(self.sites)

    @property
    def n_pairs(self) -> int:
        return int(self.values.shape[0])

    @classmethod
    def load(cls, path: str | Path, *, unsealed: bool = False) -> "AttributionResult":
        """Read a result written by :meth:`save` (see :meth:`Result.load`), checking that the sites' cells
        add up to the cell axis and that every site is one that can be attributed."""
        result = super().load(path, unsealed=unsealed)
        where = f"{path}/{JSON_FILE}"
        for i, shape in enumerate(result.cell_shapes):
            if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise ResultFileError(f"{where}: field 'cell_shapes' holds {shape!r} for site {i}, not a shape; "
                                      "the file is damaged")
            if len(shape) != len(result.axes[i]):
                raise ResultFileError(f"{where}: field 'cell_shapes' gives site {i} {len(shape)} axes and field "
                                      f"'axes' {len(result.axes[i])}; the file is damaged")
        total = sum(math.prod(shape) for shape in result.cell_shapes)
        if total != result.mean.shape[0]:
            raise ResultFileError(f"{where}: field 'cell_shapes' adds up to {total} cells, the tensors hold "
                                  f"{result.mean.shape[0]}; the file is damaged")
        unknown = [s for s in result.sites if s not in ATTRIBUTE_SITES]
        if unknown:
            raise ResultFileError(f"{where}: field 'sites' holds {unknown[0]!r}, which cannot be attributed; "
                                  "the file is damaged")
        return result

    def to_frame(self) -> pd.DataFrame:
        """One row per cell of every site: the site's PatchResult frames, one after another."""
        import pandas as pd

        return pd.concat([self[site].to_frame() for site in self.sites], ignore_index=True)

    def plot(self, site: Optional[str] = None, **kwargs: Any) -> go.Figure:
        """Every site's figure in one column (see viz.patching), or ``site``'s alone."""
        if site is not None:
            return self[site].plot(**kwargs)
        return draw(self, **kwargs)
