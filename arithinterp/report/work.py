"""What the report's work costs, counted in model work and converted to seconds at a fixed
reference rate: the plan of every stage is a function of these counts, never of a clock.

A stage's work is counted in **token-layers** — one token position through one block of the
model, forward — (a backward counts :data:`BACKWARD` forwards), in **unembedded positions** (a
position's logits over the vocabulary, or over the few answer columns a logit difference reads),
in **fit steps** and **fit FLOPs** (probes, detectors and alignment searches fitted on
activations), and in **calls** (one block stepped on one batch: the fixed cost of launching its operations, which
dominates on small models). :class:`Shape` holds what a token-layer costs in FLOPs, from the
model's config; :func:`seconds` converts the counts at the reference rate (:data:`REFERENCE`).

The reference rate is one thread of the 2-core AMD EPYC (Zen 4, AVX-512) machine the package is
developed on, measured once in process CPU time (so that other work on the machine did not
count): the report's budget is seconds of that machine's single thread. A machine with more or
faster free cores finishes sooner, a busy one later; what the report samples and finds is the
same on all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Measured once with benchmarks/report_determinism.py --calibrate (Gemma 3 270M and zoo:add-100, one thread,
# process CPU time, on the 2-core development machine): see CALIBRATION in that script.
REFERENCE_FLOPS = 40e9  # FLOP/s of a block's matrix products
TOKEN_LAYER_SECONDS = 2.0e-6  # per token-layer beyond its products: norms, activations, attention's softmax
CALL_SECONDS = 4.0e-4  # per block stepped on one batch: launching its operations, hooks, Python
FIT_STEP_SECONDS = 2.0e-3  # per step of an optimiser fitted on activations (L-BFGS, Adam), beyond its FLOPs
REFERENCE = "one thread of the 2-core AMD EPYC development machine (40 GFLOP/s in a block's products)"
BACKWARD = 2.0  # a backward costs about two forwards


@dataclass(frozen=True)
class Shape:
    """What a model's work costs, from its config.

    Attributes:
        n_layers: Blocks.
        d_model: Residual width.
        d_mlp: MLP width (0 for attention-only models).
        n_heads: Query heads.
        n_kv_heads: Key/value heads (grouped-query attention shares them).
        d_head: Width of one head.
        d_vocab: Vocabulary.
        gated: Whether the MLP is gated (three matrices, not two).
    """

    n_layers: int
    d_model: int
    d_mlp: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_vocab: int
    gated: bool

    @classmethod
    def of(cls, model: Any) -> Shape:
        """The shape of a hooked model, from ``model.cfg``."""
        cfg = model.cfg

        def size(name: str, default: int) -> int:
            value = getattr(cfg, name, None)
            return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default

        n_heads, d_model = int(cfg.n_heads), int(cfg.d_model)
        attn_only = bool(getattr(cfg, "attn_only", False))
        return cls(n_layers=int(cfg.n_layers), d_model=d_model, d_mlp=0 if attn_only else size("d_mlp", 4 * d_model),
                   n_heads=n_heads, n_kv_heads=size("n_key_value_heads", n_heads),
                   d_head=size("d_head", d_model // n_heads), d_vocab=size("d_vocab", 1),
                   gated=bool(getattr(cfg, "gated_mlp", False)))

    @property
    def token_layer_flops(self) -> float:
        """FLOPs of one token through one block: its projections and its MLP (attention over the
        context is small at the report's prompt lengths)."""
        q = self.n_heads * self.d_head
        kv = self.n_kv_heads * self.d_head
        projections = self.d_model * (2 * q + 2 * kv)  # queries, keys, values in; the output back
        mlp = (3 if self.gated else 2) * self.d_model * self.d_mlp
        return 2.0 * (projections + mlp)

    @property
    def unembed_flops(self) -> float:
        """FLOPs of one position's logits over the whole vocabulary."""
        return 2.0 * self.d_model * self.d_vocab


def work_seconds(shape: Shape, token_layers: float = 0.0, unembeds: float = 0.0, calls: float = 0.0,
                 fit_steps: float = 0.0, fit_flops: float = 0.0) -> float:
    """Reference seconds of some model work.

    Args:
        shape: The model's shape.
        token_layers: Token positions times blocks run forward (a backward counted as
            :data:`BACKWARD` of them).
        unembeds: Positions unembedded over the whole vocabulary.
        calls: Blocks stepped on one batch each.
        fit_steps: Steps of optimisers fitted on activations (probes, detectors, alignment searches).
        fit_flops: Their FLOPs.

    Returns:
        Seconds at the reference rate (:data:`REFERENCE`).
    """
    flops = token_layers * shape.token_layer_flops + unembeds * shape.unembed_flops + fit_flops
    return (flops / REFERENCE_FLOPS + token_layers * TOKEN_LAYER_SECONDS + calls * CALL_SECONDS
            + fit_steps * FIT_STEP_SECONDS)
