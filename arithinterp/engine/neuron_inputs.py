"""MLP neurons as receivers: each chosen neuron's own copy of its MLP's input.

A neuron's pre-activation is ``W_in[:, n] · ln2(x) + b_in[n]`` (in a gated MLP also its gate,
``W_gate[:, n] · ln2(x) + b_gate[n]``), where ``x`` is the MLP's input before its norm: the sum of
every upstream sender's output. So a neuron is a receiver of its own: the edge ``s → MLP{l}N{n}``
changes the input of that neuron alone, ``x + δ_n``, while every other neuron of the MLP reads
``x`` (Wang et al. 2023's path patching, one receiver finer than the MLP). That input exists in
no tensor of the model, so, as :mod:`~arithinterp.engine.edges` does for a head's query, key
and value, the neuron's projections are recomputed at their output hooks (``mlp.in.hook_out``,
``mlp.gate.hook_out``) from the model's own ``ln2`` applied to ``x + δ_n``, with ``x`` ln2's
input in this very run. With δ = 0 this is the model's own value. A zero probe added there gives
the gradient at the neuron's input (EAP, Syed et al. 2023).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from arithinterp.errors import AnalysisError

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

PROJECTIONS = ("in", "gate")  # the MLP's input projections; a neuron's activation reads both where both exist


class NeuronInputs:
    """The chosen neurons' input projections: ``neurons`` ``{layer: neuron ids}``.

    ``ids[layer]`` [u] (sorted), ``weights[layer, proj]`` ``([d_model, u], bias [u] | None)``
    for each input projection the MLP has (``"in"``, and ``"gate"`` in gated MLPs).
    """

    def __init__(self, model: HookedModel, neurons: Mapping[int, Sequence[int]]):
        from arithinterp.engine.edges import linear_weight

        self.model = model
        self.ids = {int(layer): torch.tensor(sorted(int(n) for n in ids), dtype=torch.long)
                    for layer, ids in sorted(neurons.items())}
        self.weights: dict = {}
        for layer, ids in self.ids.items():
            mlp = model.blocks[layer].mlp
            found = [p for p in PROJECTIONS if hasattr(mlp, p)]
            if "in" not in found:
                raise AnalysisError(
                    f"neurons as receivers need an MLP with a separate input projection ('in'); layer {layer}'s MLP "
                    f"({type(mlp).__name__}) has none"
                )
            for proj in found:
                w, b = linear_weight(getattr(mlp, proj), 1, True)  # [1, d_model, d_mlp], [1, d_mlp]
                self.weights[layer, proj] = (w[0][:, ids].detach(), None if b is None else b[0][ids].detach())

    @property
    def layers(self) -> list[int]:
        return list(self.ids)

    def units(self, layer: int) -> int:
        return len(self.ids[layer])

    def projections(self, layer: int) -> list[str]:
        return [p for p in PROJECTIONS if (layer, p) in self.weights]

    def hook(self, layer: int, proj: str) -> str:
        return f"blocks.{layer}.mlp.{proj}.hook_out"

    def normed(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The MLP's own norm applied to the neurons' inputs ``x`` [N, T, u, d] (none: ``x``)."""
        ln = getattr(self.model.blocks[layer], "ln2", None)
        return x if ln is None else ln(x)

    def replace(self, layer: int, proj: str, act: Any, normed: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
        """The projection's output ``act`` [N, T, d_mlp] with the chosen neurons ``units`` (indices
        into ``ids[layer]``) recomputed from ``normed`` [N, T, len(units), d], their own normed inputs."""
        w, b = self.weights[layer, proj]
        w = w[:, units]
        new = torch.einsum("ntud,du->ntu", normed.to(w.dtype), w.to(normed.device))
        if b is not None:
            new = new + b[units].to(new.device)
        out = act.clone()
        out[..., self.ids[layer][units].to(act.device)] = new.to(act.dtype)
        return out


def neuron_input_bytes(model: HookedModel, seq_len: int, n_neurons: int) -> int:
    """One prompt's receiver neurons in a probed run and its backward: about 6 tensors
    ``[T, n_neurons, d_model]`` in float32 (the input copies, their norm, the probe, gradients)."""
    return 6 * 4 * seq_len * n_neurons * int(model.cfg.d_model)
