"""The replica forward: a copy of a standard decoder's forward that starts at any layer and position."""

from __future__ import annotations

import math
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from arithinterp.errors import AnalysisError
from arithinterp.patching.core import UNIT_SITES


class ReplicaUnsupported(Exception):
    """The replica forward cannot reproduce this model; sweeps fall back to hooks."""


_STAGES = ("resid_pre", "pattern", "attn_z", "attn_out", "resid_mid", "mlp_pre", "mlp_post", "mlp_out", "resid_post")
_ORDER = {s: i for i, s in enumerate(_STAGES)}


_ACTS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
}


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear`` on the rows of ``x [..., in]`` as one 2-D product.

    A strided ``x`` of more than two dimensions would otherwise become a batched product against a
    copy of the weight per batch row.
    """
    return F.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def _norm_of(module) -> Optional[Callable]:
    """The plain normalisation module under a bridge component (identity when absent)."""
    if module is None:
        return lambda x: x
    inner = getattr(module, "_original_component", None)
    return inner


class Replica:
    """A pure-torch copy of a standard pre-norm decoder's forward that can start anywhere.

    Covers sequential pre-norm blocks (LayerNorm / RMSNorm / none), standard positional
    embeddings, (grouped) multi-head causal attention and a plain MLP. The weights are
    the model's own (``W_Q`` ... ``W_U``) and the norm modules are called as they are, so the
    numbers are the model's; :func:`replica_for` checks them against the model's logits all the same.

    Activations are laid out ``[C, B, S, ...]``: C stacked patch cells, B pairs, S positions from
    the start position s on. Base-run tensors ``[B, ...]`` broadcast over C.
    """

    def __init__(self, model):
        cfg = model.cfg
        unsupported = []
        if (getattr(cfg, "positional_embedding_type", "standard") or "standard") != "standard":
            unsupported.append("positional_embedding_type")
        for flag in ("parallel_attn_mlp", "use_qk_norm", "post_embedding_ln", "use_normalization_before_and_after", "scale_attn_by_inverse_layer_idx"):
            if getattr(cfg, flag, False):
                unsupported.append(flag)
        for cap in ("attn_scores_soft_cap", "output_logits_soft_cap"):
            if (getattr(cfg, cap, -1.0) or -1.0) > 0:
                unsupported.append(cap)
        if getattr(cfg, "attention_dir", "causal") != "causal":
            unsupported.append("attention_dir")
        act = (getattr(cfg, "act_fn", None) or "gelu").lower()
        if act not in _ACTS and not getattr(cfg, "attn_only", False):
            unsupported.append(f"act_fn={act}")
        if getattr(cfg, "gated_mlp", False):
            unsupported.append("gated_mlp")
        if unsupported:
            raise ReplicaUnsupported(", ".join(unsupported))
        self.n_layers, self.n_heads = int(cfg.n_layers), int(cfg.n_heads)
        self.attn_only = bool(getattr(cfg, "attn_only", False))
        self.act = _ACTS.get(act)
        scale = getattr(cfg, "attn_scale", -1.0)
        self.scale = scale if getattr(cfg, "use_attn_scale", True) and scale and scale > 0 else math.sqrt(cfg.d_head)
        with torch.no_grad():
            detach = lambda t: None if t is None else t.detach()  # noqa: E731
            self.W_E, self.W_pos = detach(model.W_E), detach(model.W_pos)
            # [out, in] layouts for F.linear; q, k and v fused into one matrix multiply
            flat = lambda w: w.detach().permute(0, 1, 3, 2).flatten(1, 2)  # noqa: E731  [L, H * d_head, d_model]
            self.W_QKV = torch.cat([flat(model.W_Q), flat(model.W_K), flat(model.W_V)], dim=1).contiguous()
            self.b_QKV = torch.cat([getattr(model, n).detach().flatten(1) for n in ("b_Q", "b_K", "b_V")], dim=1)
            self.W_O = model.W_O.detach().flatten(1, 2).transpose(1, 2).contiguous()  # [L, d_model, H * d_head]
            self.b_O = model.b_O.detach()
            if not self.attn_only:
                self.W_in, self.b_in = model.W_in.detach().transpose(1, 2).contiguous(), detach(model.b_in)
                self.W_out, self.b_out = model.W_out.detach().transpose(1, 2).contiguous(), detach(model.b_out)
            self.W_U, self.b_U = model.W_U.detach().T.contiguous(), detach(model.b_U)
        self.ln1 = [_norm_of(getattr(b, "ln1", None)) for b in model.blocks]
        self.ln2 = [_norm_of(getattr(b, "ln2", None)) for b in model.blocks] if not self.attn_only else []
        self.ln_final = _norm_of(getattr(model, "ln_final", None))
        if any(n is None for n in self.ln1 + self.ln2 + [self.ln_final]):
            raise ReplicaUnsupported("normalisation modules not reachable")

    # --- the forward ---------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.W_E[tokens] + self.W_pos[: tokens.shape[1]]

    def run(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Forward of ``tokens [B, T]``: final-position logits ``[B, V]`` and every activation.

        ``cache[site][layer]`` is ``[B, T, ...]`` (patterns ``[B, H, T, T]``). In the last block
        only the final position reaches the logits, so from its attention pattern on only that
        position is computed and cached (``[B, 1, ...]``, patterns ``[B, H, 1, T]``).
        """
        cache: dict[str, list] = {s: [] for s in _STAGES + ("q", "k", "v")}
        resid = self.embed(tokens)[None]
        for layer in range(self.n_layers):
            resid = self.block(layer, "resid_pre", resid, 0, None, record=cache)
        cache = {k: [t[0] for t in v] for k, v in cache.items()}
        return self.unembed(resid[:, :, -1])[0], cache

    def unembed(self, resid: torch.Tensor) -> torch.Tensor:
        return _linear(self.ln_final(resid), self.W_U, self.b_U)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[C, B, S, H * d_head]`` -> ``[C, B, H, S, d_head]``."""
        return x.unflatten(-1, (self.n_heads, -1)).transpose(2, 3)

    def _qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[C, B, H, S, d_head]`` of normalised inputs ``[C, B, S, d]``."""
        return tuple(self._heads(x) for x in _linear(h, self.W_QKV[layer], self.b_QKV[layer]).chunk(3, dim=-1))

    def _attend(self, layer, resid_pre, s, base, point, only_final, keep, want_pattern) -> torch.Tensor:
        """Attention output ``z [C, B, S, H, d_head]`` of block ``layer`` for queries from ``s`` on
        (only the final one with ``only_final``), from the block's input ``resid_pre [C, B, S, d]``.

        With ``point [C, B]`` each row differs from the base run at that one position only, so
        queries, keys and values are recomputed there alone and the rest come from ``base``.
        """
        if point is not None:
            C, B = point.shape
            rel = (point - s)[:, :, None, None]
            changed = resid_pre.gather(2, rel.expand(C, B, 1, resid_pre.shape[-1]))
            new_q, new_k, new_v = self._qkv(layer, self.ln1[layer](changed))  # [C, B, H, 1, d_head]
            if only_final:
                return self._final_attention(layer, point, new_q, new_k, new_v, base)
            index = rel[..., None].expand(C, B, self.n_heads, 1, new_q.shape[-1])
            q, k, v = (
                base[name][layer][None, :, :, s:].expand(C, -1, -1, -1, -1).scatter(3, index, fresh)
                for name, fresh in (("q", new_q), ("k", new_k), ("v", new_v))
            )
        elif only_final:  # keys and values everywhere, the query only at the end
            h = self.ln1[layer](resid_pre)
            d_qkv = self.W_QKV.shape[1] // 3
            k, v = (self._heads(x) for x in _linear(h, self.W_QKV[layer][d_qkv:], self.b_QKV[layer][d_qkv:]).chunk(2, dim=-1))
            q = self._heads(_linear(h[:, :, -1:], self.W_QKV[layer][:d_qkv], self.b_QKV[layer][:d_qkv]))
        else:
            q, k, v = self._qkv(layer, self.ln1[layer](resid_pre))
        keep("q", q)
        keep("k", k)
        keep("v", v)
        if s > 0:  # earlier positions are untouched by the patch: reuse their keys and values
            k = torch.cat([base["k"][layer][None, :, :, :s].expand(k.shape[0], -1, -1, -1, -1), k], dim=3)
            v = torch.cat([base["v"][layer][None, :, :, :s].expand(v.shape[0], -1, -1, -1, -1), v], dim=3)
        n_q, n_k = q.shape[-2], k.shape[-2]
        allowed = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]  # causal
        if not want_pattern:  # the fused attention kernel
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0 / self.scale).transpose(2, 3)
        scores = q @ k.transpose(-1, -2) / self.scale
        pattern = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        keep("pattern", pattern)
        return (pattern @ v).transpose(2, 3)

    def _final_attention(self, layer, point, new_q, new_k, new_v, base) -> torch.Tensor:
        """Final-position attention ``z [C, B, 1, H, d_head]`` in the last block when each row changes
        one key and value (at ``point [C, B]``) and, where that is the final position, the query.

        The cells go along the query axis: every cell's scores against the base run's keys come
        from one product ``[B, H, C, d_head] @ [B, H, d_head, T]`` without a copy of the keys per
        cell; the changed key's score and value are then put in place.
        """
        k, v = base["k"][layer], base["v"][layer]  # [B, H, T, d_head]
        B, H, T, d_head = k.shape
        C = point.shape[0]
        at_end = (point == T - 1)[:, :, None, None, None]
        q = torch.where(at_end, new_q, base["q"][layer][None, :, :, -1:])[:, :, :, 0].permute(1, 2, 0, 3)  # [B, H, C, d]
        new_k, new_v = (x[:, :, :, 0].permute(1, 2, 0, 3) for x in (new_k, new_v))
        scores = q @ k.transpose(-1, -2)  # [B, H, C, T]
        at = point.T[:, None, :, None].expand(B, H, C, 1)
        scores.scatter_(-1, at, (q * new_k).sum(-1, keepdim=True))
        pattern = (scores / self.scale).softmax(-1)  # the final query sees every position
        old_v = v.gather(2, point.T[:, None, :, None].expand(B, H, C, d_head))
        z = pattern @ v + pattern.gather(-1, at) * (new_v - old_v)  # [B, H, C, d_head]
        return z.permute(2, 0, 1, 3)[:, :, None]

    def block(self, layer, entry, value, s, base, *, record=None, final_only=None, point=None):
        """Run block ``layer`` from stage ``entry`` whose (patched) activation is ``value``.

        ``value`` covers positions ``s:`` (``[C, B, S, ...]``; patterns ``[C, B, H, S, T]``);
        ``base`` is the base run's cache (positions before s and the block's own inputs come from
        it). ``point [C, B]``: for a ``resid_pre`` entry, the one position per row where ``value``
        differs from the base run, so only there are queries, keys and values recomputed.
        Returns ``resid_post`` for positions ``s:`` (only the last one in the last layer).
        """
        order = _ORDER[entry]
        # only the final position feeds the logits, so the last block computes just that one
        only_final = layer == self.n_layers - 1 if final_only is None else final_only

        def base_at(name):
            cached = base[name][layer]
            if cached.shape[1] == 1 and base["resid_pre"][layer].shape[1] > 1:  # kept at the final position only
                return cached[None]
            return cached[None, :, s:]

        def keep(name, tensor):
            if record is not None:
                record[name].append(tensor)

        if entry == "resid_post":
            return value[:, :, -1:] if only_final else value
        resid_pre = value if entry == "resid_pre" else base_at("resid_pre")
        if order <= _ORDER["attn_z"]:
            if entry == "resid_pre":
                keep("resid_pre", resid_pre)
                z = self._attend(layer, resid_pre, s, base, point, only_final, keep, record is not None)
            elif entry == "attn_z":
                z = value[:, :, -1:] if only_final else value
            else:  # a patched pattern [C, B, H, S, T]
                pattern = value[:, :, :, -1:] if only_final else value
                z = (pattern @ base["v"][layer][None]).transpose(2, 3)  # [C, B, S, H, d_head]
            keep("attn_z", z)
            attn_out = _linear(z.flatten(-2), self.W_O[layer], self.b_O[layer])
        elif entry == "attn_out":
            attn_out = value
        if only_final:
            resid_pre = resid_pre[:, :, -1:]
        if order <= _ORDER["attn_out"]:
            attn_out = attn_out[:, :, -1:] if only_final and attn_out.shape[2] > 1 else attn_out
            keep("attn_out", attn_out)
            resid_mid = resid_pre + attn_out
        elif entry == "resid_mid":
            resid_mid = value[:, :, -1:] if only_final else value
        else:
            resid_mid = base_at("resid_mid")
            resid_mid = resid_mid[:, :, -1:] if only_final else resid_mid
        keep("resid_mid", resid_mid)
        if self.attn_only:
            keep("resid_post", resid_mid)
            return resid_mid
        if order <= _ORDER["resid_mid"]:
            h = self.ln2[layer](resid_mid)
            pre = _linear(h, self.W_in[layer], self.b_in[layer])
        elif entry == "mlp_pre":
            pre = value[:, :, -1:] if only_final else value
        if order <= _ORDER["mlp_pre"]:
            keep("mlp_pre", pre)
            post = self.act(pre)
        elif entry == "mlp_post":
            post = value[:, :, -1:] if only_final else value
        if order <= _ORDER["mlp_post"]:
            keep("mlp_post", post)
            mlp_out = _linear(post, self.W_out[layer], self.b_out[layer])
        else:
            mlp_out = value[:, :, -1:] if only_final else value
        keep("mlp_out", mlp_out)
        resid_post = resid_mid + mlp_out
        keep("resid_post", resid_post)
        return resid_post

    def resume(
        self, layer: int, entry: str, value: torch.Tensor, s: int, base: dict, point: Optional[torch.Tensor] = None, tokens: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Final-position logits ``[C, B, V]`` after entering ``layer`` at ``entry`` with ``value``.

        ``point [C, B]``: each row's single patched position, for ``resid_pre`` / ``resid_post``
        entries (a ``resid_post`` patch is the next block's ``resid_pre`` patch). ``tokens [B, k]``:
        return only these tokens' logits, ``[C, B, k]`` (a logit difference needs two columns of
        the unembedding, not the vocabulary).
        """
        if entry == "resid_post" and layer + 1 < self.n_layers:
            layer, entry = layer + 1, "resid_pre"
        resid = self.block(layer, entry, value, s, base, point=point if entry == "resid_pre" else None)
        for later in range(layer + 1, self.n_layers):
            resid = self.block(later, "resid_pre", resid, s, base)
        if tokens is None:
            return self.unembed(resid[:, :, -1])
        final = self.ln_final(resid[:, :, -1])  # [C, B, d]
        return torch.einsum("cbd,bkd->cbk", final, self.W_U[tokens]) + self.b_U[tokens]


_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fingerprint(model) -> tuple:
    """Changes whenever a parameter is replaced or modified in place."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def replica_for(model, tokens: torch.Tensor, engine: str, replica: Optional[Replica] = None) -> tuple[Optional[Replica], str]:
    """The replica when it reproduces the model's final logits on ``tokens``, else ``None``.

    The check runs on the first few prompts: it is about the architecture, not the data. A model
    that passed it keeps its replica until one of its parameters changes.
    """
    if engine == "hooks":
        return None, "hooks: requested"
    known = _CHECKED.get(model)
    if known is not None and known[0] == _fingerprint(model):
        return known[1], known[2]
    try:
        replica = replica or Replica(model)
        sample = tokens[:8]
        with torch.inference_mode():
            mine, _ = replica.run(sample)
            theirs = model(sample, return_type="logits")[:, -1]
        error = float((mine - theirs).abs().max())
        scale = max(1.0, float(theirs.abs().max()))
        if error > 1e-5 * scale:
            raise ReplicaUnsupported(f"replica differs from the model's logits by {error:.2e}")
    except (ReplicaUnsupported, AttributeError, RuntimeError, TypeError, IndexError) as why:
        if engine == "replica":
            raise AnalysisError(f"the replica forward does not cover this model ({why}); use engine='hooks' or 'auto'") from why
        return None, f"hooks: replica unsupported ({why})"
    status = f"replica (max logit error {error:.1e})"
    try:
        _CHECKED[model] = (_fingerprint(model), replica, status)
    except TypeError:  # not weak-referenceable: check again next time
        pass
    return replica, status


# =================================================================================================
# Patch masks
# =================================================================================================


def patch_mask(site: str, shape: tuple, s: int, pos: Optional[torch.Tensor], unit: Optional[torch.Tensor]) -> torch.Tensor:
    """Boolean mask over an activation ``[C, B, ...]`` (positions from ``s`` on) for the patched cells.

    ``pos [C, B]`` is each row's patched position (None: every position), ``unit [C]`` each
    cell's head or neuron (None: all of them).
    """
    C, B = shape[0], shape[1]
    if site == "pattern":  # [C, B, H, S, T]: heads on dim 2, query positions on dim 3
        n_pos, n_unit = shape[3], shape[2]
    else:
        n_pos = shape[2]
        n_unit = shape[3] if site in UNIT_SITES else 1
    if pos is None:
        pos_mask = torch.ones(C, B, n_pos, dtype=torch.bool)
    else:
        pos_mask = torch.arange(s, s + n_pos)[None, None, :] == pos[:, :, None]
    if unit is None:
        unit_mask = torch.ones(C, n_unit, dtype=torch.bool)
    else:
        unit_mask = torch.arange(n_unit)[None, :] == unit[:, None]
    if site == "pattern":
        mask = pos_mask[:, :, None, :] & unit_mask[:, None, :, None]
        return mask[..., None]
    if site == "attn_z":
        return (pos_mask[:, :, :, None] & unit_mask[:, None, None, :])[..., None]
    if site in UNIT_SITES:
        return pos_mask[:, :, :, None] & unit_mask[:, None, None, :]
    return pos_mask[..., None]


def slice_positions(site: str, tensor: torch.Tensor, s: int) -> torch.Tensor:
    """Positions ``s:`` of a cached activation ``[B, T, ...]`` (patterns: query positions)."""
    return tensor[:, :, s:] if site == "pattern" else tensor[:, s:]


