"""Per-layer TopK transcoders: an MLP's input mapped to its output through sparse features.

A transcoder of layer ``l`` reads the MLP's input ``x`` (after its norm, site ``mlp_in``,
``[..., d_model]``) and writes the MLP's output (site ``mlp_out``) as

    pre  = x @ W_enc + b_enc                       [..., F]
    acts = TopK(ReLU(pre), k)                      [..., F]  (all but the k largest set to 0)
    out  = acts @ W_dec + b_dec + x @ W_skip       [..., d_model]

(Dunefsky et al. 2024, "Transcoders find interpretable LLM feature circuits"; TopK as in Gao et
al. 2024, "Scaling and evaluating sparse autoencoders"; the linear skip as in Ameisen et al. 2025,
"Circuit Tracing"). Each decoder row has unit norm, so a feature's activation is the length of
what it writes. :class:`Transcoders` holds one transcoder per layer with the metrics measured when
they were trained, and builds the engine interventions that swap MLPs for transcoders.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import pandas as pd
import torch

from arithinterp.engine import Intervention
from arithinterp.errors import AnalysisError, SiteError
from arithinterp.results import Result

Edit = Callable[[torch.Tensor], torch.Tensor]  # acts [B, T, F] -> acts [B, T, F]


def topk_activations(pre: torch.Tensor, k: int) -> torch.Tensor:
    """``ReLU(pre)`` ``[..., F]`` with all but its ``k`` largest entries per row set to zero."""
    values, index = torch.relu(pre).topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, index, values)


@dataclasses.dataclass(frozen=True)
class Transcoders(Result):
    """One TopK transcoder per layer of a model (stacked over ``layers``).

    Tensors: ``W_enc [L, d, F]``, ``b_enc [L, F]``, ``W_dec [L, F, d]`` (unit rows), ``b_dec [L, d]``,
    ``W_skip [L, d, d]`` (zeros without a skip). ``metrics``: one dict per layer measured on held-out
    prompts (``fvu``, ``l0``, ``dead_fraction``) and model-level ``replacement`` numbers (top-1
    agreement and KL of the replacement model against the real one). ``meta``: provenance.
    """

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    W_skip: torch.Tensor
    layers: list
    k: int
    metrics: dict
    meta: dict

    @property
    def n_features(self) -> int:
        return int(self.W_enc.shape[-1])

    def index(self, layer: int) -> int:
        """The stacked index of model layer ``layer``."""
        if layer not in self.layers:
            raise SiteError(f"no transcoder for layer {layer}; these transcoders cover layers {self.layers}")
        return self.layers.index(layer)

    def pre(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Feature pre-activations ``[..., F]`` of MLP inputs ``x [..., d]``."""
        i = self.index(layer)
        return x.to(self.W_enc.dtype) @ self.W_enc[i] + self.b_enc[i]

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., F]`` (k non-zero per row) of MLP inputs ``x [..., d]``."""
        return topk_activations(self.pre(layer, x), self.k)

    def linear(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The part of the output ``[..., d]`` that no feature writes: ``b_dec + x @ W_skip``."""
        i = self.index(layer)
        return self.b_dec[i] + x.to(self.W_skip.dtype) @ self.W_skip[i]

    def decode(self, layer: int, acts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The transcoder's MLP output ``[..., d]`` from activations ``acts [..., F]`` and inputs ``x``."""
        return acts @ self.W_dec[self.index(layer)] + self.linear(layer, x)

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.decode(layer, self.encode(layer, x), x)

    def interventions(self, layers: Optional[Sequence[int]] = None,
                      edits: Optional[dict] = None) -> list[Intervention]:
        """Engine interventions replacing each MLP's output by its transcoder's (no error term):
        the *replacement model*. ``edits``: ``{layer: f(acts [B, T, F]) -> acts}`` applied to a
        layer's feature activations before decoding (clamping, scaling or zeroing features)."""
        chosen = list(self.layers) if layers is None else list(layers)
        edits = dict(edits or {})
        for layer in [*chosen, *edits]:
            self.index(layer)
        out = []
        for layer in chosen:
            edit = edits.get(layer)

            def value(x: torch.Tensor, layer: int = layer, edit: Optional[Edit] = edit) -> torch.Tensor:
                acts = self.encode(layer, x)
                if edit is not None:
                    acts = edit(acts)
                return self.decode(layer, acts, x)

            out.append(Intervention("mlp_out", layer, value=value, input_site="mlp_in"))
        return out

    def to_frame(self) -> pd.DataFrame:
        """One row per layer: FVU, L0, dead fraction, features, k, and the model-level replacement numbers."""
        replacement = self.metrics.get("replacement", {})
        rows = []
        for layer, row in zip(self.layers, self.metrics.get("layers", [])):
            rows.append(dict(layer=layer, n_features=self.n_features, k=self.k, **row,
                             replacement_agreement=replacement.get("agreement"),
                             replacement_kl=replacement.get("kl")))
        return pd.DataFrame(rows)

    def plot(self, **kwargs: Any):
        from arithinterp.viz.features import plot_transcoder_metrics

        return plot_transcoder_metrics(self.to_frame(), title=kwargs.get("title"))

    def check_model(self, model: Any) -> None:
        """Raise unless the transcoders fit ``model`` (its width and layers)."""
        d = int(model.cfg.d_model)
        if int(self.W_enc.shape[1]) != d or max(self.layers) >= int(model.cfg.n_layers):
            raise AnalysisError(
                f"these transcoders read d_model={int(self.W_enc.shape[1])} at layers {self.layers}; "
                f"the model has d_model={d} and {int(model.cfg.n_layers)} layers"
            )
