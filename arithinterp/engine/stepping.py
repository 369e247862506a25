# Over 500 lines on purpose: the Stepper's operations (base runs, the three resumes, greedy decoding, the
# exactness check) are one class sharing its recorded calls; what they stand on lives in block_runner,
# base_run, prefix_cache, shared_prefixes and steppers.
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

from typing import Callable, Optional, Sequence

import torch

from arithinterp.engine.base_run import BaseRun, edits_block, slice_call, unknown_position_argument
from arithinterp.engine.block_runner import BlockRunner, StopBeforeBlock
from arithinterp.engine.hooks import hook_points, module_hooks, unembed_last
from arithinterp.engine.prefix_cache import PrefixCache, cache_reaches_attention, is_cache
from arithinterp.engine.shared_prefixes import joined, shared_prefix, split_at
from arithinterp.errors import AnalysisError

_CHECK_TOLERANCE = 1e-4  # relative to the logits' scale


class Stepper(BlockRunner):
    """Runs a model's blocks from any layer and position (see the module docstring).

    Args:
        model: The hooked model, held weakly (it has ``blocks`` and ``unembed``).

    Raises:
        AnalysisError: the model has no ``blocks`` and ``unembed``.
    """

    # --- base run -------------------------------------------------------------------------------

    def base(
        self, tokens: torch.Tensor, read: Sequence[str] = (), n_last: Optional[int] = None, read_only: bool = False,
        with_logits: bool = True, columns: Optional[torch.Tensor] = None,
    ) -> BaseRun:
        """Run ``tokens [B, T]`` through the model, recording what resuming needs and ``read``.

        The run's logits are ``[B, V]`` at the final position, or ``[B, n_last, V]`` at the last
        ``n_last`` positions (teacher-forced answers, one position per answer token). With
        ``read_only`` (on a model whose keys and values are reused) the last block runs only
        those positions, as in :meth:`resume`: activations read inside it cover them alone, and
        ``resid[n_layers]`` is NaN at the other positions. ``with_logits=False`` (with ``read_only``):
        only the reads are wanted, and the run's logits are left empty (nothing is unembedded).

        Args:
            tokens: Same-length prompts [B, T].
            read: Hook names whose activations are kept in ``acts``.
            n_last: Logits at the last ``n_last`` positions; ``None``: the final one.
            read_only: The last block runs the read positions only.
            with_logits: Unembed the read positions.
            columns: The vocabulary entries to compute (:meth:`unembed`); ``None``: all.

        Returns:
            The run: block inputs, call arguments, keys and values, logits and reads.

        Raises:
            AnalysisError: ``n_last`` is out of range, or the logits are not finite.
        """
        check_n_last(n_last, int(tokens.shape[1]))
        model = self.model
        T, n_read, last = int(tokens.shape[1]), n_last or 1, self.n_layers - 1
        cut = read_only and self.reuses_prefix and T > n_read
        split = shared_prefix(tokens, n_read) if cut and self.shares_prefixes else None
        if split is not None:
            return self._checked(self._shared_base(tokens, read, n_last, *split, with_logits=with_logits,
                                                   columns=columns))
        resid: list = [None] * (self.n_layers + 1)
        calls: list = [None] * self.n_layers
        cache = PrefixCache(record=True)
        acts: dict = {}

        def before(layer):
            def hook(module, args, kwargs):
                bound = self._bind(args, kwargs)
                resid[layer] = bound.pop("hidden_states")
                for key, value in list(bound.items()):
                    if is_cache(value):
                        bound[key] = cache
                calls[layer] = bound
                if cut and layer == last:
                    raise StopBeforeBlock
                return (resid[layer],), bound

            return hook

        def after_last(module, args, output):
            resid[self.n_layers] = output[0] if isinstance(output, tuple) else output

        def keep(name):
            def hook(activation, hook):
                acts[name] = activation  # under the name asked for (a hook's own name may be the aliased one)

            return hook

        pre = [(block, before(i)) for i, block in enumerate(self.blocks)]
        reads = [(name, keep(name)) for name in read]
        with cache_reaches_attention(self.blocks, cache, self.reuses_prefix), hook_points(model, reads):
            try:
                with module_hooks(pre, post=[(self.blocks[-1], after_last)]), unembed_last(model, n_read):
                    logits = model(tokens, return_type="logits")  # the read positions' alone
                logits = logits[:, -1] if n_last is None else logits[:, -n_last:]
                if columns is not None:  # as the resumed runs compute them, to the last bit
                    logits = self.read_logits(resid[self.n_layers], n_last, columns)
            except StopBeforeBlock:  # the last block, the read positions only
                run = BaseRun(tokens, resid, calls, None, torch.empty(0), acts)
                final = self._run(run, last, resid[last], 0, cache, n_read=n_read, read_only=True)
                resid[self.n_layers] = unread_as_nan(final, T)
                logits = self.read_logits(final, n_last, columns) if with_logits else torch.empty(0)
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

    def _shared_base(
        self, tokens: torch.Tensor, read: Sequence[str], n_last: Optional[int], k: int,
        representatives: torch.Tensor, inverse: torch.Tensor, with_logits: bool = True,
        columns: Optional[torch.Tensor] = None,
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

        prefix_cache, prefix_inputs, inputs = PrefixCache(record=True), [], []
        with hook_points(self.model, [(name, keep(name)) for name in read]):
            passes.append({})  # the distinct prefixes
            with cache_reaches_attention(self.blocks, prefix_cache, self.reuses_prefix):
                prefix_run = run.rows(representatives)
                self._run(prefix_run, 0, embedded[representatives, :k], 0, prefix_cache, n_read=0, read_only=True,
                          inputs=prefix_inputs)
            passes.append({})  # every prompt's positions k:
            kv = {i: (keys[inverse], values[inverse]) for i, (keys, values) in prefix_cache.kv.items()}
            cache = PrefixCache(kv, record=True)
            with cache_reaches_attention(self.blocks, cache, self.reuses_prefix):
                final = self._run(run, 0, embedded[:, k:], k, cache, n_read=n_read, read_only=T - k > n_read,
                                  inputs=inputs)
        resid = [torch.cat([early[inverse], late], 1) for early, late in zip(prefix_inputs, inputs)]
        resid.append(unread_as_nan(final, T))
        prefix_acts, acts = passes
        for name in prefix_acts.keys() & acts.keys():
            acts[name] = joined(name, prefix_acts[name][inverse], acts[name], T)
        return BaseRun(tokens, resid, run.calls, dict(cache.kv), self.read_logits(final, n_last, columns) if with_logits
                       else torch.empty(0), acts)

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
        columns: Optional[torch.Tensor] = None,
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

        Args:
            base: The base run.
            layer: The block entered.
            hidden: Its input at positions ``start:`` (or ``start`` alone with ``local``).
            start: The first position computed.
            edits: ``(hook name, fn)`` pairs applied while the blocks run.
            n_stack: Stacked runs per base prompt.
            n_last: Logits at the last ``n_last`` positions; ``None``: the final one.
            local: The edits act at position ``start`` of block ``layer`` alone.
            columns: The vocabulary entries to compute (:meth:`unembed`); ``None``: all.

        Returns:
            The logits, ``[n_stack * B, V]`` (or ``[n_stack * B, n_last, V]``; ``V = len(columns)``).

        Raises:
            AnalysisError: ``hidden`` covers the wrong positions, ``n_last`` is out of range, or
                ``start > 0`` on a model whose keys and values are not reused.
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
        cache = PrefixCache(prefix)
        last, n_read = self.n_layers - 1, n_last or 1
        # only the read positions leave the last block: the others need only their keys and values there
        read_only = self.reuses_prefix and base.kv is not None and T - start > n_read
        read_only = read_only and not edits_block(edits, last) and not (local and layer == last)
        with cache_reaches_attention(self.blocks, cache, self.reuses_prefix), hook_points(self.model, edits):
            hidden = self._run(base, layer, hidden, start, cache, n_stack, n_read, read_only, local)
        return self.read_logits(hidden, n_last, columns)

    def resume_last(
        self, base: BaseRun, hidden: torch.Tensor, start: int, at: torch.Tensor, n_stack: int = 1,
        n_last: Optional[int] = None, columns: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits (as :meth:`resume`) of runs whose last block's input is the base run's but at one
        position per row.

        ``hidden [n_stack * B, T - start, d]`` is the last block's input at positions ``start:``,
        equal to the base run's except at position ``at[r]`` of row ``r`` (``at [n_stack * B]``).
        The last block then needs only those positions' keys and values, whatever the position of
        each row, and its read positions: many rows patched at different positions run together.

        Args:
            base: The base run.
            hidden: The last block's input at positions ``start:`` [n_stack * B, T - start, d].
            start: The first position of ``hidden``.
            at: The changed position of each row, long [n_stack * B].
            n_stack: Stacked runs per base prompt.
            n_last: Logits at the last ``n_last`` positions; ``None``: the final one.
            columns: The vocabulary entries to compute (:meth:`unembed`); ``None``: all.

        Returns:
            The logits, as :meth:`resume`.

        Raises:
            AnalysisError: the model's keys and values are not reused.
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
        cache = PrefixCache({last: (keys, values)})
        with cache_reaches_attention(self.blocks, cache, self.reuses_prefix):
            hidden = self._run(base, last, hidden[:, T - n_read - start :], T - n_read, cache, n_stack, n_read)
        return self.read_logits(hidden, n_last, columns)

    def resume_split(
        self, base: BaseRun, layer: int, first: torch.Tensor, rest: torch.Tensor, start: int, split: tuple[int, int],
        edits: Sequence[tuple[str, Callable, Callable]] = (), n_stack: int = 1, n_last: Optional[int] = None,
        columns: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """:meth:`resume` of runs whose rows repeat the same prompts up to position ``P``.

        ``split = (P, B1)``: row ``f * B1 + b`` of the base prompts equals row ``b`` before
        position ``P`` (prompts with different teacher-forced answers appended, say), and so do the
        stacked runs' inputs and patches. Positions ``start:P`` then run on the ``B1`` distinct
        rows alone (``first [n_stack * B1, P - start, d]``) and positions ``P:`` on every row
        (``rest [n_stack * B, T - P, d]``), block by block, each row attending over its distinct
        row's keys and values.

        Args:
            base: The base run (``B`` rows).
            layer: The block entered.
            first: The distinct rows' input at positions ``start:P`` [n_stack * B1, P - start, d].
            rest: Every row's input at positions ``P:`` [n_stack * B, T - P, d].
            start: The first position computed.
            split: ``(P, B1)``.
            edits: ``(hook name, fn for the first part, fn for the rest)``.
            n_stack: Stacked runs per base prompt.
            n_last: Logits at the last ``n_last`` positions; ``None``: the final one.
            columns: The vocabulary entries to compute (:meth:`unembed`); ``None``: all.

        Returns:
            The logits, as :meth:`resume`.

        Raises:
            AnalysisError: the runs cannot be split there (keys and values not reused, ``B`` not
                a multiple of ``B1``, ``P`` out of range).
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

        cache = PrefixCache()
        hooks = [(name, dispatch(first_fn, rest_fn)) for name, first_fn, rest_fn in edits]
        with cache_reaches_attention(self.blocks, cache, self.reuses_prefix), hook_points(self.model, hooks):
            for i in range(layer, self.n_layers):
                part[0], cache.record = 1, True
                if start:
                    cache.prefix[i] = tuple(x[..., :start, :] for x in head_kv[i])
                kwargs = {key: slice_call(key, value, start, n_stack, head, cache, P) for key, value in
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
                kwargs = {key: slice_call(key, value, at, n_stack, base, cache, T) for key, value in
                          base.calls[i].items()}
                out = self.blocks[i](rest, **kwargs)
                rest = out[0] if isinstance(out, tuple) else out
        return self.read_logits(rest, n_last, columns)

    def read_logits(self, resid: torch.Tensor, n_last: Optional[int] = None,
                    columns: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits of the read positions of a final residual stream.

        Args:
            resid: The final residual stream [B, S, d].
            n_last: The last ``n_last`` positions; ``None``: the final one.
            columns: The vocabulary entries to compute (:meth:`unembed`); ``None``: all.

        Returns:
            ``[B, V]`` at the final position, or ``[B, n_last, V]``.
        """
        if n_last is None:
            return self.unembed(resid[:, -1:], columns)[:, 0]
        return self.unembed(resid[:, -n_last:], columns)

    def unembed(self, resid: torch.Tensor, columns: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits of final-residual vectors (the final norm, the unembedding, any soft-capping).

        ``columns`` computes only those vocabulary entries, in that order: a metric that reads a
        few answer tokens' logits (a logit difference) needs no more, and on a big vocabulary the
        whole unembedding is most of a patched run (Gemma 3: 262,144 × 640 weights read per call,
        whatever the number of rows).

        Args:
            resid: Final-residual vectors [..., T, d].
            columns (Int[Tensor, "V"] | None): Token ids; ``None``: the whole vocabulary.

        Returns:
            The logits [..., T, V].
        """
        normed = self.final_norm(resid)
        if columns is None:
            logits = self.model.unembed(normed)
        else:
            logits = self._column_logits(normed, columns.to(normed.device))
        if self.logit_cap is not None:  # Gemma 2's final soft-capping
            logits = self.logit_cap * torch.tanh(logits / self.logit_cap)
        return logits

    def _column_logits(self, normed: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """``normed @ W_U[:, columns] + b_U[columns]``: the unembedding's own weights at those
        columns (``W_U [d, vocab]`` is the transposed ``[vocab, d]``, so a column is a row read).
        Checked once per model against its unembedding module (a model that scales its logits
        there is read through the module instead, and the columns picked from all of them)."""
        if self.columns_exact is False:
            return self.model.unembed(normed)[..., columns]
        model = self.model
        logits = normed @ model.W_U[:, columns].to(normed.dtype) + model.b_U[columns].to(normed.dtype)
        if self.columns_exact is None:
            full = model.unembed(normed)[..., columns]
            scale = float(full.detach().abs().max()) if full.numel() else 0.0
            self.columns_exact = bool(((logits - full).abs() <= _CHECK_TOLERANCE * max(scale, 1.0)).all())
            return logits if self.columns_exact else full
        return logits

    # --- greedy continuation --------------------------------------------------------------------

    def greedy(self, tokens: torch.Tensor, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedily continue ``tokens [B, T]`` (same-length, unpadded prompts) by ``n_new`` tokens:
        ``(generated [B, n_new], logits [B, n_new, V])``, the logits each token was the argmax of.

        The prompt runs once (:meth:`base`, keys and values kept); each later token runs the blocks
        at its own position only, attending over every earlier position's keys and values. Block
        call arguments (positions, masks, rotary tables) come from one row of the longest fed
        sequence, as for prompts that share a prefix: the same for every row of unpadded prompts.

        Args:
            tokens: Same-length, unpadded prompts [B, T].
            n_new: How many tokens to generate.

        Returns:
            ``(generated [B, n_new], logits [B, n_new, V])``.

        Raises:
            AnalysisError: the model's keys and values are not reused.
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
                cache = PrefixCache(kv, record=True)
                with cache_reaches_attention(self.blocks, cache, self.reuses_prefix):
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
        native key/value cache, which is then under test too. Settles ``reuses_prefix`` and
        ``shares_prefixes``.

        Args:
            tokens: Prompts [B, T]; the first four are run.

        Returns:
            ``(exact, status)``: whether stepping reproduces the logits, and why in words.

        Raises:
            AnalysisError: the model's own logits are not finite.
        """
        sample = tokens[:4]
        T = sample.shape[1]
        with unembed_last(self.model, 1):
            reference = self.model(sample, return_type="logits")[:, -1]
        scale = max(1.0, float(reference.abs().max()))
        base = self.base(sample)
        start = T // 2 if (self.reuses_prefix and T > 1 and all(c is not None for c in base.calls)) else 0
        if start and any(unknown_position_argument(call, T) for call in base.calls):
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
                shared = self._shared_base(sample, (), None, *split_at(sample, 1))
                runs = [shared.logits, self.resume(shared, layer, shared.resid[layer][:, start:], start)]
                self.shares_prefixes = max(float((x - reference).abs().max()) for x in runs) <= _CHECK_TOLERANCE * scale
            except Exception:  # noqa: BLE001 - sharing is an optimisation: without it every number is the same
                self.shares_prefixes = False
        reuse = "keys/values reused" if self.reuses_prefix else "every position recomputed"
        return True, f"stepped blocks ({reuse}; max logit error {error:.1e})"

def unread_as_nan(read: torch.Tensor, T: int, dim: int = 1) -> torch.Tensor:
    """An activation computed at the last positions only, widened to ``T`` positions, NaN at the
    others, so that nothing can read them unnoticed.

    Args:
        read: The activation at the last positions (along ``dim``).
        T: The positions wanted.
        dim: The position axis.

    Returns:
        The activation with ``T`` positions along ``dim``.
    """
    shape = list(read.shape)
    shape[dim] = T - read.shape[dim]
    return torch.cat([read.new_full(shape, float("nan")), read], dim)


def check_n_last(n_last: Optional[int], width: int, start: int = 0) -> None:
    """``n_last`` (positions whose logits are returned) must be None or 1..``width`` positions computed.

    Args:
        n_last: The value to check.
        width: How many positions are computed.
        start: The first position computed (for the message).

    Raises:
        AnalysisError: ``n_last`` is not None or an int in 1..``width``.
    """
    if n_last is None:
        return
    if isinstance(n_last, bool) or not isinstance(n_last, int) or not 1 <= n_last <= width:
        where = f" from position {start} on" if start else ""
        raise AnalysisError(
            f"n_last must be None (the final position) or 1..{width} (the positions computed{where}), got {n_last!r}"
        )
