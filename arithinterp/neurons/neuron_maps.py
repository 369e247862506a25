"""K and KV maps of neurons over the operand grid (Nikankin et al. 2025): :func:`maps` → :class:`NeuronMaps`.

K map: a neuron's ``mlp_post`` at the final position for each (a, b); KV map: K times the neuron's
direct logit-lens contribution to the true answer's first token. :class:`MapRows` serves the maps
of any rows of a neuron list from one pass of reads over the prompts where memory allows.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import pandas as pd
import torch

from arithinterp import sites as site_lib
from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.engine.budget import memory_budget, release_freed_memory
from arithinterp.errors import AnalysisError, SiteError
from arithinterp.neurons.final_reads import check_prompts, final_batches, read_batch_size
from arithinterp.neurons.neuron_importance import NeuronImportance
from arithinterp.neurons.scoring import classify_maps
from arithinterp.neurons.table import HeuristicTable
from arithinterp.results import NON_NEGATIVE, Result, build_meta
from arithinterp.types import ByteSize, HookedModel, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet


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

    # what load checks: the axes fields share and the values they may take
    _shapes = {"layer": "map", "neuron": "map", "a_values": "a", "b_values": "b", "k_maps": "map a b",
               "kv_maps": "map a b"}
    _legal = {"layer": NON_NEGATIVE, "neuron": NON_NEGATIVE}

    def to_frame(self) -> pd.DataFrame:
        """One row per neuron × grid cell: its K and KV value.

        Returns:
            A pandas DataFrame.
        """
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
        """Heatmaps of row ``index``'s maps over (a, b).

        Args:
            index: The neuron's row.
            kind: ``"K"``, ``"KV"`` or ``"both"``.
            **kwargs: Passed to :func:`arithinterp.viz.neurons.plot_maps`.

        Returns:
            A plotly Figure.
        """
        return draw(self, index=index, kind=kind, **kwargs)

    def classify(self, threshold: float = 0.6, **kwargs) -> HeuristicTable:
        """:func:`~arithinterp.neurons.classify_maps` on these maps.

        Args:
            threshold: The score a label needs.
            **kwargs: Passed to :func:`~arithinterp.neurons.classify_maps`.

        Returns:
            The classification.
        """
        return classify_maps(
            self.k_maps, self.kv_maps, self.a_values, self.b_values, self.op, threshold=threshold,
            modulus=self.modulus, layers=self.layer, neurons=self.neuron, meta=dict(self.meta), **kwargs,
        )


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


def _answer_values(model: HookedModel, layer: torch.Tensor, neuron: torch.Tensor,
                   answers: torch.Tensor) -> torch.Tensor:
    """``(W_out[neuron] @ W_U)[:, answers]`` ``[N, len(answers)]``: each neuron's logit-lens value for
    the answer tokens only (never the ``[N, d_vocab]`` product)."""
    with torch.inference_mode():
        W_U = model.W_U.detach()[:, answers].float()  # [d_model, U]
        layers = torch.unique(layer).tolist()
        try:  # one layer's weight at a time where blocks expose it, else the stacked [n_layers, d_mlp, d_model]
            W_outs = {l: model.blocks[l].mlp.W_out for l in layers}
        except AttributeError:
            stacked = model.W_out
            W_outs = {l: stacked[l] for l in layers}
        out = torch.empty(len(layer), len(answers))
        for l in layers:
            rows = torch.nonzero(layer == l).flatten()
            out[rows] = W_outs[l].detach()[neuron[rows]].float() @ W_U
    return out


class MapRows:
    """K and KV maps ``[n, A, B]`` of any rows of a neuron list.

    The final-position activations of a group of rows (``[rows, prompts]``: as many rows as fit
    ``buffer_share`` of the budget, at least the rows asked for) come from one pass of reads-only
    forwards over ``prompts`` that read only those rows' layers (batches in ``forward_share``);
    later requests inside the group are served from it, so every neuron of a model usually costs
    one pass over the prompts, not one per chunk.

    Args:
        model: The hooked model.
        prompts: The prompts covering the operand grid.
        layer: Each row's layer, long [N].
        neuron: Each row's neuron, long [N].
        batch_size: Prompts per forward, or ``None`` (sized from ``budget``).
        budget: Bytes available.
        progress: Show progress bars.
        forward_share: The share of ``budget`` the forwards' batches may use.
        buffer_share: The share of ``budget`` the kept activations may use.
    """

    def __init__(self, model, prompts, layer: torch.Tensor, neuron: torch.Tensor, batch_size: Optional[int],
                 budget: int, progress: bool = False, forward_share: float = 1.0, buffer_share: float = 0.0):
        self.model, self.prompts, self.layer, self.neuron = model, prompts, layer, neuron
        self.batch_size, self.budget, self.progress, self.forward_share = batch_size, budget, progress, forward_share
        self.group = int(buffer_share * budget // (4 * len(prompts)))  # rows whose activations one pass keeps
        self.a_values, self.b_values, self.ai, self.bi = _grid_index(prompts)
        answer = prompts.answer_tokens[:, 0]
        tokens, inverse = torch.unique(answer, return_inverse=True)
        self.value = _answer_values(model, layer, neuron, tokens)  # [N, U]
        self.answer_cell = torch.zeros(len(self.a_values), len(self.b_values), dtype=torch.long)
        self.answer_cell[self.ai, self.bi] = inverse
        self.present = torch.zeros(len(self.a_values), len(self.b_values), dtype=torch.bool)
        self.present[self.ai, self.bi] = True
        self._rows = (0, 0)
        self._acts = torch.empty(0, len(prompts))

    def _read(self, start: int, stop: int) -> torch.Tensor:
        """``mlp_post`` at the final position of rows ``start:stop``: ``[stop - start, prompts]``."""
        layer, neuron = self.layer[start:stop], self.neuron[start:stop]
        layers = sorted(set(layer.tolist()))
        acts = torch.empty(stop - start, len(self.prompts))
        batch = read_batch_size(self.model, self.prompts, layers, self.budget, self.batch_size, self.forward_share)
        desc = f"mlp_post, layers {layers[0]}-{layers[-1]}"
        for idx, reads in final_batches(self.model, self.prompts, layers, batch, self.progress, desc):
            for read, l in zip(reads, layers):
                rows = torch.nonzero(layer == l).flatten()
                acts[rows[:, None], idx[None]] = read[:, neuron[rows]].T
        release_freed_memory()  # the forwards' batches are done; the scoring should not add to their peak
        if not bool(torch.isfinite(acts).all()):
            where = int(layer[torch.nonzero(~torch.isfinite(acts).all(1)).flatten()[0]])
            raise AnalysisError(f"layer {where}'s mlp_post activations are not finite (NaN or inf) on some prompts: "
                                "the model's weights or activations are broken; no map can be scored")
        return acts

    def __call__(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and KV maps of rows ``start:stop``.

        Args:
            start: The first row.
            stop: One past the last row.

        Returns:
            ``(k_maps, kv_maps)``, each [stop - start, A, B] (NaN where the grid has no prompt).
        """
        lo, hi = self._rows
        if not lo <= start < stop <= hi:
            hi = max(stop, min(len(self.layer), start + self.group))
            self._acts = torch.empty(0)  # the old group goes before the new one is read
            self._acts, self._rows = self._read(start, hi), (start, hi)
            lo = start
        acts = self._acts[start - lo:stop - lo]
        n, A, B = stop - start, len(self.a_values), len(self.b_values)
        k_maps = torch.full((n, A, B), float("nan"))
        k_maps[:, self.ai, self.bi] = acts
        value = self.value[start:stop].gather(1, self.answer_cell.flatten()[None].expand(n, -1))  # [n, A * B]
        kv_maps = k_maps * value.view(n, A, B)
        return k_maps, kv_maps


@checked
def maps(
    model: HookedModel, prompts: PromptSet, *, neurons: Any, batch_size: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None, progress: bool = True,
) -> NeuronMaps:
    """K and KV maps of neurons over the operand grid of ``prompts`` (Nikankin et al. 2025).

    K map: the neuron's ``mlp_post`` at the final position for each (a, b). KV map: K ×
    ``(W_out[neuron] @ W_U)[answer token]``, the neuron's direct logit-lens contribution to the
    true answer's (first) token. Grid cells with no prompt (e.g. dropped by ``correct_only``) are
    NaN. Works for any operator: the grid is the sorted unique ``prompts.a`` × ``prompts.b``.
    The maps are filled batch by batch (no ``[prompts, layers, d_mlp]`` grid is kept); forwards
    are sized from ``max_memory`` (bytes on top of the model and the returned maps) unless
    ``batch_size`` is given.

    Args:
        model: the hooked model.
        prompts: a PromptSet from :func:`arithinterp.tasks.arithmetic` covering a grid.
        neurons: a :class:`NeuronImportance` (its top-k), a ``(layers, indices)`` pair or an
            ``[N, 2]`` tensor of (layer, neuron).
        batch_size: prompts per forward (default: from ``max_memory``).
        max_memory: bytes on top of the model and the returned maps.
        progress: show a progress bar.

    Returns:
        :class:`NeuronMaps` with ``k_maps`` / ``kv_maps`` ``[N, A, B]``.

    Raises:
        SiteError: ``neurons`` names no neuron, or one out of range.
        ConfigError: ``batch_size`` is not a positive int or None.
        AnalysisError: ``prompts`` is not a prompt set, or the activations are not finite.
    """
    check_belongs(model, "neurons.maps", prompts=prompts)
    check_prompts(prompts)
    budget = memory_budget(model, max_memory)
    layer, neuron = _neuron_index(model, neurons)
    rows = MapRows(model, prompts, layer, neuron, batch_size, budget, progress)
    k_maps, kv_maps = rows(0, len(layer))
    missing = int((~rows.present).sum())
    return NeuronMaps(
        layer=layer, neuron=neuron, a_values=rows.a_values, b_values=rows.b_values, k_maps=k_maps, kv_maps=kv_maps,
        op=prompts.op, modulus=prompts.modulus,
        meta=build_meta(model, n_prompts=len(prompts), missing_cells=missing, op=prompts.op, template=prompts.template),
    )
