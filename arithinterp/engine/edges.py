"""Edge-level runs: sender outputs read per head, and receiver inputs changed per edge.

A *sender* writes into the residual stream: the embeddings (``blocks.0.hook_resid_pre``: token
plus positional embedding), each attention head (its output ``z_h @ W_O[h]``, computed from
``hook_z``; the shared ``b_O`` belongs to no head and never differs between runs) and each MLP
(``hook_mlp_out``). A *receiver* reads the residual stream: each head's query, key and value
input (separately), each MLP's input and the unembedding (the final residual). The input of a
receiver is the sum of its upstream senders' outputs, so an edge ``s → r`` is changed by adding
``value_s − current_s`` to the input of ``r`` alone (Wang et al. 2023, path patching; the edge
formulation of Conmy et al. 2023, ACDC).

Every decoder block has one norm in front of Q, K and V, so a head's own Q/K/V input does not
exist as a tensor in the model. The receiver's projection is recomputed instead, at the
projection's output hook (``attn.q.hook_out``): ``W_Q[h] · ln1(x + δ_h) + b_Q[h]`` with the
model's own ``ln1`` module and weights, where ``x`` is ln1's input in this very run. With δ = 0
this is the model's own value; the tests check that changing every edge reproduces the source
run. MLP inputs are changed at ``ln2.hook_in`` and the unembedding's at ``ln_final.hook_in``
(``unembed.hook_in`` in models without a final norm), so no TransformerLens option has to be
switched on and every bridge whose attention has separate Q/K/V projections works.

Norms on the branches (Gemma 2 and 3 norm each attention and MLP output before adding it): a
head's output reaches the residual stream only through its layer's norm, whose denominator is the
rms of every head's output together. Edges there are computed with the branch norms' scales frozen
(:mod:`arithinterp.engine.branch_norms`, as circuit-tracer does for Gemma 2): a sender's output is
its term of the branch divided by its own run's denominator, and an edge run divides by the base
run's (``scales``), so the stream is again the sum of the senders and an edge patch does not
re-normalise the branch.

Tensors: sender outputs ``[B, T, S, d_model]`` (``S = 1 + n_layers·n_heads + n_mlps``, order of
:class:`Layout`); edge weights per receiver ``[C, B, T, S]`` (``C`` stacked edge sets, each a
copy of the batch: many edge sets run in one forward, as the patching sweeps stack cells).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Optional, cast

import torch

from arithinterp.checks import architecture
from arithinterp.engine.branch_norms import BRANCHES, BranchNorms
from arithinterp.engine.budget import backward_bytes_per_prompt, forward_logits_bytes_per_prompt
from arithinterp.engine.hooks import forward_with_hooks
from arithinterp.errors import AnalysisError

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

CHANNELS = ("q", "k", "v")


@dataclass(frozen=True)
class Layout:
    """Where each sender and receiver sits: index tables for the model's graph.

    Senders: ``0`` = embeddings, then per layer its heads (``n_heads``) and its MLP (if any).
    Receivers: per layer the q inputs of its heads, the k and v inputs of its key/value heads,
    its MLP input (if any); last the logits.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    has_mlp: bool
    parallel: bool
    d_model: int

    @classmethod
    def of(cls, model: HookedModel) -> "Layout":
        facts = architecture(model)
        return cls(*(facts[f.name] for f in fields(cls)))

    # senders -------------------------------------------------------------------------------
    def head_sender(self, layer: int, head: int) -> int:
        return 1 + layer * (self.n_heads + self.has_mlp) + head

    def mlp_sender(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + self.has_mlp) + self.n_heads

    @property
    def n_senders(self) -> int:
        return 1 + self.n_layers * (self.n_heads + self.has_mlp)

    def senders_before(self, layer: int, channel: str) -> int:
        """Number of senders upstream of a receiver at ``layer`` (a prefix of the sender order)."""
        if channel == "logits":
            return self.n_senders
        start = 1 + layer * (self.n_heads + self.has_mlp)
        return start + (self.n_heads if channel == "mlp" and not self.parallel else 0)

    # receivers -----------------------------------------------------------------------------
    def per_layer_receivers(self) -> int:
        return self.n_heads + 2 * self.n_kv_heads + self.has_mlp

    def receiver(self, layer: int, channel: str, head: int = 0) -> int:
        if channel == "logits":
            return self.n_layers * self.per_layer_receivers()
        base = layer * self.per_layer_receivers()
        offset = {"q": 0, "k": self.n_heads, "v": self.n_heads + self.n_kv_heads,
                  "mlp": self.n_heads + 2 * self.n_kv_heads}[channel]
        return base + offset + head

    @property
    def n_receivers(self) -> int:
        return self.n_layers * self.per_layer_receivers() + 1

    def units(self, channel: str) -> int:
        return {"q": self.n_heads, "k": self.n_kv_heads, "v": self.n_kv_heads}.get(channel, 1)


def linear_weight(bridge: Any, n_units: int, input_side: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A projection's weight per head: ``[H, d_model, d_head]`` for Q/K/V (``input_side``), or
    ``[H, d_head, d_model]`` for the output projection; and its bias ``[H, d_head]`` (Q/K/V only)."""
    module = getattr(bridge, "original_component", None)
    if module is None or not hasattr(module, "weight"):
        raise AnalysisError(
            "edge runs need separate q, k, v and o projections with weights; "
            f"this attention has {type(bridge).__name__}"
        )
    weight = module.weight
    # HF Conv1D stores [in, out]; nn.Linear [out, in]
    w = weight if type(module).__name__ == "Conv1D" else weight.T  # [in, out]
    bias = getattr(module, "bias", None)
    if input_side:
        w = w.reshape(w.shape[0], n_units, -1).permute(1, 0, 2)  # [H, d_model, d_head]
        b = None if bias is None else bias.reshape(n_units, -1)
        return w, b
    return w.reshape(n_units, -1, w.shape[-1]), None  # [H, d_head, d_model]


class EdgeForward:
    """The model's hooks for edge runs: read sender outputs, change receiver inputs.

    ``weights(layer, channel) -> [C, B, T, units, S_up] | None`` gives, for a stacked forward
    of ``C`` copies of the batch, how much of ``values − current`` of each upstream sender goes
    into each receiver (None: the receiver is untouched). ``values [B, T, S, d]`` are the fixed
    sender outputs that edges carry (source, mean or corrupt run). With ``probe=True`` a zero
    tensor that requires grad is added at every receiver input (``[B, T, units, d]``), for
    gradients at receiver inputs (EAP, Syed et al. 2023; EAP-IG, Hanna et al. 2024).
    """

    def __init__(self, model: Any):
        self.model = model
        self.layout = Layout.of(model)
        L = self.layout
        blocks = model.blocks
        self.w_in, self.b_in, self.w_out = {}, {}, {}
        for layer in range(L.n_layers):
            attn = blocks[layer].attn
            for channel in CHANNELS:
                if not hasattr(attn, channel):
                    raise AnalysisError(
                        f"edge runs need separate q, k and v projections; layer {layer}'s attention "
                        f"({type(attn).__name__}) has no {channel!r}"
                    )
                self.w_in[layer, channel], self.b_in[layer, channel] = linear_weight(
                    getattr(attn, channel), L.units(channel), True
                )
            self.w_out[layer] = linear_weight(attn.o, L.n_heads, False)[0]
        # the output biases belong to no head; they are the same in every run
        biases = [getattr(blocks[layer].attn.o.original_component, "bias", None) for layer in range(L.n_layers)]
        self.norms = BranchNorms.of(model)
        if self.norms is not None:
            normed = [layer for layer in range(L.n_layers)
                      if self.norms.has(layer, "attn") and biases[layer] is not None]
            if normed:
                # through a frozen norm the bias's term would differ between runs with different scales
                raise AnalysisError(
                    f"layer {normed[0]} norms its attention output and its output projection has a bias: edge runs "
                    "need a branch norm's input to be the sum of its heads' outputs alone"
                )
        self.out_bias = sum((b.detach().float() for b in biases if b is not None), torch.zeros(L.d_model))
        self.has_final_norm = hasattr(model, "ln_final")

    def _ln(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        ln = getattr(self.model.blocks[layer], "ln1", None)
        return x if ln is None else ln(x)

    # where receiver inputs are read and changed (the same hook points for whole and stepped runs)
    def ln1_hook(self, layer: int) -> str:
        """The input of the norm in front of Q, K and V (the block's input where there is none)."""
        block = self.model.blocks[layer]
        return f"blocks.{layer}.ln1.hook_in" if hasattr(block, "ln1") else f"blocks.{layer}.hook_resid_pre"

    def mlp_in_hook(self, layer: int) -> str:
        block = self.model.blocks[layer]
        return f"blocks.{layer}.ln2.hook_in" if hasattr(block, "ln2") else f"blocks.{layer}.mlp.hook_in"

    @property
    def final_hook(self) -> str:
        """The unembedding's input before the final norm (the logits receiver)."""
        return "ln_final.hook_in" if self.has_final_norm else "unembed.hook_in"

    def head_outputs(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """Each head's output ``z_h @ W_O[h]`` ``[N, T, H, d_model]`` from ``hook_z`` ``[N, T, H·d_head]``."""
        z = z.reshape(*z.shape[:2], self.layout.n_heads, -1)
        return torch.einsum("nthe,hed->nthd", z, self.w_out[layer].to(z.dtype))

    def run(
        self,
        tokens: torch.Tensor,
        *,
        copies: int = 1,
        values: Optional[torch.Tensor] = None,
        weights: Optional[Callable[[int, str], Optional[torch.Tensor]]] = None,
        probe: bool = False,
        embed: Optional[torch.Tensor] = None,
        read_senders: bool = False,
        neurons: Any = None,
        neuron_weights: Optional[Callable[[int], Optional[torch.Tensor]]] = None,
        scales: Optional[torch.Tensor] = None,
    ) -> dict:
        """One forward of ``tokens [B, T]`` repeated ``copies`` times along the batch.

        ``embed [B, T, d]`` replaces the embeddings (``blocks.0.hook_resid_pre``; integrated
        gradients interpolate it). Returns ``logits [C, B, 1, V]`` at the final position (the
        unembedding runs there alone; ``[C, B, T, V]`` in a model without a final norm, whose
        unembedding's own input is the logits receiver), ``senders [C·B, T, S, d]``
        when ``read_senders``, and with ``probe`` the probes ``{(layer, channel): [B, T, units, d]}``.

        On a model with norms on its branches (:mod:`~arithinterp.engine.branch_norms`) each norm
        divides by ``scales [B, T, n_layers, 2]``, the base run's denominators, frozen (for every
        copy); without ``scales``, by this run's own, detached (the model's own forward, whose
        gradients are those of the norms frozen there). Runs that change receivers' inputs need
        ``scales``. ``scales [C·B, T, n_layers, 2]``, the denominators used, are returned with
        ``senders`` (None on models without branch norms).

        ``neurons`` (a :class:`~arithinterp.engine.neuron_inputs.NeuronInputs`) makes its MLP
        neurons receivers of their own: ``neuron_weights(layer) -> [C, B, T, u, S_up] | None``
        says how much of each upstream sender's ``values − current`` goes into each chosen
        neuron's own input, and with ``probe`` a zero probe ``[C·B, T, u, d]`` is added there
        (returned as ``neuron_probes`` ``{layer: probe}``).
        """
        L = self.layout
        B, T = tokens.shape
        norms = self.norms
        if norms is not None and scales is None and (weights is not None or neuron_weights is not None):
            raise AnalysisError("edge runs on a model with norms on its branches need the base run's scales "
                                "(from sender_outputs), so that an edge patch does not re-normalise the branch")
        frozen = None if scales is None else scales.float().repeat(copies, 1, 1, 1)  # [C·B, T, n_layers, 2]
        used: dict = {}  # (layer, branch) -> the denominators this run divided by [C·B, T, 1]
        branch_in: dict = {}  # (layer, branch) -> the norm's input
        raw_heads: dict = {}  # layer -> each head's output before its layer's norm [C·B, T, H, d]
        stacked = tokens.repeat(copies, 1)
        current: list = [None] * L.n_senders
        ln_in: dict = {}
        probes: dict = {}
        inside: list = []
        residual: list = [None]
        hooks = []

        def carried(w: Optional[torch.Tensor], units: int, device, kept: dict, key) -> Optional[torch.Tensor]:
            """``[C·B, T, units, d]`` to add at a receiver's input (``w`` [C, B, T, units, S_up]
            of each upstream sender's ``values − current``, and a probe), or None."""
            out = None
            if w is not None:
                assert values is not None, "edge weights need the senders' values"
                # only the senders some edge set changes here: an edge set is usually sparse
                active = torch.nonzero(w.reshape(-1, w.shape[-1]).abs().sum(0)).flatten().tolist()
                cur = torch.stack([current[s] for s in active], dim=2).float()  # [C·B, T, S_active, d]
                diff = values[:, :, active].float().repeat(copies, 1, 1, 1) - cur
                w = w[..., active].reshape(copies * B, T, w.shape[-2], len(active)).float()
                out = torch.einsum("ntus,ntsd->ntud", w, diff)
            if probe:
                p = torch.zeros(copies * B, T, units, L.d_model, device=device, requires_grad=True)
                kept[key] = p
                out = p if out is None else out + p
            return out

        def delta(layer: int, channel: str, device, dtype) -> Optional[torch.Tensor]:
            w = None if weights is None else weights(layer, channel)
            return carried(w, L.units(channel), device, probes, (layer, channel))

        mlp_x: dict = {}  # each MLP's input in this run (what its neurons' own inputs start from)
        neuron_probes: dict = {}
        neuron_normed: dict = {}

        def embed_hook(act, hook=None):
            if embed is not None:
                act = embed.to(act.dtype).repeat(copies, 1, 1)
            current[0] = act
            return act

        hooks.append(("blocks.0.hook_resid_pre", embed_hook))
        for layer in range(L.n_layers):

            def keep_ln(act, hook=None, layer=layer):
                if not inside:  # not the recomputation's own call of ln1
                    ln_in[layer] = act
                return act

            hooks.append((self.ln1_hook(layer), keep_ln))
            for channel in CHANNELS:

                def proj(act, hook=None, layer=layer, channel=channel):
                    d = delta(layer, channel, act.device, act.dtype)
                    if d is None:
                        return act
                    # recompute only the heads whose input changes (every head when probing)
                    if probe:
                        units = torch.arange(d.shape[2], device=d.device)
                    else:
                        units = torch.nonzero(d.detach().abs().sum((0, 1, 3))).flatten()
                    if len(units) == 0:
                        return act
                    x = ln_in[layer][:, :, None, :] + d[:, :, units].to(ln_in[layer].dtype)  # [N, T, u, d]
                    w, b = self.w_in[layer, channel][units], self.b_in[layer, channel]
                    inside.append(True)
                    try:
                        normed = self._ln(layer, x)
                    finally:
                        inside.pop()
                    new = torch.einsum("ntud,udh->ntuh", normed.to(w.dtype), w)
                    if b is not None:
                        new = new + b[units]
                    heads = act.reshape(*act.shape[:2], d.shape[2], -1)
                    if len(units) == d.shape[2]:
                        return new.to(act.dtype).reshape(act.shape)
                    heads = heads.clone()
                    heads[:, :, units] = new.to(act.dtype)
                    return heads.reshape(act.shape)

                hooks.append((f"blocks.{layer}.attn.{channel}.hook_out", proj))

            def heads_out(act, hook=None, layer=layer):
                result = self.head_outputs(layer, act)
                if norms is not None and norms.has(layer, "attn"):  # terms of the norm's input, divided there
                    raw_heads[layer] = result
                    return act
                for h in range(L.n_heads):
                    current[L.head_sender(layer, h)] = result[:, :, h]
                return act

            hooks.append((f"blocks.{layer}.attn.hook_z", heads_out))
            for branch in [] if norms is None else norms.branches(layer):

                def keep_in(act, hook=None, key=(layer, branch)):
                    branch_in[key] = act
                    return act

                def own_scale(act, hook=None, key=(layer, branch)):
                    used[key] = act.detach().float()
                    return act

                def frozen_norm(act, hook=None, layer=layer, branch=branch):
                    assert norms is not None
                    key = (layer, branch)
                    f = used[key] if frozen is None else frozen[:, :, layer, BRANCHES.index(branch), None]
                    used[key] = f
                    out = norms.apply(branch_in.pop(key), layer, branch, f)
                    if branch == "attn":
                        heads = norms.apply(raw_heads.pop(layer), layer, branch, f[:, :, None])
                        for h in range(L.n_heads):
                            current[L.head_sender(layer, h)] = heads[:, :, h]
                    else:
                        current[L.mlp_sender(layer)] = out
                    return out.to(act.dtype)

                assert norms is not None
                hooks.append((norms.hook(layer, branch, "hook_in"), keep_in))
                if frozen is None:
                    hooks.append((norms.hook(layer, branch, "hook_scale"), own_scale))
                hooks.append((norms.hook(layer, branch, "hook_out"), frozen_norm))
            if L.has_mlp:

                def mlp_in(act, hook=None, layer=layer):
                    if inside:  # the recomputation of a neuron's own input calls ln2 again
                        return act
                    d = delta(layer, "mlp", act.device, act.dtype)
                    act = act if d is None else act + d[:, :, 0].to(act.dtype)
                    mlp_x[layer] = act
                    return act

                def mlp_out(act, hook=None, layer=layer):
                    current[L.mlp_sender(layer)] = act
                    return act

                hooks.append((self.mlp_in_hook(layer), mlp_in))
                if norms is None or not norms.has(layer, "mlp"):  # else its norm's hook keeps it
                    hooks.append((f"blocks.{layer}.hook_mlp_out", mlp_out))

        inputs = cast(Any, neurons)  # a NeuronInputs (not imported here: it builds on this module)
        for layer in ([] if neurons is None else cast(Any, neurons).layers):
            for proj in inputs.projections(layer):

                def neuron_in(act, hook=None, layer=layer, proj=proj):
                    if layer not in neuron_normed:  # the layer's first projection: the neurons' own inputs
                        w = None if neuron_weights is None else neuron_weights(layer)
                        units = torch.arange(inputs.units(layer))
                        if w is not None and not probe:  # recompute only the neurons some edge set changes
                            units = torch.nonzero(w.abs().sum((0, 1, 2, 4))).flatten().cpu()
                            w = w[..., units.to(w.device), :]
                        d = carried(w, len(units), act.device, neuron_probes, layer) if len(units) else None
                        normed = None
                        if d is not None:
                            inside.append(True)
                            try:
                                normed = inputs.normed(layer, mlp_x[layer][:, :, None, :] + d.to(mlp_x[layer].dtype))
                            finally:
                                inside.pop()
                        neuron_normed[layer] = normed, units
                    normed, units = neuron_normed[layer]
                    return act if normed is None else inputs.replace(layer, proj, act, normed, units)

                hooks.append((inputs.hook(layer, proj), neuron_in))

        def final(act, hook=None):
            residual[0] = act
            d = delta(L.n_layers, "logits", act.device, act.dtype)
            return act if d is None else act + d[:, :, 0].to(act.dtype)

        hooks.append((self.final_hook, final))
        # the final position's logits alone (every position's if a hook watches the unembedding itself)
        logits = forward_with_hooks(self.model, stacked, hooks, return_type="logits", last=1)
        out = {"logits": logits.reshape(copies, B, logits.shape[1], -1)}
        if read_senders:
            out["senders"] = torch.stack(current, dim=2)
            out["residual"] = residual[0]
            out["scales"] = None
            if norms is not None:
                got = norms.ones(copies * B, T, device=residual[0].device)
                for (layer, branch), f in used.items():
                    got[:, :, layer, BRANCHES.index(branch)] = f[..., 0]
                out["scales"] = got
        if probe:
            out["probes"] = probes
            if neurons is not None:
                out["neuron_probes"] = neuron_probes
        return out


def sender_outputs(
    model: HookedModel, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Every sender's output on ``tokens [B, T]``.

    Returns:
        ``(senders [B, T, S, d_model], final logits [B, V], scales)``: ``scales [B, T, n_layers, 2]``
        are the branch norms' denominators of this run (:mod:`~arithinterp.engine.branch_norms`),
        which edge runs on these prompts freeze; None on a model without branch norms.

    Raises:
        AnalysisError: the final residual stream is not the sum of the senders' outputs.
    """
    engine = EdgeForward(model)
    with torch.inference_mode():
        out = engine.run(tokens, read_senders=True)
    senders = out["senders"].float()
    check_additive(engine, senders, out["residual"])
    return senders, out["logits"][0, :, -1].float(), out["scales"]


def check_additive(engine: EdgeForward, senders: torch.Tensor, final: torch.Tensor) -> None:
    """Refuse a model whose final residual stream ``[B, T, d]`` is not the sum of the senders'
    outputs ``[B, T, S, d]`` (and the output biases): its edge graph would be wrong.

    Norms on the branches pass with their scales frozen (the senders are then the normed terms);
    a block that adds its branches to the stream any other way than as they are does not."""
    total = senders.sum(2) + engine.out_bias.to(senders.device)
    final = final.float()
    error = float((total - final).norm(dim=-1).max() / final.norm(dim=-1).max().clamp_min(1e-12))
    if error > 1e-3:
        raise AnalysisError(
            "this model's residual stream is not the sum of the embeddings, head and MLP outputs "
            f"(relative gap {error:.2g}): edge graphs need blocks that add each head's and MLP's output to the "
            "residual stream as it is, or through an RMSNorm on the branch (whose scale edge runs freeze), not "
            "scaled or mixed with the stream in any other way"
        )


# --- memory per unit, for budgets ------------------------------------------------------------------


def sender_bytes(model: HookedModel, seq_len: int) -> int:
    """One prompt's sender outputs ``[T, S, d_model]`` in float32."""
    L = Layout.of(model)
    return 4 * seq_len * L.n_senders * L.d_model


def edge_run_bytes(model: HookedModel, seq_len: int) -> int:
    """One stacked sequence of :meth:`EdgeForward.run` with edges changed: the forward and its
    logits at every position, every sender's output kept for the receivers downstream, and at a
    receiver the changed senders' current and fixed outputs and their difference (at most every
    sender; measured within 10% on the 135M Llama shape)."""
    return forward_logits_bytes_per_prompt(model, seq_len) + 4 * sender_bytes(model, seq_len)


def gradient_run_bytes(model: HookedModel, seq_len: int) -> int:
    """One prompt of a probed :meth:`EdgeForward.run` and its backward (EAP, EAP-IG): the model's
    forward kept for the backward, a probe and its gradient at every receiver input with the
    recomputed norms and projections kept for the backward (about 9 receiver-sized tensors), and
    the source, base and difference of the sender outputs (measured within 10% on the 135M Llama
    shape: about 430 MB per prompt of 31 tokens)."""
    L = Layout.of(model)
    receivers = 4 * seq_len * L.n_receivers * L.d_model
    return backward_bytes_per_prompt(model, seq_len) + 9 * receivers + 4 * sender_bytes(model, seq_len)
