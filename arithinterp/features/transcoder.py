"""Per-layer transcoders: an MLP's input mapped to its output through sparse features.

A transcoder of layer ``l`` reads the MLP's input ``x`` (after its norm, site ``mlp_in``,
``[..., d_model]``) and writes the MLP's output (site ``mlp_out``) as

    pre  = x @ W_enc + b_enc                       [..., F]
    acts = act(pre)                                [..., F]
    out  = acts @ W_dec + b_dec + x @ W_skip       [..., d_model]

with ``act`` one of :data:`ACTIVATIONS`: ``"topk"`` (``TopK(ReLU(pre), k)``: all but the k largest
set to 0, as this package trains them and as SAELens runs TopK), ``"topk-signed"`` (the k largest
whatever their sign, no ReLU: circuit-tracer's ``TopK``), ``"relu"``, or ``"jumprelu"`` (``pre`` where
``pre > threshold``, else 0: Rajamanoharan et al. 2024, as Gemma Scope's transcoders). A set read from
another tool's files may read and write other sites (an SAE reads and writes the same one).

(Dunefsky et al. 2024, "Transcoders find interpretable LLM feature circuits"; TopK as in Gao et
al. 2024, "Scaling and evaluating sparse autoencoders"; the linear skip as in Ameisen et al. 2025,
"Circuit Tracing"). Each decoder row has unit norm, so a feature's activation is the length of
what it writes. :class:`Transcoders` holds one transcoder per layer with the metrics measured when
they were trained, and builds the engine interventions that swap MLPs for transcoders.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Callable, Optional, Sequence

import pandas as pd
import torch

from arithinterp.drawing import draw
from arithinterp.engine import Write
from arithinterp.checks import check_fingerprint, check_model
from arithinterp.errors import AnalysisError, ConfigError, ModelMismatchError, SiteError
from arithinterp.results import FLOATING, INCREASING, NON_NEGATIVE, POSITIVE, Result
from arithinterp.types import PositiveInt, checked

Edit = Callable[[torch.Tensor], torch.Tensor]  # acts [B, T, F] -> acts [B, T, F]


ACTIVATIONS = ("topk", "topk-signed", "relu", "jumprelu")


@checked
def topk_activations(pre: torch.Tensor, k: PositiveInt) -> torch.Tensor:
    """The TopK activation: ``ReLU(pre)`` with all but its ``k`` largest entries per row set to zero.

    Args:
        pre (Float[Tensor, "... feature"]): Pre-activations.
        k: Entries kept per row, in ``1..feature``.

    Returns:
        Float[Tensor, "... feature"]: The activations.

    Raises:
        ConfigError: ``pre`` has no feature axis, or ``k`` exceeds its length.
    """
    if pre.ndim == 0 or k > pre.shape[-1]:
        raise ConfigError(f"k={k} must lie in 1..{pre.shape[-1] if pre.ndim else 0} (the features per row of pre, "
                          f"shape {tuple(pre.shape)})")
    return topk_unchecked(pre, k)


def topk_unchecked(pre: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_activations` unchecked, for the training and forward loops."""
    values, index = torch.relu(pre).topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, index, values)


def activate(pre: torch.Tensor, activation: str, k: int, threshold: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Feature activations ``[..., F]`` from pre-activations ``pre [..., F]`` under ``activation``
    (one of :data:`ACTIVATIONS`; ``threshold [F]`` for ``"jumprelu"``)."""
    if activation == "topk":
        return topk_unchecked(pre, k)
    if activation == "topk-signed":
        values, index = pre.topk(k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, index, values)
    if activation == "relu":
        return torch.relu(pre)
    if activation == "jumprelu":
        if threshold is None:
            raise AnalysisError("a 'jumprelu' transcoder needs a threshold per feature; none was given")
        return pre * (pre > threshold.to(pre.dtype))
    raise ConfigError(f"unknown activation {activation!r}; accepted: {', '.join(ACTIVATIONS)}")


@dataclasses.dataclass(frozen=True)
class Transcoders(Result):
    """One transcoder per layer of a model (stacked over ``layers``).

    Attributes:
        W_enc (Float[Tensor, "layer d_model feature"]): Encoders.
        b_enc (Float[Tensor, "layer feature"]): Encoder biases.
        W_dec (Float[Tensor, "layer feature d_model"]): Decoders (unit rows when trained here).
        b_dec (Float[Tensor, "layer d_model"]): Decoder biases.
        W_skip (Float[Tensor, "layer d_model d_model"]): Linear skips (zeros without a skip).
        layers: The model layers, ascending.
        k: Features per row, used by the TopK activations.
        metrics: One dict per layer measured on held-out prompts (``fvu``, ``l0``,
            ``dead_fraction``) and model-level ``replacement`` numbers (top-1 agreement and KL of
            the replacement model against the real one).
        meta: Provenance.
        activation: One of :data:`ACTIVATIONS`.
        threshold (Float[Tensor, "layer feature"] | None): The thresholds of ``"jumprelu"``.
        input_site: The site read (``mlp_in`` for a transcoder).
        output_site: The site written (``mlp_out`` for a transcoder).

    Raises:
        AnalysisError: An unknown activation, or ``"jumprelu"`` without thresholds of ``b_enc``'s shape.
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
    activation: str = "topk"
    threshold: Optional[torch.Tensor] = None
    input_site: str = "mlp_in"
    output_site: str = "mlp_out"

    # what load checks: the axes fields share and the values they may take
    _shapes = {"W_enc": "layer d feature", "b_enc": "layer feature", "W_dec": "layer feature d", "b_dec": "layer d",
               "W_skip": "layer d d", "threshold": "layer feature", "layers": "layer"}
    _legal = {"layers": [NON_NEGATIVE, INCREASING], "k": POSITIVE, "activation": ACTIVATIONS,
              **{name: FLOATING for name in ("W_enc", "b_enc", "W_dec", "b_dec", "W_skip", "threshold")}}

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"unknown activation {self.activation!r}; accepted: {', '.join(ACTIVATIONS)}")
        if self.activation == "jumprelu" and (self.threshold is None or self.threshold.shape != self.b_enc.shape):
            raise AnalysisError(f"a 'jumprelu' set needs threshold [L, F] = {tuple(self.b_enc.shape)}, got "
                                f"{None if self.threshold is None else tuple(self.threshold.shape)}")

    @property
    def n_features(self) -> int:
        return int(self.W_enc.shape[-1])

    def index(self, layer: int) -> int:
        """The stacked index of model layer ``layer``."""
        if layer not in self.layers:
            raise SiteError(f"no transcoder for layer {layer}; these transcoders cover layers {self.layers}")
        return self.layers.index(layer)

    def pre(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Feature pre-activations ``[..., F]`` of MLP inputs ``x [..., d]`` (in the weights' precision,
        or the inputs' where it is higher)."""
        i = self.index(layer)
        dtype = torch.promote_types(x.dtype, self.W_enc.dtype)
        return x.to(dtype) @ self.W_enc[i].to(dtype) + self.b_enc[i].to(dtype)

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., F]`` of MLP inputs ``x [..., d]`` (k non-zero per row for TopK)."""
        threshold = None if self.threshold is None else self.threshold[self.index(layer)]
        return activate(self.pre(layer, x), self.activation, self.k, threshold)

    @functools.cached_property
    def skipped(self) -> list[bool]:
        """Whether each layer's transcoder has a skip (a non-zero ``W_skip``)."""
        return [bool(w.any()) for w in self.W_skip]

    def linear(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The part of the output ``[..., d]`` that no feature writes: ``b_dec + x @ W_skip``."""
        i = self.index(layer)
        dtype = torch.promote_types(x.dtype, self.W_skip.dtype)
        if not self.skipped[i]:  # no skip: the product with zeros (and its backward in a graph) is left out
            return self.b_dec[i].to(dtype).expand(x.shape).clone()
        return self.b_dec[i].to(dtype) + x.to(dtype) @ self.W_skip[i].to(dtype)

    def decode(self, layer: int, acts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The transcoder's MLP output ``[..., d]`` from activations ``acts [..., F]`` and inputs ``x``."""
        return acts @ self.W_dec[self.index(layer)].to(acts.dtype) + self.linear(layer, x)

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.decode(layer, self.encode(layer, x), x)

    def interventions(self, layers: Optional[Sequence[int]] = None,
                      edits: Optional[dict] = None) -> list[Write]:
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

            out.append(Write(self.output_site, layer, value=value, input_site=self.input_site))
        return out

    def to_frame(self) -> pd.DataFrame:
        """One row per layer: FVU, L0, dead fraction, features, k, and the model-level replacement numbers."""
        replacement = self.metrics.get("replacement", {})
        rows = []
        for layer, row in zip(self.layers, self.metrics.get("layers", [])):
            rows.append(dict(layer=layer, n_features=self.n_features, k=self.k, activation=self.activation, **row,
                             replacement_agreement=replacement.get("agreement"),
                             replacement_kl=replacement.get("kl")))
        return pd.DataFrame(rows)

    def plot(self, **kwargs: Any):
        return draw(self, **kwargs)

    def check_model(self, model: Any) -> None:
        """Raise unless the transcoders fit ``model`` (its width and layers) and were made on it: a
        :class:`~arithinterp.errors.ModelMismatchError` when ``meta["fingerprint"]`` (the weights they
        were trained or read on) is another model's."""
        check_model(model, "transcoders")
        d = int(model.cfg.d_model)
        if int(self.W_enc.shape[1]) != d or max(self.layers) >= int(model.cfg.n_layers):
            raise ModelMismatchError(
                f"these transcoders read d_model={int(self.W_enc.shape[1])} at layers {self.layers}; "
                f"the model has d_model={d} and {int(model.cfg.n_layers)} layers"
            )
        check_fingerprint(model, self.meta.get("fingerprint"), "transcoders", "transcoders", self.meta.get("model"))

    def features_of(self, features: Any, what: str = "features") -> list[int]:
        """``features`` (already declared non-negative ints) as a list, each one a feature these
        transcoders have and none twice."""
        chosen = [int(f) for f in features]
        if not chosen:
            raise ConfigError(f"{what} is empty; name at least one feature in 0..{self.n_features - 1}")
        outside = [f for f in chosen if f >= self.n_features]
        if outside:
            raise ConfigError(f"{what} {outside[:5]} are not features of these transcoders (accepted: "
                                f"0..{self.n_features - 1})")
        if len(set(chosen)) != len(chosen):
            twice = sorted({f for f in chosen if chosen.count(f) > 1})
            raise ConfigError(f"{what} names {twice[:5]} more than once; name each feature once")
        return chosen


def transcoders_digest(transcoders: Transcoders) -> str:
    """A short hash of a transcoder set's weights (what it was made of: results read with these
    transcoders, such as operand plots, record it).

    Args:
        transcoders: The transcoders.

    Returns:
        16 hex digits.
    """
    digest = hashlib.sha256(f"{transcoders.layers}|{transcoders.k}|{transcoders.activation}".encode())
    for name in ("W_enc", "b_enc", "W_dec", "b_dec", "W_skip"):
        flat = getattr(transcoders, name).detach().reshape(-1)
        digest.update(flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]
