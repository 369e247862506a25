"""A hand-built model whose answer goes through a variable stored in a known 2-D subspace.

The validation target of distributed alignment search: ``a + b`` for ``a, b`` in ``0..9`` over
single number tokens (prompt ``{a}+{b}=``). One layer, no norms, ``d_model`` 64. Head 0 copies
the first operand one-hot into dims 0..9 of the final position, head 1 the second into dims
10..19; MLP neuron ``(a, b)`` fires only when both are present and writes the units digit of the
sum as a point on a circle in dims 20, 21 (``cos, sin(2π u / 10)``) and the tens digit as ``±1`` in
dim 22. The unembedding reads only dims 20..22, so ``sum_mod_10`` lives exactly in
``span(e20, e21)`` at ``resid_post`` of layer 0, final position: DAS with ``k = 2`` should recover
that plane and a random plane should do nothing.
"""

from __future__ import annotations

import math

import torch

PLANE = (20, 21)  # where sum_mod_10 is stored
TENS_DIM = 22


def planted_model(tokenizer, scale: float = 10.0):
    """The planted model over a number tokenizer whose numbers ``0..19`` are single tokens."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(d_model=64, d_head=32, n_heads=2, n_layers=1, n_ctx=8, d_vocab=len(tokenizer),
                                  d_mlp=100, normalization_type=None, seed=0, act_fn="relu",
                                  positional_embedding_type="standard")
    boot = TransformerBridge.boot_native  # pyright: ignore[reportAttributeAccessIssue]
    model = boot(cfg, tokenizer=tokenizer).eval()
    number = torch.tensor([tokenizer.convert_tokens_to_ids(str(n)) for n in range(20)])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
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
