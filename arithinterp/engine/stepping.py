"""Stepping a model's own blocks from a chosen layer and position.

A patched run differs from its base run only from the patched layer on, and only at positions
from the earliest patched one on (attention is causal). So instead of a whole forward per patch,
the engine

1. runs the base prompts once through the model itself, recording what each block was called
   with (hidden states, attention mask, rotary tables, position ids) and, through the key/value
   cache argument every Hugging Face decoder block takes, each layer's keys and values;
2. resumes a stack of patched runs at block ``layer``: the block is called on positions ``s:``
   only, with the base run's keys and values of positions ``< s`` handed in as its cache, and so
   on through the last block.

Where keys and values are reused the engine computes less still: the last block runs only the
positions that are read (the others only up to their keys and values, through a cache that stops
the block there), a patch inside one block at one position runs that block at that position alone,
the last block entered with one changed position per row computes only those keys and values, and
base prompts that share their first tokens compute them once.

Because the model's own block modules do the arithmetic, rotary embeddings, grouped-query and
parallel attention, gated MLPs, soft-capping and extra norms come with the model. What the engine
slices is only the per-position call arguments it recognises; a block that takes a
position-indexed argument it does not know, or does not use the cache, is resumed from position 0
(still from the patched layer). Every model is checked once: resuming mid-way must reproduce the
model's own logits, else the engine says so and the caller falls back to whole forwards.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from arithinterp.engine.hooks import hook_points, module_hooks, unembed_last
from arithinterp.engine.native import native_attention_cache
from arithinterp.errors import AnalysisError

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

# call arguments that carry a position axis, and where it is
# How an analysis runs its patched forwards: stepped, whole forwards with hooks, or "auto" (stepped where exact).
ENGINES = ("auto", "stepped", "hooks")
_POSITION_AXIS = {"position_ids": -1, "cache_position": -1, "position_embeddings": -2, "attention_mask": -2}
_CHECK_TOLERANCE = 1e-4  # relative to the logits' scale


def _is_cache(value: Any) -> bool:
    return hasattr(value, "update") and hasattr(value, "get_seq_length")


class _StopBeforeBlock(Exception):
    """Ends the model's own forward before a block, which the stepper then runs itself."""


class _KeysValuesKept(Exception):
    """Raised by :class:`_PrefixCache` once the keys and values it was asked to keep are in."""


class _PrefixCache:
    """A stand-in for a Hugging Face key/value cache.

    A block's attention calls ``update(keys, values, layer)`` with the keys and values of the
    positions it computes and attends over what comes back. Here that is the stored prefix
    (positions ``< s``) followed by the new ones; with ``record`` the full tensors are kept. With
    ``keep_only=layer`` that layer's keys and values become its prefix and the block stops there
    (:class:`_KeysValuesKept`): nothing after the projections is computed.
    """

    def __init__(self, prefix: Optional[dict] = None, record: bool = False):
        self.prefix = prefix or {}
        self.record = record
        self.keep_only: Optional[int] = None
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, keys, values, layer_idx, *args, **kwargs):
        if layer_idx in self.prefix:
            old_k, old_v = self.prefix[layer_idx]
            keys, values = _stacked_cat([old_k, keys], -2), _stacked_cat([old_v, values], -2)
        if self.record:
            self.kv[layer_idx] = (keys, values)
        if layer_idx == self.keep_only:
            self.prefix[layer_idx], self.keep_only = (keys, values), None
            raise _KeysValuesKept
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        prefix = self.prefix.get(layer_idx)
        return 0 if prefix is None else int(prefix[0].shape[-2])


def _stacked_cat(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)`` for stacked runs (row ``c * B + b`` is run ``c`` of prompt ``b``),
    where a part with ``B`` rows instead of ``n * B`` is the base run's, shared by all ``n`` runs.

    The shared part is written straight into each run's slot of the output (one copy), never
    tiled first: the base run's keys and values of the reused prefix, its block outputs after a
    patched position.
    """
    N = max(int(p.shape[0]) for p in parts)
    if all(p.shape[0] == N for p in parts):
        return torch.cat(list(parts), dim)
    B = min(int(p.shape[0]) for p in parts)
    n, rest = divmod(N, B)
    if rest or any(p.shape[0] not in (B, N) for p in parts):
        raise AnalysisError(f"parts of {sorted({int(p.shape[0]) for p in parts})} rows are not all {B} prompts or "
                            f"whole stacks of them")
    dim = dim % parts[0].ndim
    shape = list(parts[0].shape)
    shape[0], shape[dim] = B, sum(int(p.shape[dim]) for p in parts)
    out = parts[0].new_empty(n, *shape)
    at = 0
    for part in parts:
        width = int(part.shape[dim])
        out.narrow(dim + 1, at, width).copy_(part if part.shape[0] == B else part.reshape(n, B, *part.shape[1:]))
        at += width
    return out.view(N, *shape[1:])


@dataclass
class BaseRun:
    """What a base forward leaves behind for resuming patched runs from any layer.

    ``resid[l]`` is the input of block ``l`` ``[B, T, d]`` (``resid[n_layers]`` the final
    residual); ``calls[l]`` block ``l``'s other call arguments; ``kv[l]`` its keys and values
    (``[B, heads, T, d_head]`` each) when the blocks use a cache; ``logits`` ``[B, V]`` at the final
    position (``[B, k, V]`` at the last ``k`` positions when the run was made with ``n_last=k``);
    ``acts`` the activations read by name.
    """

    tokens: torch.Tensor
    resid: list
    calls: list
    kv: Optional[dict]
    logits: torch.Tensor
    acts: dict = field(default_factory=dict)

    def rows(self, index: Any) -> "BaseRun":
        """The run of prompts ``index`` (a slice or index tensor) alone."""
        B = self.tokens.shape[0]

        def take(value: Any) -> Any:
            if isinstance(value, (tuple, list)):
                return type(value)(take(v) for v in value)
            if isinstance(value, dict):
                return {key: take(v) for key, v in value.items()}
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == B:
                return value[index]
            return value

        parts = (self.tokens, self.resid, self.calls, self.kv, self.logits, self.acts)
        return BaseRun(*(take(value) for value in parts))


class Stepper:
    """Runs a model's blocks from any layer and position (see the module docstring)."""

    def __init__(self, model: Any):
        # weakly: the cache of steppers is keyed on the model, and a stepper holding its model
        # would keep every model ever stepped alive
        self._model = weakref.ref(model)
        blocks = getattr(model, "blocks", None)
        if blocks is None or not hasattr(model, "unembed"):
            raise AnalysisError("the model has no 'blocks' and 'unembed': its blocks cannot be stepped")
        self.blocks = list(blocks)
        self.n_layers = len(self.blocks)
        self.final_norm = getattr(model, "ln_final", None) or torch.nn.Identity()
        component = getattr(self.blocks[0], "original_component", self.blocks[0])
        self._signature = inspect.signature(component.forward)
        cap = float(getattr(model.cfg, "output_logits_soft_cap", -1.0) or -1.0)
        self.logit_cap = cap if cap > 0 else None
        self.reuses_prefix = True  # settled by check()
        self.shares_prefixes = False  # prompts sharing a prefix compute it once: settled by check()

    @property
    def model(self) -> Any:
        model = self._model()
        if model is None:
            raise AnalysisError("the model this stepper stepped has been freed; get a stepper for a live model")
        return model

    # --- base run -------------------------------------------------------------------------------

    def base(
        self, tokens: torch.Tensor, read: Sequence[str] = (), n_last: Optional[int] = None, read_only: bool = False,
        with_logits: bool = True,
    ) -> BaseRun:
        """Run ``tokens [B, T]`` through the model, recording what resuming needs and ``read``.

        The run's logits are ``[B, V]`` at the final position, or ``[B, n_last, V]`` at the last
        ``n_last`` positions (teacher-forced answers, one position per answer token). With
        ``read_only`` (on a model whose keys and values are reused) the last block runs only
        those positions, as in :meth:`resume`: activations read inside it cover them alone, and
        ``resid[n_layers]`` is NaN at the other positions. ``with_logits=False`` (with ``read_only``):
        only the reads are wanted, and the run's logits are left empty (nothing is unembedded).
        """
        check_n_last(n_last, int(tokens.shape[1]))
        model = self.model
        T, n_read, last = int(tokens.shape[1]), n_last or 1, self.n_layers - 1
        cut = read_only and self.reuses_prefix and T > n_read
        split = self._shared_prefix(tokens, n_read) if cut and self.shares_prefixes else None
        if split is not None:
            return self._checked(self._shared_base(tokens, read, n_last, *split, with_logits=with_logits))
        resid: list = [None] * (self.n_layers + 1)
        calls: list = [None] * self.n_layers
        cache = _PrefixCache(record=True)
        acts: dict = {}

        def before(layer):
            def hook(module, args, kwargs):
                bound = self._bind(args, kwargs)
                resid[layer] = bound.pop("hidden_states")
                for key, value in list(bound.items()):
                    if _is_cache(value):
                        bound[key] = cache
                calls[layer] = bound
                if cut and layer == last:
                    raise _StopBeforeBlock
                return (resid[layer],), bound

            return hook

        def after_last(module, args, output):
            resid[self.n_layers] = output[0] if isinstance(output, tuple) else output

        def keep(name):
            def hook(activation, hook):
                acts[name] = activation  # under the name asked for (a hook's own name may be the aliased one)

            return hook

        pre = [(block, before(i)) for i, block in enumerate(self.blocks)]
        with self._cache_reaches_attention(cache), hook_points(model, [(name, keep(name)) for name in read]):
            try:
                with module_hooks(pre, post=[(self.blocks[-1], after_last)]), unembed_last(model, n_read):
                    logits = model(tokens, return_type="logits")  # the read positions' alone
                logits = logits[:, -1] if n_last is None else logits[:, -n_last:]
            except _StopBeforeBlock:  # the last block, the read positions only
                run = BaseRun(tokens, resid, calls, None, torch.empty(0), acts)
                final = self._run(run, last, resid[last], 0, cache, n_read=n_read, read_only=True)
                resid[self.n_layers] = unread_as_nan(final, T)
                logits = self.read_logits(final, n_last) if with_logits else torch.empty(0)
        return self._checked(BaseRun(tokens, resid, calls, dict(cache.kv), logits, acts))

    def _checked(self, run: BaseRun) -> BaseRun:
        if not torch.isfinite(run.logits).all():
            raise AnalysisError(
                "the model's logits on the base prompts are not finite (NaN or inf): its weights or "
                "activations are broken, so every patching number would be NaN"
            )
        if run.kv is None or len(run.kv) != self.n_layers:  # the blocks do not use the cache
            run.kv, self.reuses_prefix = None, False
        return run

    # --- prompts that share their first tokens compute them once -------------------------------

    def _shared_prefix(self, tokens: torch.Tensor, n_read: int) -> Optional[tuple]:
        """``(k, representatives, inverse)`` (see :func:`_split_at`) for the prefix length ``k``
        that saves most positions, or None when none saves a fifth of them."""
        B, T = tokens.shape
        order = _prefix_order(tokens)
        first = order[0]
        lengths = torch.arange(1, T - n_read + 1, device=tokens.device)
        n_distinct = 1 + (first[None, :] < lengths[:, None]).sum(1)
        cost = n_distinct * lengths + B * (T - lengths)
        best = int(cost.argmin())
        return _split_at(tokens, best + 1, order) if len(lengths) and cost[best] <= 0.8 * B * T else None

    def _shared_base(
        self, tokens: torch.Tensor, read: Sequence[str], n_last: Optional[int], k: int,
        representatives: torch.Tensor, inverse: torch.Tensor, with_logits: bool = True,
    ) -> BaseRun:
        """:meth:`base` (``read_only``) with positions ``:k`` computed once per distinct prefix.

        The model's own forward gives block 0's input, and on one prompt each block's call
        arguments (the prompts have one length: the same for all); the distinct prefixes run
        through the blocks (the last one only for its keys and values), then every prompt's
        positions ``k:`` with its prefix's keys and values. Block inputs, keys, values and read
        activations are put back together.
        """
        T, n_read = tokens.shape[1], n_last or 1
        embedded = self._calls_until(tokens, 0)[0].pop("hidden_states")
        calls = self._calls_until(tokens[:1], self.n_layers - 1)
        for call in calls:
            call.pop("hidden_states")
        run = BaseRun(tokens, [], calls, None, torch.empty(0))
        passes: list[dict] = []  # the activations read in each pass

        def keep(name):
            def hook(activation, hook):
                passes[-1][name] = activation

            return hook

        prefix_cache, prefix_inputs, inputs = _PrefixCache(record=True), [], []
        with hook_points(self.model, [(name, keep(name)) for name in read]):
            passes.append({})  # the distinct prefixes
            with self._cache_reaches_attention(prefix_cache):
                prefix_run = run.rows(representatives)
                self._run(prefix_run, 0, embedded[representatives, :k], 0, prefix_cache, n_read=0, read_only=True,
                          inputs=prefix_inputs)
            passes.append({})  # every prompt's positions k:
            kv = {i: (keys[inverse], values[inverse]) for i, (keys, values) in prefix_cache.kv.items()}
            cache = _PrefixCache(kv, record=True)
            with self._cache_reaches_attention(cache):
                final = self._run(run, 0, embedded[:, k:], k, cache, n_read=n_read, read_only=T - k > n_read,
                                  inputs=inputs)
        resid = [torch.cat([early[inverse], late], 1) for early, late in zip(prefix_inputs, inputs)]
        resid.append(unread_as_nan(final, T))
        prefix_acts, acts = passes
        for name in prefix_acts.keys() & acts.keys():
            acts[name] = _joined(name, prefix_acts[name][inverse], acts[name], T)
        return BaseRun(tokens, resid, run.calls, dict(cache.kv), self.read_logits(final, n_last) if with_logits else
                       torch.empty(0), acts)

    def _calls_until(self, tokens: torch.Tensor, stop: int) -> list[dict]:
        """How the model's own forward on ``tokens`` calls blocks ``0..stop`` (hidden states
        included, bound to parameter names), stopped before block ``stop`` runs."""
        calls: list = []

        def before(layer):
            def hook(module, args, kwargs):
                calls.append(self._bind(args, kwargs))
                if layer == stop:
                    raise _StopBeforeBlock

            return hook

        with module_hooks([(block, before(i)) for i, block in enumerate(self.blocks[: stop + 1])]):
            try:
                self.model(tokens, return_type="logits")
            except _StopBeforeBlock:
                pass
        if len(calls) != stop + 1:
            raise AnalysisError(f"the model's forward did not call its blocks 0..{stop} in order")
        return calls

    def _bind(self, args: tuple, kwargs: dict) -> dict:
        bound = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        for name, parameter in self._signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in bound:
                bound.update(bound.pop(name))
        if "hidden_states" not in bound:  # the first parameter is the hidden state, whatever its name
            first = next(iter(self._signature.parameters))
            bound["hidden_states"] = bound.pop(first)
        return bound

    # --- resuming -------------------------------------------------------------------------------

    def resume(
        self,
        base: BaseRun,
        layer: int,
        hidden: torch.Tensor,
        start: int,
        edits: Sequence[tuple[str, Callable]] = (),
        n_stack: int = 1,
        n_last: Optional[int] = None,
        local: bool = False,
    ) -> torch.Tensor:
        """Final-position logits ``[n_stack * B, V]`` of patched runs entering block ``layer``.

        ``hidden [n_stack * B, T - start, d]`` is the input of block ``layer`` at positions
        ``start:`` for each stacked run (row ``c * B + b`` is run ``c`` of base prompt ``b``);
        ``edits`` are ``(hook name, fn)`` pairs applied while the blocks run. ``layer ==
        n_layers`` means ``hidden`` is the final residual stream. With ``n_last=k`` the logits are
        ``[n_stack * B, k, V]`` at the last ``k`` positions (which must lie at ``start`` or later).

        ``local=True`` says the edits change block ``layer``'s output at position ``start`` alone
        (they act there, after its keys and values: head outputs, attention output, MLP): the
        block then runs on that position only (``hidden [n_stack * B, 1, d]``) and the base run
        gives the positions after it.
        """
        T = base.tokens.shape[1]
        if hidden.shape[1] != (1 if local else T - start):
            raise AnalysisError(f"hidden covers {hidden.shape[1]} positions; resuming at {start} needs "
                                f"{1 if local else T - start}")
        check_n_last(n_last, T - start, start)
        if start > 0 and not self.reuses_prefix:
            raise AnalysisError("this model's blocks do not reuse keys and values; resume from position 0")
        prefix = None
        if start > 0 and base.kv is not None:
            # the base run's own rows: each stacked run's attention reads them without a tiled copy
            prefix = {i: tuple(x[..., :start, :] for x in base.kv[i]) for i in range(layer, self.n_layers)}
        cache = _PrefixCache(prefix)
        last, n_read = self.n_layers - 1, n_last or 1
        # only the read positions leave the last block: the others need only their keys and values there
        read_only = self.reuses_prefix and base.kv is not None and T - start > n_read
        read_only = read_only and not _edits_block(edits, last) and not (local and layer == last)
        with self._cache_reaches_attention(cache), hook_points(self.model, edits):
            hidden = self._run(base, layer, hidden, start, cache, n_stack, n_read, read_only, local)
        return self.read_logits(hidden, n_last)

    def resume_last(
        self, base: BaseRun, hidden: torch.Tensor, start: int, at: torch.Tensor, n_stack: int = 1,
        n_last: Optional[int] = None,
    ) -> torch.Tensor:
        """Logits (as :meth:`resume`) of runs whose last block's input is the base run's but at one
        position per row.

        ``hidden [n_stack * B, T - start, d]`` is the last block's input at positions ``start:``,
        equal to the base run's except at position ``at[r]`` of row ``r`` (``at [n_stack * B]``).
        The last block then needs only those positions' keys and values, whatever the position of
        each row, and its read positions: many rows patched at different positions run together.
        """
        T, last, n_read = base.tokens.shape[1], self.n_layers - 1, n_last or 1
        if base.kv is None or not self.reuses_prefix:
            raise AnalysisError("this model's blocks do not reuse keys and values; use resume()")
        keys, values = (x[..., : T - n_read, :].repeat(n_stack, 1, 1, 1) for x in base.kv[last])
        early = torch.nonzero(at < T - n_read)[:, 0]
        if len(early):  # the changed positions before the read ones: their keys and values only
            positions = at[early]
            new_keys, new_values = self._keys_values_at(last, hidden[early, positions - start][:, None], positions,
                                                        early % base.tokens.shape[0], base)
            keys[early, :, positions], values[early, :, positions] = new_keys[:, :, 0], new_values[:, :, 0]
        cache = _PrefixCache({last: (keys, values)})
        with self._cache_reaches_attention(cache):
            hidden = self._run(base, last, hidden[:, T - n_read - start :], T - n_read, cache, n_stack, n_read)
        return self.read_logits(hidden, n_last)

    def resume_split(
        self, base: BaseRun, layer: int, first: torch.Tensor, rest: torch.Tensor, start: int, split: tuple[int, int],
        edits: Sequence[tuple[str, Callable, Callable]] = (), n_stack: int = 1, n_last: Optional[int] = None,
    ) -> torch.Tensor:
        """:meth:`resume` of runs whose rows repeat the same prompts up to position ``P``.

        ``split = (P, B1)``: row ``f * B1 + b`` of the base prompts equals row ``b`` before
        position ``P`` (prompts with different teacher-forced answers appended, say), and so do the
        stacked runs' inputs and patches. Positions ``start:P`` then run on the ``B1`` distinct
        rows alone (``first [n_stack * B1, P - start, d]``) and positions ``P:`` on every row
        (``rest [n_stack * B, T - P, d]``), block by block, each row attending over its distinct
        row's keys and values. ``edits`` are ``(hook name, fn for the first part, fn for the
        rest)``. Logits as :meth:`resume`.
        """
        T, B, last, n_read = base.tokens.shape[1], base.tokens.shape[0], self.n_layers - 1, n_last or 1
        P, B1 = split
        check_n_last(n_last, T - P, P)
        if base.kv is None or not self.reuses_prefix or B % B1 or not start < P <= T - n_read or layer > last:
            raise AnalysisError(f"cannot split runs of {B} rows at position {P} into {B1} distinct rows from "
                                f"position {start} (keys and values must be reused, {start} < P <= {T - n_read})")
        head = base.rows(slice(0, B1))
        head_kv = head.kv or {}
        rows = torch.arange(n_stack * B, device=first.device)
        gather = (rows // B) * B1 + rows % B1  # each stacked row's distinct row
        part = [1]

        def dispatch(first_fn, rest_fn):
            return lambda activation, hook=None: (first_fn if part[0] == 1 else rest_fn)(activation, hook)

        cache = _PrefixCache()
        hooks = [(name, dispatch(first_fn, rest_fn)) for name, first_fn, rest_fn in edits]
        with self._cache_reaches_attention(cache), hook_points(self.model, hooks):
            for i in range(layer, self.n_layers):
                part[0], cache.record = 1, True
                if start:
                    cache.prefix[i] = tuple(x[..., :start, :] for x in head_kv[i])
                kwargs = {key: self._slice(key, value, start, n_stack, head, cache, P) for key, value in
                          head.calls[i].items()}
                if i == last:  # the distinct rows' last block: only its keys and values are read
                    self._keys_values_only(i, first, kwargs, cache)
                else:
                    out = self.blocks[i](first, **kwargs)
                    first = out[0] if isinstance(out, tuple) else out
                keys, values = cache.kv.pop(i)
                part[0], cache.record = 2, False
                cache.prefix[i] = (keys[gather], values[gather])
                at = P
                if i == last and T - P > n_read:  # the last block: the read positions only
                    self._keep_keys_values(i, rest[:, : rest.shape[1] - n_read], P, n_stack, base, cache)
                    rest, at = rest[:, rest.shape[1] - n_read :], T - n_read
                kwargs = {key: self._slice(key, value, at, n_stack, base, cache, T) for key, value in
                          base.calls[i].items()}
                out = self.blocks[i](rest, **kwargs)
                rest = out[0] if isinstance(out, tuple) else out
        return self.read_logits(rest, n_last)

    def _keys_values_at(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, base: BaseRun
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``layer``'s keys and values ``[E, kv_heads, 1, d_head]`` of ``hidden [E, 1, d]``,
        row ``e`` sitting at ``positions[e]`` of base prompt ``rows[e]``; the block stops as soon as
        its attention has them."""
        B = base.tokens.shape[0]
        cache = _PrefixCache()
        kwargs = {}
        for key, value in base.calls[layer].items():
            if _is_cache(value):
                value = cache
            elif key == "attention_mask" or key == "cache_position":
                value = None  # read only after the keys and values, which is never reached here
            else:
                value = _take(value, key, rows, positions, B)
            kwargs[key] = value
        with self._cache_reaches_attention(cache):
            self._keys_values_only(layer, hidden, kwargs, cache)
        return cache.prefix[layer]

    def _run(
        self, base: BaseRun, layer: int, hidden: torch.Tensor, start: int, cache: _PrefixCache, n_stack: int = 1,
        n_read: int = 1, read_only: bool = False, local: bool = False, inputs: Optional[list] = None,
    ) -> torch.Tensor:
        """Blocks ``layer…`` on ``hidden`` (positions ``start:``, or ``start`` alone with ``local``;
        see :meth:`resume`): the final residual stream from ``start`` on, or with ``read_only`` of
        the last ``n_read`` positions only (none: the last block only adds its keys and values to
        ``cache``). ``inputs`` collects each block's input."""
        T, last = base.tokens.shape[1], self.n_layers - 1
        for i in range(layer, self.n_layers):
            if inputs is not None:
                inputs.append(hidden)
            if i == last and read_only:
                self._keep_keys_values(i, hidden[:, : hidden.shape[1] - n_read], start, n_stack, base, cache)
                hidden, start = hidden[:, hidden.shape[1] - n_read :], T - n_read
                if not n_read:
                    break
            end = start + hidden.shape[1]
            calls = base.calls[i].items()
            kwargs = {key: self._slice(key, value, start, n_stack, base, cache, end) for key, value in calls}
            out = self.blocks[i](hidden, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            if local and i == layer:  # the block's other positions are the base run's
                hidden = _stacked_cat([hidden, base.resid[i + 1][:, start + 1 :]], 1)
        return hidden

    def _keep_keys_values(
        self, layer: int, hidden: torch.Tensor, start: int, n_stack: int, base: BaseRun, cache: _PrefixCache
    ) -> None:
        """Append block ``layer``'s keys and values of ``hidden`` (positions ``start:``) to its prefix
        in ``cache``."""
        end = start + hidden.shape[1]
        calls = base.calls[layer].items()
        kwargs = {key: self._slice(key, value, start, n_stack, base, cache, end) for key, value in calls}
        self._keys_values_only(layer, hidden, kwargs, cache)

    def _keys_values_only(self, layer: int, hidden: torch.Tensor, kwargs: dict, cache: _PrefixCache) -> None:
        """Call block ``layer``, stopping it as soon as its attention hands ``cache`` its keys and
        values (which become that layer's prefix there)."""
        cache.keep_only = layer
        try:
            self.blocks[layer](hidden, **kwargs)
        except _KeysValuesKept:
            return
        finally:
            cache.keep_only = None
        raise AnalysisError(f"block {layer} ran without asking its cache for keys and values")

    @contextlib.contextmanager
    def _cache_reaches_attention(self, cache: _PrefixCache):
        """Hand ``cache`` to every attention module that is called without one.

        Blocks pass their cache on under different names (``cache``, ``layer_past``,
        ``past_key_values``) and not every attention reads the name its block uses, so the
        attention modules themselves get it as ``past_key_values``; TransformerLens-native
        attention reads it through :mod:`arithinterp.engine.native`.
        """

        def hook(module, args, kwargs):
            if kwargs.get("past_key_values") is None and kwargs.get("layer_past") is None:
                kwargs["past_key_values"] = cache
            return args, kwargs

        # TransformerLens's attention bridges read the cache as past_key_values / layer_past only
        attentions = [block.attn for block in self.blocks if hasattr(getattr(block, "attn", None), "_update_kv_cache")]
        native = native_attention_cache(self.blocks) if self.reuses_prefix else contextlib.nullcontext()
        with module_hooks([(attention, hook) for attention in attentions]), native:
            yield

    def read_logits(self, resid: torch.Tensor, n_last: Optional[int] = None) -> torch.Tensor:
        """Logits of the read positions of a final residual stream ``[B, S, d]``: ``[B, V]`` at the
        final position, or ``[B, n_last, V]`` at the last ``n_last``."""
        return self.unembed(resid[:, -1:])[:, 0] if n_last is None else self.unembed(resid[:, -n_last:])

    def unembed(self, resid: torch.Tensor) -> torch.Tensor:
        """Logits of final-residual vectors ``[..., T, d]`` (the final norm, then the unembedding)."""
        logits = self.model.unembed(self.final_norm(resid))
        if self.logit_cap is not None:  # Gemma 2's final soft-capping
            logits = self.logit_cap * torch.tanh(logits / self.logit_cap)
        return logits

    @staticmethod
    def _slice(
        key: str, value: Any, start: int, n_stack: int, base: BaseRun, cache: _PrefixCache, end: Optional[int] = None
    ) -> Any:
        """A recorded call argument for the stacked runs at positions ``start:end``."""
        if _is_cache(value):
            return cache
        if isinstance(value, tuple):
            return tuple(Stepper._slice(key, v, start, n_stack, base, cache, end) for v in value)
        if not isinstance(value, torch.Tensor):
            return value
        B, T = base.tokens.shape
        end = T if end is None else end
        if key == "attention_mask":  # keys are positions :end; a 2-D mask is a key-padding mask
            value = value.narrow(-1, 0, end)
            if value.ndim == 4:  # [B, 1, queries, keys]
                value = value.narrow(-2, start, end - start)
        elif (start or end < T) and key in _POSITION_AXIS:
            value = value.narrow(_POSITION_AXIS[key], start, end - start)
        if value.ndim and value.shape[0] == B and n_stack > 1:
            value = value.repeat(n_stack, *[1] * (value.ndim - 1))
        return value

    # --- greedy continuation --------------------------------------------------------------------

    def greedy(self, tokens: torch.Tensor, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedily continue ``tokens [B, T]`` (same-length, unpadded prompts) by ``n_new`` tokens:
        ``(generated [B, n_new], logits [B, n_new, V])``, the logits each token was the argmax of.

        The prompt runs once (:meth:`base`, keys and values kept); each later token runs the blocks
        at its own position only, attending over every earlier position's keys and values. Block
        call arguments (positions, masks, rotary tables) come from one row of the longest fed
        sequence, as for prompts that share a prefix: the same for every row of unpadded prompts.
        """
        if not self.reuses_prefix:
            raise AnalysisError("this model's blocks do not reuse keys and values; decode with whole forwards")
        run = self.base(tokens, read_only=True)  # the last block's other positions: keys and values only
        logits = [run.logits]
        if n_new > 1:
            longest = torch.cat([tokens[:1], tokens[:1, -1:].expand(1, n_new - 1)], dim=1)
            calls = self._calls_until(longest, self.n_layers - 1)
            for call in calls:
                call.pop("hidden_states")
            kv, fed = dict(run.kv or {}), tokens
            for _ in range(n_new - 1):
                fed = torch.cat([fed, logits[-1].argmax(-1)[:, None]], dim=1)
                at = fed.shape[1] - 1
                hidden = self._calls_until(fed, 0)[0]["hidden_states"][:, at:]  # block 0's input there
                cache = _PrefixCache(kv, record=True)
                with self._cache_reaches_attention(cache):
                    final = self._run(BaseRun(fed, [], calls, None, torch.empty(0)), 0, hidden, at, cache)
                kv = cache.kv
                logits.append(self.read_logits(final))
        stacked = torch.stack(logits, 1)
        return stacked.argmax(-1), stacked

    # --- the one-time check ---------------------------------------------------------------------

    @torch.inference_mode()
    def check(self, tokens: torch.Tensor) -> tuple[bool, str]:
        """Whether resuming reproduces the model's logits on a few prompts; a status for the meta.

        The reference is the model's own forward: the base run itself may go through the engine's
        native key/value cache, which is then under test too.
        """
        sample = tokens[:4]
        T = sample.shape[1]
        with unembed_last(self.model, 1):
            reference = self.model(sample, return_type="logits")[:, -1]
        scale = max(1.0, float(reference.abs().max()))
        base = self.base(sample)
        start = T // 2 if (self.reuses_prefix and T > 1 and all(c is not None for c in base.calls)) else 0
        if start and any(self._unknown_position_argument(call, T) for call in base.calls):
            self.reuses_prefix, start = False, 0
        layer = self.n_layers // 2

        def error_of(base: BaseRun, start: int) -> float:
            runs = [base.logits, self.resume(base, layer, base.resid[layer][:, start:], start)]
            if start:  # the patched block at one position only; the last block entered at one position per row
                runs.append(self.resume(base, layer, base.resid[layer][:, start : start + 1], start, local=True))
                at = torch.arange(len(sample), device=sample.device) % (T - start) + start
                runs.append(self.resume_last(base, base.resid[-2][:, start:], start, at))
            if self.reuses_prefix:  # a base run whose last block runs the final position only
                runs.append(self.base(sample, read_only=True).logits)
            return max(float((logits - reference).abs().max()) for logits in runs)

        try:
            error = error_of(base, start)
            if error > _CHECK_TOLERANCE * scale and start:  # try without keys/values (nor the native cache)
                self.reuses_prefix = False
                error = error_of(self.base(sample), 0)
        except Exception as why:  # a family the stepping does not cover: say so, never guess
            return False, f"blocks cannot be stepped ({type(why).__name__}: {why})"
        if error > _CHECK_TOLERANCE * scale:
            return False, f"stepping the blocks differs from the model's logits by {error:.2e}"
        if self.reuses_prefix and T > 1:  # prompts sharing a prefix compute it once, where that is exact too
            try:
                shared = self._shared_base(sample, (), None, *_split_at(sample, 1))
                runs = [shared.logits, self.resume(shared, layer, shared.resid[layer][:, start:], start)]
                self.shares_prefixes = max(float((x - reference).abs().max()) for x in runs) <= _CHECK_TOLERANCE * scale
            except Exception:  # noqa: BLE001 - sharing is an optimisation: without it every number is the same
                self.shares_prefixes = False
        reuse = "keys/values reused" if self.reuses_prefix else "every position recomputed"
        return True, f"stepped blocks ({reuse}; max logit error {error:.1e})"

    @staticmethod
    def _unknown_position_argument(call: dict, T: int) -> bool:
        for key, value in call.items():
            tensors = value if isinstance(value, tuple) else (value,)
            for t in tensors:
                if isinstance(t, torch.Tensor) and key not in _POSITION_AXIS and T in t.shape[1:]:
                    return True
        return False


def _prefix_order(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of ``tokens [B, T]`` in lexicographic order: for each pair of neighbours
    the first position where they differ ``[R - 1]``, and each row's place in that order ``[B]``.
    Rows sharing their first ``k`` tokens are neighbours, so ``1 + (first < k).sum()`` prefixes
    of length ``k`` are distinct."""
    distinct, inverse = torch.unique(tokens, dim=0, return_inverse=True)
    differs = distinct[1:] != distinct[:-1]
    return differs.int().argmax(1), inverse  # distinct rows differ somewhere


def _split_at(tokens: torch.Tensor, k: int, order: Optional[tuple] = None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(k, representatives, inverse)``: one row of ``tokens`` per distinct prefix ``[:k]``, and
    each row's prefix as an index into them (``order``: :func:`_prefix_order` of ``tokens``)."""
    first, rows = order if order is not None else _prefix_order(tokens)
    group = torch.cat([first.new_zeros(1), (first < k).long().cumsum(0)])  # prefix of each distinct row
    inverse = group[rows]
    representatives = torch.empty(int(group[-1]) + 1, dtype=torch.long, device=tokens.device)
    representatives[inverse] = torch.arange(len(tokens), device=tokens.device)
    return k, representatives, inverse


def unread_as_nan(read: torch.Tensor, T: int, dim: int = 1) -> torch.Tensor:
    """An activation computed at the last positions only (``read``, along ``dim``) widened to
    ``T`` positions, NaN at the others, so that nothing can read them unnoticed."""
    shape = list(read.shape)
    shape[dim] = T - read.shape[dim]
    return torch.cat([read.new_full(shape, float("nan")), read], dim)


def _joined(name: str, early: torch.Tensor, late: torch.Tensor, T: int) -> torch.Tensor:
    """An activation read in two passes, positions ``:k`` (``early``) then ``k:`` (``late``), put
    back together: along dim 1, or for attention patterns ``[B, H, query, key]`` along the query
    axis, the early queries' missing keys (all later, so masked) given weight 0."""
    if name.endswith(("hook_pattern", "hook_attn_scores")):
        fill = 0.0 if name.endswith("hook_pattern") else float("-inf")
        early = torch.nn.functional.pad(early, (0, T - early.shape[-1]), value=fill)
        return torch.cat([early, late], 2)
    return torch.cat([early, late], 1)


def _take(value: Any, key: str, rows: torch.Tensor, positions: torch.Tensor, B: int) -> Any:
    """A recorded call argument for rows ``rows`` of the base prompts at one position each."""
    if isinstance(value, tuple):
        return tuple(_take(v, key, rows, positions, B) for v in value)
    if not isinstance(value, torch.Tensor) or not value.ndim:
        return value
    if key in _POSITION_AXIS:
        axis = _POSITION_AXIS[key] % value.ndim
        value = value.expand(B, *value.shape[1:]) if value.shape[0] == 1 else value
        value = value[rows].movedim(axis, 1)
        value = value[torch.arange(len(rows), device=value.device), positions.to(value.device)][:, None]
        return value.movedim(1, axis)
    return value[rows] if value.shape[0] == B else value


def _edits_block(edits: Sequence[tuple[str, Callable]], layer: int) -> bool:
    """Whether an edit may act inside block ``layer`` (a hook outside the blocks counts)."""
    for name, _ in edits:
        match = re.match(r"blocks\.(\d+)\.", name)
        if match is None or int(match.group(1)) == layer:
            return True
    return False


def check_n_last(n_last: Optional[int], width: int, start: int = 0) -> None:
    """``n_last`` (positions whose logits are returned) must be None or 1..``width`` positions computed."""
    if n_last is None:
        return
    if isinstance(n_last, bool) or not isinstance(n_last, int) or not 1 <= n_last <= width:
        where = f" from position {start} on" if start else ""
        raise AnalysisError(
            f"n_last must be None (the final position) or 1..{width} (the positions computed{where}), got {n_last!r}"
        )


# model -> (parameter fingerprint, {length class: (checked stepper or None, status)}); weak keys, so a
# model is freed with its steppers
_STEPPERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fingerprint(model) -> tuple:
    """Changes whenever a parameter is replaced or modified in place."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def model_fingerprint(model) -> tuple:
    """Changes whenever one of the model's parameters is replaced or modified in place: a key
    for results computed from the model (its stepper, its answers)."""
    return _fingerprint(model)


ENGINES = ("auto", "stepped", "hooks")  # the engine choices of stepper_for, which analyses pass on


def stepper_for(
    model: HookedModel, tokens: torch.Tensor, engine: str = "auto", warn: bool = True
) -> tuple[Optional[Stepper], str]:
    """The model's :class:`Stepper` when stepping reproduces its logits, else ``None``, with a status.

    ``engine="hooks"`` asks for whole forwards; ``"stepped"`` refuses to fall back; ``warn=False``
    falls back without a warning (a caller with a path of its own). A model without blocks to step
    falls back too. The check runs once per model and prompt-length class (:func:`length_class`),
    and again after the model's parameters change.
    """
    if engine == "hooks":
        return None, "hooks: requested"
    stepper, status = _checked_stepper(model, tokens)
    if stepper is None:
        if not warn and engine == "auto":
            return None, f"hooks: {status}"
        if engine == "stepped":
            raise AnalysisError(f"this model cannot be stepped block by block ({status}); use engine='hooks' or 'auto'")
        import warnings

        warnings.warn(f"patching falls back to whole forwards: {status}", RuntimeWarning, stacklevel=3)
        return None, f"hooks: {status}"
    return stepper, status


def length_class(model: HookedModel, length: int) -> tuple:
    """Prompt lengths the one-time check treats alike: those in one power-of-two range, on the
    same side of every attention window the model's config names. Whether stepping is exact can
    depend on the length (a sliding window masks differently past its width, a block may take a
    length-dependent argument the engine does not know), so a length checked once does not vouch
    for one many times longer."""
    cfg = getattr(model, "cfg", None)
    windows = sorted({w for w in (getattr(cfg, name, None) for name in ("window_size", "sliding_window"))
                      if isinstance(w, int) and not isinstance(w, bool) and w > 0})
    return (int(length).bit_length(), tuple(length > w for w in windows))


def _checked_stepper(model: HookedModel, tokens: torch.Tensor) -> tuple[Optional[Stepper], str]:
    """The checked stepper (or None) and status for ``tokens``' length class, from the cache."""
    fingerprint = _fingerprint(model)
    known = _STEPPERS.get(model)
    if known is None or known[0] != fingerprint:
        known = (fingerprint, {})
        try:
            _STEPPERS[model] = known
        except TypeError:  # not weak-referenceable: checked again next time
            pass
    by_length = known[1]
    key = length_class(model, int(tokens.shape[-1]))
    if key not in by_length:
        by_length[key] = _new_stepper(model, tokens)
    return by_length[key]


def _new_stepper(model: HookedModel, tokens: torch.Tensor) -> tuple[Optional[Stepper], str]:
    """A new stepper for ``model`` checked on ``tokens`` (None where the check fails), and its status."""
    try:
        stepper = Stepper(model)
    except AnalysisError as why:  # no blocks to step: whole forwards still work through the hooks
        return None, str(why)
    except Exception as why:  # noqa: BLE001 - reported, never swallowed silently
        return None, f"blocks cannot be stepped ({type(why).__name__}: {why})"
    try:
        with torch.inference_mode():
            ok, status = stepper.check(tokens)
    except AnalysisError:  # the model itself is broken (non-finite logits): no engine would help
        raise
    except Exception as why:  # noqa: BLE001 - reported, never swallowed silently
        ok, status = False, f"blocks cannot be stepped ({type(why).__name__}: {why})"
    return (stepper if ok else None), status


@torch.inference_mode()
def read_last(
    model: HookedModel, tokens: torch.Tensor, names: Sequence[str], n_last: int, only_if_shared: bool = True
) -> Optional[dict]:
    """Activations ``names`` (hook names inside the blocks, position on dim 1) at the last
    ``n_last`` positions of ``tokens [B, T]``, ``{name: [B, n_last, ...]}``, from a stepped base run
    that computes the first tokens the rows share once (:meth:`Stepper.base` with ``read_only``).

    ``None`` when the model's blocks cannot be stepped that way or (``only_if_shared``) when these
    rows share no prefix worth a fifth of their positions: the caller then runs whole forwards.
    """
    check_n_last(n_last, int(tokens.shape[1]))
    try:
        stepper, _ = stepper_for(model, tokens, warn=False)
    except AnalysisError:  # no blocks to step
        return None
    if stepper is None or not (stepper.reuses_prefix and stepper.shares_prefixes):
        return None
    if only_if_shared and stepper._shared_prefix(tokens, n_last) is None:
        return None
    # reads only: nothing is unembedded
    run = stepper.base(tokens, read=names, n_last=n_last, read_only=True, with_logits=False)
    return {name: run.acts[name][:, -n_last:] for name in names}
