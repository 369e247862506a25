"""Norms on the branches, with their scales frozen: the residual stream as a sum of senders again.

Gemma 2 and Gemma 3 apply an RMSNorm to each attention output and to each MLP output before adding
it to the residual stream (Hugging Face's ``post_attention_layernorm`` and
``post_feedforward_layernorm``, TransformerLens's ``ln1_post`` and ``ln2_post``)::

    resid_mid = resid_pre + g ⊙ a / rms(a),    a = Σ_h z_h W_O[h],   g = 1 + w (Gemma's convention)

Through ``rms(a)`` every head's output divides every other's, so a head's output is no term of the
stream. With the denominator ``f = rms(a)`` (one number per prompt, position, layer and branch)
held at its value in one run, the norm is the linear map ``x ↦ x ⊙ g / f``, and each head's output
reaches the stream as a term of its own, ``z_h W_O[h] ⊙ g / f``; an MLP's, ``mlp_out ⊙ g / f``. This
is the linearisation circuit-tracer uses for Gemma 2 (Ameisen et al. 2025, "Circuit Tracing:
Revealing Computational Graphs in Language Models": normalisation denominators frozen at the
prompt's own values).

The edge engines use it so: every sender's output in a run is its branch term divided by *that
run's own* denominator, and an edge run (the base run with some receivers' inputs changed) divides
by the *base run's* denominators, frozen, wherever the branch's output changed: an edge patch does
not re-normalise the branch. Changing no edge is then the base run itself, and changing every edge
to the source run's senders is the source run itself (each receiver's input is the source run's).

Tensors: ``scales [B, T, n_layers, 2]`` float32, the denominators ``f`` per prompt, position, layer
and branch (index 0 attention, 1 MLP; 1.0 where a branch has no norm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from arithinterp.errors import AnalysisError

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

BRANCHES = ("attn", "mlp")  # the last axis of ``scales``
_MODULES = {"attn": "ln1_post", "mlp": "ln2_post"}  # TransformerLens's names of the branch norms
_TOLERANCE = 1e-4  # how closely the norm must follow g ⊙ x / rms(x) on a test input (relative)


def _eps(norm: Any, model: Any) -> float:
    """The norm's epsilon, where TransformerLens's own norm bridge reads it."""
    module = norm.original_component
    for name in ("eps", "variance_epsilon"):
        value = getattr(module, name, None)
        if value is not None:
            return float(value)
    return float(getattr(model.cfg, "eps", 1e-5))


class BranchNorms:
    """The branch norms of a model: ``gain[layer, branch]`` ``[d_model]`` (float32) for each
    ``(layer, branch)`` that has one. Build with :meth:`of` (None for a model without any).

    Refuses a branch norm that is not an RMSNorm (``g ⊙ x / sqrt(mean(x²) + eps)``, checked on a
    test input): a centring LayerNorm or one with a bias is not a linear map of its input even with
    its scale frozen.
    """

    def __init__(self, model: HookedModel):
        self.n_layers = int(model.cfg.n_layers)
        self.gain: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(self.n_layers):
            block = model.blocks[layer]
            for branch, name in _MODULES.items():
                norm = getattr(block, name, None)
                if norm is None or getattr(norm, "original_component", None) is None:
                    continue
                self.gain[layer, branch] = self._gain(model, norm, f"blocks.{layer}.{name}")

    @staticmethod
    def _gain(model: Any, norm: Any, where: str) -> torch.Tensor:
        """``g`` from the norm module itself: its output on a constant input times that input's rms,
        checked against ``g ⊙ x / rms(x)`` on a random input."""
        module = norm.original_component
        weight = next((p for p in module.parameters()), None)
        d = int(model.cfg.d_model)
        dtype = torch.float32 if weight is None else weight.dtype
        device = "cpu" if weight is None else weight.device
        eps = _eps(norm, model)
        with torch.no_grad():
            gain = module(torch.ones(1, d, dtype=dtype, device=device)).float()[0] * (1.0 + eps) ** 0.5
            x = torch.randn(1, d, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
            expected = gain * x.float() / (x.float().pow(2).mean(-1, keepdim=True) + eps).sqrt()
            got = module(x).float()
        if float((got - expected).abs().max()) > _TOLERANCE * float(expected.abs().max()) + 1e-6:
            raise AnalysisError(
                f"edge runs freeze the scale of the norm on each branch, which needs an RMSNorm "
                f"(gain ⊙ x / rms(x)); {where} ({type(module).__name__}) is not one (a LayerNorm that centres "
                "its input or adds a bias is not linear in it with its scale frozen)"
            )
        return gain.detach()

    @classmethod
    def of(cls, model: HookedModel) -> Optional["BranchNorms"]:
        """The model's branch norms, or None when no block has a norm on its attention or MLP output."""
        blocks = model.blocks
        if not any(getattr(blocks[i], name, None) is not None
                   for i in range(int(model.cfg.n_layers)) for name in _MODULES.values()):
            return None
        return cls(model)

    def has(self, layer: int, branch: str) -> bool:
        return (layer, branch) in self.gain

    @property
    def keys(self) -> list[tuple[int, str]]:
        """Every ``(layer, branch)`` with a norm, in forward order."""
        return sorted(self.gain, key=lambda key: (key[0], BRANCHES.index(key[1])))

    def branches(self, layer: int) -> list[str]:
        """The branches of block ``layer`` that have a norm (``"attn"``, ``"mlp"``), in forward order."""
        return [branch for branch in BRANCHES if (layer, branch) in self.gain]

    def hook(self, layer: int, branch: str, point: str) -> str:
        """The name of the norm's hook ``point`` (``hook_in``, ``hook_scale``, ``hook_out``)."""
        return f"blocks.{layer}.{_MODULES[branch]}.{point}"

    def apply(self, x: torch.Tensor, layer: int, branch: str, scale: torch.Tensor) -> torch.Tensor:
        """The norm with its denominator frozen: ``x ⊙ g / scale`` in float32.

        Args:
            x: the branch's output before the norm (or one head's term of it) ``[..., d_model]``.
            layer: the block.
            branch: ``"attn"`` or ``"mlp"``.
            scale: the frozen denominators, broadcastable to ``x`` (``[N, T, 1]``, or ``[N, T, 1, 1]``
                against per-head terms ``[N, T, H, d_model]``).

        Returns:
            ``[..., d_model]`` float32.
        """
        gain = self.gain[layer, branch].to(x.device)
        return x.float() * gain / scale.float()

    def ones(self, batch: int, seq_len: int, device: Any = None) -> torch.Tensor:
        """Denominators of 1 for every layer and branch ``[B, T, n_layers, 2]`` (filled in by a run)."""
        return torch.ones(batch, seq_len, self.n_layers, len(BRANCHES), device=device)
