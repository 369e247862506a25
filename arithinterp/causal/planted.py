"""Hand-built models whose answer goes through variables stored in known subspaces.

:func:`planted_model`, the validation target of distributed alignment search: ``a + b`` for ``a, b``
in ``0..9`` over single number tokens (prompt ``{a}+{b}=``). One layer, no norms, ``d_model`` 64. Head 0 copies
the first operand one-hot into dims 0..9 of the final position, head 1 the second into dims
10..19; MLP neuron ``(a, b)`` fires only when both are present and writes the units digit of the
sum as a point on a circle in dims 20, 21 (``cos, sin(2π u / 10)``) and the tens digit as ``±1`` in
dim 22. The unembedding reads only dims 20..22, so ``sum_mod_10`` lives exactly in
``span(e20, e21)`` at ``resid_post`` of layer 0, final position: DAS with ``k = 2`` should recover
that plane and a random plane should do nothing.

:func:`planted_helix_model` holds the sum of two numbers 0..99 on a helix of periods 2, 5, 10 and 100
instead (see its docstring): the ceiling of a units-digit interchange in such a code.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from arithinterp.errors import TokenizationError
from arithinterp.types import PositiveFiniteFloat, checked

PLANE = (20, 21)  # where sum_mod_10 is stored
TENS_DIM = 22


def _blank_model(tokenizer, d_model: int, d_mlp: int):
    """A one-layer, two-head ReLU bridge model with every weight zero, to be written by hand."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(d_model=d_model, d_head=d_model // 2, n_heads=2, n_layers=1, n_ctx=8,
                                  d_vocab=len(tokenizer), d_mlp=d_mlp, normalization_type=None, seed=0,
                                  act_fn="relu", positional_embedding_type="standard")
    boot = TransformerBridge.boot_native  # pyright: ignore[reportAttributeAccessIssue]
    model = boot(cfg, tokenizer=tokenizer).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _number_ids(tokenizer: Any, n: int, where: str) -> list[int]:
    """The token ids of the numbers ``0..n-1``; a tokenizer without one of them as a token is refused."""
    ids = [tokenizer.convert_tokens_to_ids(str(i)) for i in range(n)]
    unk = getattr(tokenizer, "unk_token_id", None)
    missing = [i for i, token in enumerate(ids) if token is None or token == unk]
    if missing:
        raise TokenizationError(f"{where} needs the numbers 0..{n - 1} as single tokens; this tokenizer lacks "
                                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return ids


@checked
def planted_model(tokenizer: Any, scale: PositiveFiniteFloat = 10.0):
    """The planted model over a number tokenizer whose numbers ``0..19`` are single tokens (a
    tokenizer without them is refused: the model would answer its unknown token)."""
    ids = _number_ids(tokenizer, 20, "planted_model")
    model = _blank_model(tokenizer, d_model=64, d_mlp=100)
    number = torch.tensor(ids)
    with torch.no_grad():
        emb = model.embed.original_component.weight
        emb[number[:10], torch.arange(10)] = 1.0  # digit tokens one-hot in dims 0..9
        model.pos_embed.original_component.weight[torch.arange(8), 23 + torch.arange(8)] = 1.0  # positions 23..30
        attn = model.blocks[0].attn
        q, k, v, o = (getattr(attn, n).original_component.weight for n in "qkvo")  # [out, in]
        # prompt tokens: <bos> a + b = → a at position 1, b at 3, the final position 4
        q[0, 23 + 4], k[0, 23 + 1] = scale, scale  # head 0: the final position attends to a
        q[32, 23 + 4], k[32, 23 + 3] = scale, scale  # head 1: the final position attends to b
        v[torch.arange(10), torch.arange(10)] = 1.0
        v[32 + torch.arange(10), torch.arange(10)] = 1.0
        o[torch.arange(10), torch.arange(10)] = 1.0  # a → dims 0..9
        o[10 + torch.arange(10), 32 + torch.arange(10)] = 1.0  # b → dims 10..19
        mlp = model.blocks[0].mlp
        w_in, b_in = mlp.original_component.fc_in.weight, mlp.original_component.fc_in.bias  # [100, 64], [100]
        w_out = mlp.original_component.fc_out.weight  # [64, 100]
        for a in range(10):
            for b in range(10):
                n = 10 * a + b
                w_in[n, a], w_in[n, 10 + b], b_in[n] = 1.0, 1.0, -1.5  # 0.5 only when both are present
                u, tens = (a + b) % 10, (a + b) // 10
                w_out[PLANE[0], n] = 2 * math.cos(2 * math.pi * u / 10)
                w_out[PLANE[1], n] = 2 * math.sin(2 * math.pi * u / 10)
                w_out[TENS_DIM, n] = 2.0 if tens else -2.0
        unembed = model.unembed.original_component.weight  # [vocab, d]
        for s in range(20):
            unembed[number[s], PLANE[0]] = scale * math.cos(2 * math.pi * (s % 10) / 10)
            unembed[number[s], PLANE[1]] = scale * math.sin(2 * math.pi * (s % 10) / 10)
            unembed[number[s], TENS_DIM] = scale if s >= 10 else -scale
    return model


def planted_plane(d: int = 64) -> torch.Tensor:
    """The true subspace ``[d, 2]`` of ``sum_mod_10``."""
    basis = torch.zeros(d, 2)
    basis[PLANE[0], 0] = basis[PLANE[1], 1] = 1.0
    return basis


# --- a planted helix: the sum of two numbers 0..99 on a helix (periods 2, 5, 10, 100) ---------------

HELIX_PERIODS = (100, 10, 5)  # each a (cos, sin) pair; period 2 adds cos(π s) (its sine is 0 on integers)
HELIX_DIMS = 200  # the helix starts here: cos, sin of each period, cos(π s), then the hundreds flag
HUNDREDS_DIM = HELIX_DIMS + 2 * len(HELIX_PERIODS) + 1


def _helix(s: int) -> list[float]:
    """The planted code of ``s``: ``cos, sin(2π s / T)`` for ``T`` in :data:`HELIX_PERIODS`, ``cos(π s)``."""
    out = []
    for period in HELIX_PERIODS:
        out += [math.cos(2 * math.pi * s / period), math.sin(2 * math.pi * s / period)]
    return out + [math.cos(math.pi * s)]


@checked
def planted_helix_model(tokenizer: Any, scale: PositiveFiniteFloat = 10.0):
    """``a + b`` for ``a, b`` in ``0..99`` (prompt ``{a}+{b}=``) through a planted helix of the sum.

    One layer, no norms, ``d_model`` 256. Head 0 copies ``a`` one-hot into dims 0..99 of the final
    position, head 1 ``b`` into dims 100..199; MLP neuron ``(a, b)`` (10,000 of them) writes the
    helix of ``s = a + b`` — ``cos, sin(2π s / T)`` for ``T`` = 100, 10, 5 and ``cos(π s)`` in dims
    200..206 — and the hundreds flag ``±1`` (``s ≥ 100``) in dim 207. The unembedding reads token
    ``n`` with the same code of ``n``, so the answer's logit is ``Σ_T cos(2π (n − s) / T)`` plus the
    flags' product: the sum is represented as the Fourier features of Kantamneni & Tegmark 2025.

    Every feature but the flag is a function of ``s mod 100``, so ``sum_mod_100`` and the
    hundreds (``single_token_addition(base=100)``) lie in orthogonal subspaces; the periods 2, 5
    and 10 are functions of ``s mod 10`` (5 dims, :func:`planted_helix_subspace`), but the period
    100 mixes the units and the tens: no subspace separates ``sum_mod_10`` from ``s // 10``. Needs a
    number tokenizer whose numbers ``0..198`` are single tokens."""
    positions = HUNDREDS_DIM + 1  # positional one-hots after the code
    model = _blank_model(tokenizer, d_model=256, d_mlp=10000)
    number = torch.tensor(_number_ids(tokenizer, 199, "planted_helix_model"))
    with torch.no_grad():
        model.embed.original_component.weight[number[:100], torch.arange(100)] = 1.0  # 0..99 one-hot in dims 0..99
        model.pos_embed.original_component.weight[torch.arange(8), positions + torch.arange(8)] = 1.0
        attn = model.blocks[0].attn
        q, k, v, o = (getattr(attn, n).original_component.weight for n in "qkvo")  # [out, in]
        # prompt tokens: <bos> a + b = → a at position 1, b at 3, the final position 4
        q[0, positions + 4], k[0, positions + 1] = scale, scale  # head 0: the final position attends to a
        q[128, positions + 4], k[128, positions + 3] = scale, scale  # head 1: the final position attends to b
        v[torch.arange(100), torch.arange(100)] = 1.0
        v[128 + torch.arange(100), torch.arange(100)] = 1.0
        o[torch.arange(100), torch.arange(100)] = 1.0  # a → dims 0..99
        o[100 + torch.arange(100), 128 + torch.arange(100)] = 1.0  # b → dims 100..199
        mlp = model.blocks[0].mlp.original_component
        w_in, b_in, w_out = mlp.fc_in.weight, mlp.fc_in.bias, mlp.fc_out.weight  # [10000, 256], [10000], [256, 10000]
        a, b = torch.arange(100).repeat_interleave(100), torch.arange(100).repeat(100)
        neuron = torch.arange(10000)
        w_in[neuron, a], w_in[neuron, 100 + b], b_in[:] = 1.0, 1.0, -1.5  # 0.5 only when both are present
        code = torch.tensor([_helix(s) + [1.0 if s >= 100 else -1.0] for s in range(199)])  # [199, 8]
        w_out[HELIX_DIMS: HUNDREDS_DIM + 1] = 2 * code[a + b].T
        model.unembed.original_component.weight[number, HELIX_DIMS: HUNDREDS_DIM + 1] = scale * code
    return model


def planted_helix_subspace(variable: str, d: int = 256) -> torch.Tensor:
    """The planted helix's subspace ``[d, k]`` of ``variable``: ``"sum_mod_10"`` (periods 10, 5, 2:
    5 dims), ``"sum_mod_100"`` (every period: 7 dims) or ``"hundreds"`` (the flag: 1 dim)."""
    dims = {"sum_mod_10": list(range(HELIX_DIMS + 2, HUNDREDS_DIM)),
            "sum_mod_100": list(range(HELIX_DIMS, HUNDREDS_DIM)), "hundreds": [HUNDREDS_DIM]}
    if variable not in dims:
        from arithinterp.errors import AnalysisError

        raise AnalysisError(f"the planted helix stores {', '.join(dims)}; got {variable!r}")
    basis = torch.zeros(d, len(dims[variable]))
    basis[dims[variable], torch.arange(len(dims[variable]))] = 1.0
    return basis
