"""Edge runs through the block stepper: each stack of edge sets starts at its first changed receiver.

:meth:`~arithinterp.engine.edges.EdgeForward.run` runs every edge set as a whole forward. But an
edge set changes nothing below the layer of its first receiver whose input changes, and nothing
before the first position at which one of its edges carries a value that differs from the base
run's sender output: a receiver's input is the sum of its senders' outputs, so carrying a value
equal to the current one changes nothing, and attention is causal. So :class:`SteppedEdges`

1. runs the base and the source prompts once through the model's
   :class:`~arithinterp.engine.stepping.Stepper`, reading every sender's output;
2. groups the edge sets by that first changed layer and position, and resumes each stack of
   sets at that block and position with the base run's keys and values of the earlier positions
   (:meth:`~arithinterp.engine.stepping.Stepper.resume`). Blocks whose receivers no set changes
   get no hooks, so the stepper runs only the read position of the last block when no receiver
   sits there.

Receiver inputs are changed at the same hook points, and the same way, as in the whole forward
(the model's own norm recomputed for a head's Q/K/V input; Wang et al. 2023, path patching), but
sparsely: an edge set is a list of its edges (:class:`EdgeEntries`), each receiver recomputes only
the (set, unit) pairs some edge touches, and a head's output is formed only for the sets whose
later receivers read it. The whole forward stays the reference (``engine="hooks"`` in the
circuits functions); the tests pin the two to each other.

On a model with norms on its branches (Gemma 2 and 3) the base and source runs read each norm's
denominator too, and every block a stack runs divides its branch outputs by the base run's,
frozen (:mod:`arithinterp.engine.branch_norms`), as the whole forward does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from arithinterp.engine.branch_norms import BRANCHES
from arithinterp.engine.budget import forward_logits_bytes_per_prompt
from arithinterp.engine.edges import CHANNELS, EdgeForward, Layout, check_additive
from arithinterp.engine.hooks import hook_points, module_hooks
from arithinterp.errors import AnalysisError

if TYPE_CHECKING:
    from arithinterp.engine.stepping import Stepper

RECEIVER_CHANNELS = CHANNELS + ("mlp", "logits")
_PIECE = 2**23  # floats in one gathered piece of sender differences (32 MB)
# floats in the largest tensor of one stacked run (the keys or values repeated per query head, the MLP's
# hidden layer): larger stacks are slower on a CPU, whose caches they outgrow (measured on the 4-layer
# d256 Llama, every edge alone: stacks of 16 MB ran in 0.6-0.8 of the time of 32 MB ones, and faster
# than 4 or 8 MB ones; medians of 3, alternating)
STACK_FLOATS = 2**22


@dataclass(frozen=True)
class EdgeEntries:
    """Edge sets as the list of their edges, one entry each ``[E]``: the set, the position label
    (a row of the one-hot ``[P, B, T]``), the receiver (:meth:`Layout.receiver` order), the sender
    (:class:`Layout` order) and the weight (1: the edge carries the fixed value alone)."""

    set: torch.Tensor
    pos: torch.Tensor
    receiver: torch.Tensor
    sender: torch.Tensor
    weight: torch.Tensor

    def take(self, index: torch.Tensor) -> "EdgeEntries":
        return EdgeEntries(*(getattr(self, f.name)[index] for f in fields(self)))


@dataclass(frozen=True)
class _Receivers:
    """Per receiver ``[R]``: its layer (``n_layers`` for the logits), channel (index into
    :data:`RECEIVER_CHANNELS`) and unit (head, key/value head, or 0)."""

    layer: torch.Tensor
    channel: torch.Tensor
    unit: torch.Tensor

    @classmethod
    def of(cls, layout: Layout) -> "_Receivers":
        rows = []
        for layer in range(layout.n_layers):
            for channel in CHANNELS + (("mlp",) if layout.has_mlp else ()):
                for unit in range(layout.units(channel)):
                    assert layout.receiver(layer, channel, unit) == len(rows)
                    rows.append((layer, RECEIVER_CHANNELS.index(channel), unit))
        rows.append((layout.n_layers, RECEIVER_CHANNELS.index("logits"), 0))
        return cls(*torch.tensor(rows, dtype=torch.long).T)


def stepped_row_bytes(model: Any, seq_len: int, start: int, layer: int) -> int:
    """One stacked sequence of a stepped edge run entering block ``layer`` at position ``start``:
    the forward of the positions from ``start`` on, the base run's keys and values before them
    (copied per stacked sequence, and again when the new ones are appended) and the changed
    receiver inputs with their recomputed norms."""
    L = Layout.of(model)
    width, layers = seq_len - start, max(0, L.n_layers - layer)
    d_head = int(getattr(model.cfg, "d_head", 0) or L.d_model // L.n_heads)
    keys_values = 2 * 4 * 2 * L.n_kv_heads * d_head * seq_len * layers
    return forward_logits_bytes_per_prompt(model, width) + keys_values + 4 * 4 * width * L.d_model * (L.n_heads + 2)


def _rows(copies: torch.Tensor, B: int) -> torch.Tensor:
    """Stacked rows ``[n·B]`` of the stacked copies ``copies [n]`` (row ``c·B + b``)."""
    return (copies[:, None] * B + torch.arange(B, device=copies.device)).reshape(-1)


class SteppedEdges:
    """The base and source runs of one group of equal-length prompts, stepped, and edge sets run
    between them (see the module docstring).

    ``base_senders`` / ``other_senders`` ``[B, T, S, d]`` are every sender's output in the base
    and the other run (float32), ``base_logits`` / ``other_logits`` ``[B, V]`` their final-position
    logits, ``base_scales`` / ``other_scales`` ``[B, T, n_layers, 2]`` their branch norms'
    denominators (None on a model without branch norms). Refuses a model whose residual stream is
    not the sum of its senders' outputs.
    """

    def __init__(self, model: Any, stepper: Stepper, base_tokens: torch.Tensor, other_tokens: torch.Tensor):
        self.model, self.stepper = model, stepper
        self.edges = EdgeForward(model)
        self.layout = L = self.edges.layout
        self.receivers = _Receivers.of(L)
        B = int(base_tokens.shape[0])
        self.tokens = base_tokens
        self.norms = norms = self.edges.norms
        names = [f"blocks.{layer}.attn.hook_z" for layer in range(L.n_layers)]
        # an MLP's output, or with a norm on it that norm's input (divided by its denominator below)
        names += [f"blocks.{layer}.hook_mlp_out" if norms is None or not norms.has(layer, "mlp")
                  else norms.hook(layer, "mlp", "hook_in") for layer in range(L.n_layers)] if L.has_mlp else []
        scale_names = [] if norms is None else [norms.hook(layer, b, "hook_scale") for layer, b in norms.keys]
        with torch.inference_mode():
            run = stepper.base(torch.cat([base_tokens, other_tokens]), read=names + scale_names)
            embed = run.resid[0]  # block 0's input: the embeddings
            scales = None
            if norms is not None:
                scales = norms.ones(*embed.shape[:2], device=embed.device)
                for (layer, branch), name in zip(norms.keys, scale_names):
                    scales[:, :, layer, BRANCHES.index(branch)] = run.acts.pop(name)[..., 0].float()
            # filled in place, sender by sender: a list of the outputs stacked at the end would hold them twice
            stacked = torch.empty(*embed.shape[:2], L.n_senders, L.d_model, device=embed.device)
            stacked[:, :, 0] = embed
            s = 1
            for layer in range(L.n_layers):
                heads = self.edges.head_outputs(layer, run.acts.pop(names[layer]))
                if norms is not None and scales is not None and norms.has(layer, "attn"):
                    heads = norms.apply(heads, layer, "attn", scales[:, :, layer, 0, None, None])
                stacked[:, :, s:s + L.n_heads] = heads
                s += L.n_heads
                if L.has_mlp:
                    out = run.acts.pop(names[L.n_layers + layer])
                    if norms is not None and scales is not None and norms.has(layer, "mlp"):
                        out = norms.apply(out, layer, "mlp", scales[:, :, layer, 1, None])
                    stacked[:, :, s] = out
                    s += 1
            check_additive(self.edges, stacked, run.resid[L.n_layers])
        self.run = run.rows(slice(0, B))
        self.base_senders, self.other_senders = stacked[:B], stacked[B:]
        self.base_logits, self.other_logits = run.logits[:B].float(), run.logits[B:].float()
        self.base_scales = None if scales is None else scales[:B]
        self.other_scales = None if scales is None else scales[B:]

    # --- planning -----------------------------------------------------------------------------------

    def sets(
        self, entries: EdgeEntries, n_sets: int, values: torch.Tensor, onehot: torch.Tensor, *, budget: float,
        batch_cells: Optional[int] = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
        """Run ``n_sets`` edge sets given as ``entries``: the base run with each set's edges carrying
        ``values [B, T, S, d]`` (the fixed sender outputs) into their receivers at the positions
        ``onehot [P, B, T]`` marks for their label. Yields ``(set ids [c], final-position logits
        [c, B, V])`` until every set has run; sets that change nothing get the base run's logits.

        Stacks hold at most ``batch_cells`` sets, and as many as fit in ``budget`` bytes.
        """
        L, (B, T) = self.layout, self.tokens.shape
        device = self.base_senders.device
        values = values.float().to(device)
        diff = values - self.base_senders
        entries = EdgeEntries(*(getattr(entries, f.name).to(device) for f in fields(entries)))
        onehot = onehot.float().to(device)
        # the first position at which each (label, sender) edge carries a value other than the base run's
        hit = (onehot != 0)[:, :, :, None] & (diff != 0).any(-1)[None]  # [P, B, T, S]
        positions = torch.arange(T, device=device)[None, None, :, None]
        first = torch.where(hit, positions, T).amin((1, 2))  # [P, S]
        if not self.stepper.reuses_prefix:  # every position is recomputed: a run starts at 0
            first = torch.where(first < T, 0, T)
        at = first[entries.pos, entries.sender]
        live = at < T
        r_layer = self.receivers.layer.to(device)[entries.receiver]
        never = L.n_layers + 1
        layer_of = torch.full((n_sets,), never, device=device).scatter_reduce(
            0, entries.set[live], r_layer[live], "amin")
        start_of = torch.full((n_sets,), T, device=device).scatter_reduce(0, entries.set[live], at[live], "amin")
        # below its set's first changed layer an edge changes nothing (every sender there has its base
        # output); nor does one whose sender lies below that layer and carries its base output
        first_run = 1 + layer_of.clamp(max=L.n_layers) * (L.n_heads + L.has_mlp)  # senders computed in the run
        own = entries.set
        keep = (r_layer >= layer_of[own]) & (live | (entries.sender >= first_run[own]))
        entries = entries.take(torch.nonzero(keep).flatten())
        settled = torch.nonzero(layer_of == never).flatten()
        if len(settled):
            yield settled.cpu(), self.base_logits[None].expand(len(settled), -1, -1), False
        runs = torch.nonzero(layer_of != never).flatten()
        if not len(runs):
            return
        key = layer_of[runs] * (T + 1) + start_of[runs]
        order = torch.argsort(key, stable=True)
        runs, key = runs[order], key[order]
        by_set = torch.argsort(entries.set, stable=True)
        entries = entries.take(by_set)
        bounds = torch.searchsorted(entries.set, torch.arange(n_sets + 1, device=device))
        for value in torch.unique_consecutive(key).tolist():
            group = runs[key == value]
            layer, start = divmod(int(value), T + 1)
            per = B * stepped_row_bytes(self.model, T, start, layer)
            size = max(1, min(int(budget // per), STACK_FLOATS // (B * self._largest(T, start))))
            size = min(size, batch_cells) if batch_cells is not None else size
            for part in group.split(size):
                spans = [torch.arange(int(bounds[c]), int(bounds[c + 1]), device=device) for c in part.tolist()]
                chosen = entries.take(torch.cat(spans))
                local = torch.repeat_interleave(torch.arange(len(part), device=device),
                                                torch.tensor([len(s) for s in spans], device=device))
                chosen = EdgeEntries(local, chosen.pos, chosen.receiver, chosen.sender, chosen.weight)
                logits = self._run(layer, start, len(part), chosen, values, diff, onehot)
                yield part.cpu(), logits, True

    def _largest(self, T: int, start: int) -> int:
        """Floats per stacked sequence in the largest tensor of a run from ``start``."""
        cfg, L = self.model.cfg, self.layout
        d_head = int(getattr(cfg, "d_head", 0) or L.d_model // L.n_heads)
        return max(L.n_heads * T * d_head, (T - start) * max(L.d_model, int(getattr(cfg, "d_mlp", 0) or 0)))

    # --- one stacked run ----------------------------------------------------------------------------

    def _run(
        self, layer: int, start: int, n_copies: int, entries: EdgeEntries, values: torch.Tensor,
        diff: torch.Tensor, onehot: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``[c, B, V]`` of ``n_copies`` stacked edge sets resumed at block ``layer`` and
        position ``start`` (``entries.set`` numbers the copies 0..c-1)."""
        L, edges, (B, T) = self.layout, self.edges, self.tokens.shape
        d, width = L.d_model, T - start
        first_run = L.senders_before(layer, "q") if layer < L.n_layers else L.n_senders
        values, diff, onehot = values[:, start:], diff[:, start:], onehot[:, :, start:]
        everywhere = bool((onehot != 0).all())  # a position-free graph: no masking by position
        r = self.receivers
        device = diff.device
        r_layer = r.layer.to(device)[entries.receiver]
        r_channel = r.channel.to(device)[entries.receiver]
        r_unit = r.unit.to(device)[entries.receiver]
        groups: dict[tuple[int, str], tuple] = {}
        for code in torch.unique(r_layer * len(RECEIVER_CHANNELS) + r_channel).tolist():
            j, ch = divmod(int(code), len(RECEIVER_CHANNELS))
            sel = torch.nonzero((r_layer == j) & (r_channel == ch)).flatten()
            groups[j, RECEIVER_CHANNELS[ch]] = (entries.set[sel], entries.pos[sel], r_unit[sel],
                                                entries.sender[sel], entries.weight[sel].float())
        # the senders computed in this run that some edge reads, and for which copies
        needed = {int(s): torch.unique(entries.set[entries.sender == s])
                  for s in torch.unique(entries.sender[entries.sender >= first_run]).tolist()}
        # run sender -> its output for the copies needing it [n, B, w, d] and the first position it covers
        current: dict[int, tuple[torch.Tensor, int]] = {}
        ln_in: dict[int, torch.Tensor] = {}
        inside: list = []
        last = L.n_layers - 1
        # the positions (of the run's) that the current call of each block computes: every one, except
        # in a last block the stepper runs in two calls (keys and values of all but the read position,
        # then the read position alone), which happens when no hook of the stepper's own sits there
        split_last = self.stepper.reuses_prefix and self.run.kv is not None and width > 1 and layer <= last
        window = {j: (0, width) for j in range(layer, L.n_layers + 1)}
        calls = [0]

        def last_block_call(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            w = int(hidden.shape[1])
            window[last] = (0, w) if calls[0] == 0 and w < width else (width - w, width)
            calls[0] += 1

        def delta(group: tuple, units: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
            """The changed (copy, unit) pairs ``keys [K]`` (``copy·units + unit``) and what is added
            to their input at positions ``lo:hi`` of the run ``[K, B, hi - lo, d]``."""
            c, p, u, s, weight = group
            w = hi - lo
            keys, inverse = torch.unique(c * units + u, return_inverse=True)
            out = torch.zeros(len(keys), B, w, d, device=device)
            mask = onehot[:, :, lo:hi]  # [P, B, w]
            base = torch.nonzero(s < first_run).flatten()
            if len(base):
                senders, s_index = torch.unique(s[base], return_inverse=True)
                diffs = diff[:, lo:hi]
                if 4 * len(base) >= len(keys) * len(senders):  # dense edge sets: one product per label
                    table = torch.zeros(len(keys), mask.shape[0], len(senders), device=device)
                    table.index_put_((inverse[base], p[base], s_index), weight[base], accumulate=True)
                    chosen = diffs[:, :, senders]  # [B, w, n_s, d]
                    for label in range(mask.shape[0]):
                        part = chosen if everywhere else chosen * mask[label][:, :, None, None]
                        out += torch.einsum("ks,btsd->kbtd", table[:, label], part)
                else:  # sparse ones (an edge per set): gather each edge's difference
                    step = max(1, _PIECE // (B * w * d))
                    for piece in base.split(step):
                        scale = weight[piece][:, None, None] * (1.0 if everywhere else mask[p[piece]])
                        out.index_add_(0, inverse[piece],
                                       diffs[:, :, s[piece]].permute(2, 0, 1, 3) * scale[..., None])
            for sender in torch.unique(s[s >= first_run]).tolist():
                sel = torch.nonzero(s == sender).flatten()
                where = torch.searchsorted(needed[sender], c[sel])
                output, first = current[sender]
                carried = values[None, :, lo:hi, sender] - output[where][:, :, lo - first:hi - first].float()
                scale = weight[sel][:, None, None] * (1.0 if everywhere else mask[p[sel]])
                out.index_add_(0, inverse[sel], carried * scale[..., None])
            return keys, out

        norms, frozen = self.norms, None if self.base_scales is None else self.base_scales[:, start:]
        branch_in: dict = {}

        def scale(j: int, branch: str, copies: int) -> torch.Tensor:
            """The base run's denominators at block ``j``'s positions, per stacked row ``[copies·B, w, 1]``."""
            assert frozen is not None
            lo, hi = window[j]
            return frozen[:, lo:hi, j, BRANCHES.index(branch)].repeat(copies, 1)[..., None]

        block_hooks: list = []  # hooks the stepper installs; the last block's go with `after` where it is split
        after: list = []  # hooks in place for the whole run, the final norm's included
        for j in range(layer, L.n_layers):
            hooks = after if split_last and j == last else block_hooks
            mlp_sender = L.mlp_sender(j) if L.has_mlp else -1
            # every block the stacks run divides its branches by the base run's denominators, frozen
            for branch in [] if norms is None else norms.branches(j):

                def keep_in(act, hook=None, key=(j, branch)):
                    branch_in[key] = act
                    return act

                def frozen_norm(act, hook=None, j=j, branch=branch, sender=mlp_sender):
                    assert norms is not None
                    out = norms.apply(branch_in.pop((j, branch)), j, branch, scale(j, branch, n_copies))
                    if branch == "mlp" and sender in needed:
                        current[sender] = out.reshape(n_copies, B, act.shape[1], d)[needed[sender]], window[j][0]
                    return out.to(act.dtype)

                assert norms is not None
                hooks += [(norms.hook(j, branch, "hook_in"), keep_in), (norms.hook(j, branch, "hook_out"), frozen_norm)]
            if any((j, ch) in groups for ch in CHANNELS):

                def keep_ln(act, hook=None, j=j):
                    if not inside:  # not the recomputation's own call of ln1
                        ln_in[j] = act
                    return act

                hooks.append((edges.ln1_hook(j), keep_ln))
            for ch in CHANNELS:
                if (j, ch) not in groups:
                    continue

                def proj(act, hook=None, j=j, ch=ch, group=groups[j, ch]):
                    units, w = L.units(ch), act.shape[1]
                    keys, added = delta(group, units, *window[j])
                    rows = _rows(keys // units, B)
                    x = ln_in[j][rows] + added.reshape(-1, w, d).to(ln_in[j].dtype)
                    inside.append(True)
                    try:
                        normed = edges._ln(j, x).reshape(len(keys), B, w, d)
                    finally:
                        inside.pop()
                    weight, bias = edges.w_in[j, ch], edges.b_in[j, ch]
                    heads = act.reshape(act.shape[0], w, units, -1).clone()
                    unit_of = keys % units
                    for unit in torch.unique(unit_of).tolist():
                        mine = unit_of == unit
                        new = normed[mine].flatten(0, 1).to(weight.dtype) @ weight[unit]
                        if bias is not None:
                            new = new + bias[unit]
                        heads[rows.reshape(len(keys), B)[mine].flatten(), :, unit] = new.to(heads.dtype)
                    return heads.reshape(act.shape)

                hooks.append((f"blocks.{j}.attn.{ch}.hook_out", proj))
            heads = [(h, L.head_sender(j, h)) for h in range(L.n_heads) if L.head_sender(j, h) in needed]
            if heads:

                def heads_out(act, hook=None, j=j, heads=heads):
                    z = act.reshape(act.shape[0], act.shape[1], L.n_heads, -1)
                    for h, sender in heads:
                        copies = needed[sender]
                        out = z[_rows(copies, B), :, h] @ edges.w_out[j][h].to(z.dtype)  # [n·B, w, d]
                        if norms is not None and norms.has(j, "attn"):
                            out = norms.apply(out, j, "attn", scale(j, "attn", len(copies)))
                        current[sender] = out.reshape(len(copies), B, act.shape[1], d), window[j][0]
                    return act

                hooks.append((f"blocks.{j}.attn.hook_z", heads_out))
            if (j, "mlp") in groups:

                def mlp_in(act, hook=None, j=j, group=groups[j, "mlp"]):
                    keys, added = delta(group, 1, *window[j])
                    return act.index_add(0, _rows(keys, B), added.reshape(-1, act.shape[1], d).to(act.dtype))

                hooks.append((edges.mlp_in_hook(j), mlp_in))
            if mlp_sender in needed and (norms is None or not norms.has(j, "mlp")):  # else its norm's hook keeps it

                def mlp_out(act, hook=None, j=j, sender=mlp_sender):
                    current[sender] = act.reshape(n_copies, B, act.shape[1], d)[needed[sender]], window[j][0]
                    return act

                hooks.append((f"blocks.{j}.hook_mlp_out", mlp_out))
        if (L.n_layers, "logits") in groups:  # the final norm's input, at the read position

            def final(act, hook=None, group=groups[L.n_layers, "logits"]):
                keys, added = delta(group, 1, width - act.shape[1], width)
                return act.index_add(0, _rows(keys, B), added.reshape(-1, act.shape[1], d).to(act.dtype))

            after.append((edges.final_hook, final))
        run = self.run
        hidden = run.resid[layer][:, start:].repeat(n_copies, 1, 1)
        tracked = [(self.stepper.blocks[last], last_block_call)] if split_last else []
        with torch.inference_mode(), hook_points(self.model, after), module_hooks(tracked):
            logits = self.stepper.resume(run, layer, hidden, start, edits=block_hooks, n_stack=n_copies)
        if logits.shape[0] != n_copies * B:
            raise AnalysisError(f"a stepped edge run returned {logits.shape[0]} rows for {n_copies * B}")
        return logits.float().reshape(n_copies, B, -1)
