"""Interchanged runs resumed at the intervened layer, from base runs kept once.

Distributed alignment search scores hundreds of interchanges of the *same* base prompts: every
training step and every baseline is one more patched forward of prompts already seen. A patched
run equals its base run before the intervened layer, and before the earliest intervened position
``start`` at every layer (attention is causal). :func:`resumed_runs` therefore keeps, per prompt,
only what resuming needs, computed once:

1. every layer's keys and values of positions ``< start``, once per *distinct* prefix
   ``tokens[:, :start]`` (base prompts that differ only in their teacher-forced answer share it),
   through :meth:`Stepper.base <arithinterp.engine.stepping.Stepper.base>`, which computes the
   first tokens all prefixes share (few-shot examples) once;
2. positions ``start:`` through blocks ``0..layer`` only, on those keys and values: the input of
   the block where interchanges enter, and the site's activation at the read positions (the
   source prompts' values, the probe baseline's activations).

Each interchange then runs the model's own blocks from the intervened layer on positions
``start:`` alone (a residual-stream site enters the next block directly) and unembeds only the
last ``n_last`` positions — the teacher-forced answer tokens — through the model's final norm and
unembedding (and soft-cap, where the model has one), so a 262,144-token vocabulary costs
``n_last`` rows of logits per prompt, not one per position.

The runs are differentiable in an intervention's own parameters when called with autograd on
(the kept tensors carry no graph, so only the intervention gets gradients; the model's weights and
``.grad`` are never touched). Where the model's blocks cannot be stepped exactly
(:func:`~arithinterp.engine.steppers.stepper_for`), or resuming a few of these prompts unpatched
does not reproduce the model's own logits, :func:`resumed_runs` returns ``None`` and the caller
runs whole forwards (:func:`~arithinterp.engine.forward.run`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from arithinterp import sites as site_lib
from arithinterp.engine.forward import Write, Read, heads_split
from arithinterp.engine.hooks import module_hooks
from arithinterp.engine.base_run import BaseRun
from arithinterp.engine.stepping import Stepper, check_n_last
from arithinterp.engine.steppers import stepper_for
from arithinterp.errors import AnalysisError, SiteError

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

_CHECK_TOLERANCE = 1e-4  # relative to the logits' scale, as the stepper's own check
_CHECK_ROWS = 2  # prompts resumed unpatched against the stepper's base run when the runs are made
# sites with one vector per position (and head) inside a block; attention patterns are not one
SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_z", "mlp_pre", "mlp_post")


class _Stop(Exception):
    """Ends a run of blocks once the block an interchange enters has its input."""


class ResumedRuns:
    """Base prompts of one length, kept for interchanges at one site and layer (see the module docstring).

    Made by :func:`resumed_runs`. :meth:`logits` gives the logits of the last ``n_last`` positions
    of prompts ``rows`` with interventions at the site and layer applied (at positions ``start`` or
    later); :meth:`base_reads` the unpatched activation there at the read positions.
    """

    def __init__(self, model: HookedModel, stepper: Stepper, tokens: torch.Tensor, site: str, layer: int, start: int,
                 n_last: int, calls: list, hidden: torch.Tensor, kv: Optional[dict], prefix_of: torch.Tensor,
                 reads: Optional[torch.Tensor], chunk: int):
        self.model, self.stepper, self.tokens = model, stepper, tokens
        self.site, self.layer, self.start, self.n_last = site, layer, start, n_last
        # interchanges at a residual-stream site enter the block after it (resid_post) or its own
        # (resid_pre) directly; any other site enters its block through the site's hook
        self.entry = layer + 1 if site == "resid_post" else layer
        self.calls = calls  # block call arguments from one row: the same for every unpadded prompt of one length
        self.hidden = hidden  # [N, T - start, d]: the input of block `entry` at positions start:
        self.kv = kv  # layer >= entry -> (keys, values) [D, kv_heads, start, d_head] per distinct prefix, or None
        self.prefix_of = prefix_of  # [N] each prompt's distinct prefix
        self.reads = reads  # [N, (k,) ...] the site's activation at the read positions, or None
        self.chunk = chunk  # prompts per resumed forward when logits() is asked for more without autograd

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def base_reads(self, rows: torch.Tensor) -> torch.Tensor:
        """The unpatched activation at the site and read positions of prompts ``rows``, ``[B, (k,) ...]``."""
        if self.reads is None:
            raise AnalysisError("these runs were made without read positions; pass read_positions to resumed_runs")
        return self.reads[rows.to(self.reads.device)]

    def logits(self, rows: torch.Tensor, interventions: Sequence[Write] = ()) -> torch.Tensor:
        """Logits ``[B, n_last, V]`` (float32) of prompts ``rows [B]`` with ``interventions`` applied.

        Each intervention acts at this site and layer, its ``positions`` (``[B]`` or ``[B, k]``, in
        the prompts' frame) at ``start`` or later, its ``source`` (if any) one slice per row. With
        autograd on, the logits are attached to the graph of the interventions' own parameters.
        """
        for item in interventions:
            if item.site != self.site or item.layer != self.layer or item.input_site is not None:
                raise AnalysisError(f"these runs resume at {self.site} layer {self.layer}; an intervention at "
                                    f"{item.site} layer {item.layer} (input site {item.input_site}) needs runs of "
                                    "its own")
            if not isinstance(item.positions, torch.Tensor) or item.positions.shape[0] != len(rows):
                raise AnalysisError("an intervention on resumed runs needs positions [B] or [B, k] with "
                                    f"B = {len(rows)}")
            if item.positions.numel() and int(item.positions.min()) < self.start:
                raise AnalysisError(f"position {int(item.positions.min())} lies before the runs' start {self.start}")
        if len(rows) > self.chunk and not torch.is_grad_enabled():  # memory: one chunk of prompts at a time
            return torch.cat([self.logits(rows[i: i + self.chunk], [_rows_of(item, slice(i, i + self.chunk))
                                                                   for item in interventions])
                              for i in range(0, len(rows), self.chunk)])
        logits = self._resume(rows.to(self.hidden.device), interventions).float()
        if not _finite(logits.detach()):
            raise AnalysisError("the model's logits are not finite (NaN or inf) under these interventions")
        return logits

    def _resume(self, rows: torch.Tensor, interventions: Sequence[Write]) -> torch.Tensor:
        shifted = []
        for item in interventions:
            assert isinstance(item.positions, torch.Tensor)  # logits() checked it
            shifted.append(replace(item, positions=item.positions.to(self.hidden.device) - self.start))
        hidden = self.hidden[rows]
        edits = []
        if self.site in ("resid_pre", "resid_post"):  # the entry block's input itself
            for item in shifted:
                hidden = item.apply(hidden)
        else:
            n_heads = int(self.model.cfg.n_heads)
            for item in shifted:
                apply = heads_split(item.site, n_heads, item.apply)
                edits.append((item.hook_name(), lambda activation, hook=None, apply=apply: apply(activation)))
        if self.entry == self.stepper.n_layers:  # resid_post of the last block: the final residual stream
            return self.stepper.read_logits(hidden, self.n_last)
        kv = None
        if self.kv is not None:
            prefix = self.prefix_of[rows]
            kv = {i: (keys[prefix], values[prefix]) for i, (keys, values) in self.kv.items()}
        base = BaseRun(self.tokens[rows], [], self.calls, kv, torch.empty(0))
        return self.stepper.resume(base, self.entry, hidden, self.start, edits, n_last=self.n_last)


def _finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is finite (a sum first: one pass, no mask)."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def _rows_of(item: Write, index: slice) -> Write:
    """``item`` for a slice of its rows (positions and source)."""
    positions = item.positions[index] if isinstance(item.positions, torch.Tensor) else item.positions
    return replace(item, positions=positions, source=None if item.source is None else item.source[index])


def resumed_runs(
    model: HookedModel,
    tokens: torch.Tensor,
    site: str,
    layer: int,
    start: int,
    n_last: int,
    *,
    read_positions: Optional[torch.Tensor] = None,
    batch_size: int = 32,
    engine: str = "auto",
) -> Optional[ResumedRuns]:
    """Keep what resuming interchanges at ``site``, ``layer`` from position ``start`` needs for the
    prompts ``tokens [N, T]`` (one length, unpadded; see the module docstring).

    Args:
        start: the earliest position any intervention will change, at most ``T - n_last`` (the scored
            positions are recomputed); 0 is used where the model's blocks do not reuse keys and values.
        n_last: positions whose logits :meth:`ResumedRuns.logits` returns, the last ones.
        read_positions: ``[N]`` or ``[N, k]`` positions at ``start`` or later: keep the unpatched
            activation at the site there (:meth:`ResumedRuns.base_reads`).
        batch_size: prompts per forward (and per resumed forward without autograd).
        engine: ``"auto"``; ``"hooks"`` returns ``None`` (whole forwards asked for).

    Returns ``None`` where the model's blocks cannot be stepped exactly, or resuming does not
    reproduce the model's logits on these prompts (the caller then runs whole forwards).
    """
    if site not in SITES:
        raise SiteError(f"interchanges resume at one vector per position; site {site!r} is not one. "
                        f"Accepted: {', '.join(SITES)}")
    site_lib.check_layers(model, site, [layer])
    N, T = int(tokens.shape[0]), int(tokens.shape[1])
    check_n_last(n_last, T)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= T - n_last:
        raise AnalysisError(f"start must be an int in 0..{T - n_last} (the scored positions are recomputed), "
                            f"got {start!r}")
    if read_positions is not None and read_positions.numel() and int(read_positions.min()) < start:
        raise AnalysisError(f"read positions must lie at start ({start}) or later, got {int(read_positions.min())}")
    if engine == "hooks" or N == 0:
        return None
    stepper, _ = stepper_for(model, tokens, engine, warn=False)
    if stepper is None:
        return None
    if not stepper.reuses_prefix:
        start = 0
    device = next(iter(model.parameters())).device
    tokens = tokens.to(device)
    calls = stepper._calls_until(tokens[:1], stepper.n_layers - 1)  # one row's call arguments serve every row
    for call in calls:
        call.pop("hidden_states")
    entry = layer + 1 if site == "resid_post" else layer
    if start:
        distinct, prefix_of = torch.unique(tokens[:, :start], dim=0, return_inverse=True)
    else:
        distinct, prefix_of = tokens[:1, :0], torch.zeros(N, dtype=torch.long, device=device)
    hidden = torch.empty(0)
    reads: Optional[torch.Tensor] = None
    kept: Optional[dict] = None
    with torch.no_grad():  # no graph, and no inference tensors: resumed runs may be differentiated
        for at in range(0, len(distinct), batch_size):
            # 1. the distinct prefixes of this chunk: every layer's keys and values of positions < start
            chunk = torch.arange(at, min(at + batch_size, len(distinct)), device=device)
            prefix_kv = stepper.base(distinct[chunk], read_only=True).kv if start else None
            if start and prefix_kv is None:  # the blocks took no cache after all
                return None
            if prefix_kv is not None and kept is None:
                kept = {i: tuple(x.new_empty(len(distinct), *x.shape[1:]) for x in prefix_kv[i])
                        for i in range(entry, stepper.n_layers)}
            if prefix_kv is not None and kept is not None:
                for i in kept:
                    for store, x in zip(kept[i], prefix_kv[i]):
                        store[chunk] = x
            # 2. the prompts with those prefixes: positions start: through blocks 0..layer
            rows = torch.nonzero((prefix_of[:, None] == chunk[None]).any(1))[:, 0]
            for part in rows.split(batch_size):
                local = prefix_of[part] - at
                kv = None if prefix_kv is None else {i: (k[local], v[local]) for i, (k, v) in prefix_kv.items()}
                entered, read = _first_blocks(stepper, calls, tokens[part], kv, site, layer, entry, start,
                                              None if read_positions is None else read_positions[part].to(device))
                if not len(hidden):
                    hidden = entered.new_empty(N, *entered.shape[1:])
                hidden[part] = entered
                if read is not None:
                    reads = read.new_empty(N, *read.shape[1:]) if reads is None else reads
                    reads[part] = read
    runs = ResumedRuns(model, stepper, tokens, site, layer, start, n_last, calls, hidden, kept, prefix_of, reads,
                       batch_size)
    with torch.no_grad():  # resuming unpatched must give the stepper's own base logits, else whole forwards
        sample = tokens[:_CHECK_ROWS]
        expected = stepper.base(sample, n_last=n_last).logits.float()
        got = runs.logits(torch.arange(len(sample), device=device))
        if float((got - expected).abs().max()) > _CHECK_TOLERANCE * max(1.0, float(expected.abs().max())):
            return None
    return runs


def _first_blocks(
    stepper: Stepper, calls: list, tokens: torch.Tensor, kv: Optional[dict], site: str, layer: int, entry: int,
    start: int, positions: Optional[torch.Tensor],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Positions ``start:`` of ``tokens [B, T]`` through blocks ``0..layer`` on the keys and values
    ``kv`` of the positions before: the input of block ``entry`` ``[B, T - start, d]`` and the
    site's activation at ``positions`` (``None`` without)."""
    embedded = stepper._calls_until(tokens, 0)[0]["hidden_states"][:, start:]  # block 0's input
    got: dict = {}
    name = site_lib.hook_name(site, layer)

    def keep(activation, hook=None):
        got["read"] = activation
        return activation

    def entering(module, args, kwargs):  # the site's own block: its input
        got["entry"] = args[0] if args else next(iter(kwargs.values()))

    def left(module, args, output):  # resid_post: the block's output, the next one's input
        if entry == layer + 1:
            got["entry"] = output[0] if isinstance(output, tuple) else output
        raise _Stop

    pre = [(stepper.blocks[entry], entering)] if entry == layer else []
    with module_hooks(pre, post=[(stepper.blocks[layer], left)]):
        base = BaseRun(tokens, [], calls, kv, torch.empty(0))
        try:  # the block of the site always runs (its activation is read there), then the run stops
            stepper.resume(base, 0, embedded, start, [(name, keep)])
        except _Stop:
            pass
    if "read" not in got or "entry" not in got:
        raise AnalysisError(f"stepping blocks 0..{layer} did not reach {name}")
    read = None
    if positions is not None:
        read = Read(site, layer, positions=positions - start)
        read = heads_split(site, int(stepper.model.cfg.n_heads), read.take)(got["read"]).detach().clone()
    return got["entry"].detach().clone(), read
