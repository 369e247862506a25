"""Stacked activation patches: many patch cells of one site and layer in one resumed run.

A *cell* patches one site at one layer, at one position per pair (or every position) and for one
head or neuron (or all of them), with the source run's value. :class:`PatchRunner` holds a base
run and a source run of the same prompts and returns the final-position logits of a stack of cells
``[C, B, V]`` (or, with ``n_last=k``, those of the last ``k`` positions ``[C, B, k, V]``: teacher-forced
answer tokens appended to the prompts are scored there), resuming the model at the patched layer and earliest
patched position
(:mod:`arithinterp.engine.stepping`), or running whole forwards where the model cannot be stepped.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from arithinterp import sites as site_lib
from arithinterp.engine.hooks import forward_with_hooks
from arithinterp.engine.base_run import BaseRun
from arithinterp.engine.stepping import Stepper, check_n_last, unread_as_nan
from arithinterp.errors import AnalysisError, SiteError

UNIT_SITES = {"attn_z": "head", "pattern": "head", "mlp_pre": "neuron", "mlp_post": "neuron"}
RESIDUAL_SITES = ("resid_pre", "resid_mid", "resid_post")  # everything downstream depends on them alone
# sites whose patch at one position changes their block's output at that position alone
LOCAL_SITES = ("resid_mid", "attn_out", "mlp_out", "attn_z", "mlp_pre", "mlp_post")
# sites whose patched runs may compute repeated prompts' shared positions once (PatchRunner.split)
SPLIT_SITES = ("resid_pre", "resid_post", "attn_out", "mlp_out", "attn_z", "mlp_pre", "mlp_post")
UNCHANGED, SOURCE, RUN = 0, 1, 2  # what patching a cell does to a pair (see PatchRunner.cell_states)


def patch_mask(
    site: str, shape: tuple, start: int, pos: Optional[torch.Tensor], unit: Optional[torch.Tensor]
) -> torch.Tensor:
    """Boolean mask over a stacked activation for the patched cells.

    Args:
        site: The patched site.
        shape: The stacked activation's shape: ``[cell, batch, pos, ...]``; attention patterns
            ``[cell, batch, head, pos, key]`` (query positions on dim 3); ``attn_z``
            ``[cell, batch, pos, head, d_head]``. ``pos`` counts positions from ``start`` on.
        start: The absolute position of the activation's first position.
        pos (Int[Tensor, "cell batch"] | None): Each row's patched position; ``None``: every position.
        unit (Int[Tensor, "cell"] | None): Each cell's head or neuron; ``None``: all of them.

    Returns:
        Bool[Tensor, "cell batch ..."]: True where the source value is written; broadcastable to ``shape``.
    """
    C, B = shape[0], shape[1]
    if site == "pattern":
        n_pos, n_unit = shape[3], shape[2]
    else:
        n_pos = shape[2]
        n_unit = shape[3] if site in UNIT_SITES else 1
    device = pos.device if pos is not None else None
    if pos is None:
        pos_mask = torch.ones(C, B, n_pos, dtype=torch.bool, device=device)
    else:
        pos_mask = torch.arange(start, start + n_pos, device=device)[None, None, :] == pos[:, :, None]
    if unit is None:
        unit_mask = torch.ones(C, n_unit, dtype=torch.bool, device=device)
    else:
        unit_mask = torch.arange(n_unit, device=unit.device)[None, :] == unit[:, None]
    if site == "pattern":
        return (pos_mask[:, :, None, :] & unit_mask[:, None, :, None])[..., None]
    if site == "attn_z":
        return (pos_mask[:, :, :, None] & unit_mask[:, None, None, :])[..., None]
    if site in UNIT_SITES:
        return pos_mask[:, :, :, None] & unit_mask[:, None, None, :]
    return pos_mask[..., None]


def per_unit(site: str, values: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Values shaped like an activation ``[B, T, ...]`` (patterns ``[B, H, Tq, Tk]``) reduced to
    ``[B, T, units]``: heads for ``attn_z`` / ``pattern``, neurons for ``mlp_*``, one unit for the
    residual and output sites. ``reduce`` is ``torch.any`` or ``torch.sum`` (taking ``(x, dim)``)."""
    if site == "pattern":
        return reduce(values, -1).transpose(1, 2)
    if site == "attn_z":
        return reduce(values, -1)
    if site in UNIT_SITES:
        return values
    return reduce(values, -1)[..., None]


def _position_dim(site: str) -> int:
    return 2 if site == "pattern" else 1


class PatchRunner:
    """Base and source runs of one group of equal-length prompts, and patched runs between them.

    ``base_logits`` / ``source_logits`` are the unpatched final-position logits ``[batch, vocab]``,
    or with ``n_last=k`` the logits of the last ``k`` positions ``[batch, k, vocab]``;
    :meth:`patched` returns the same positions for each cell.

    Args:
        model: The hooked model.
        stepper: The model's :class:`Stepper`, or ``None`` to run whole forwards with a hook.
        site: The patched site.
        base_tokens (Int[Tensor, "batch pos"]): The prompts patched into.
        source_tokens (Int[Tensor, "batch pos"]): The prompts whose activations are patched in.
        n_last: Score the last ``n_last`` positions (teacher-forced answer tokens) instead of the final one.
        columns (Int[Tensor, "V"] | None): The vocabulary entries every logits tensor holds, in
            that order (the few tokens a logit-difference metric reads); ``None``: the whole
            vocabulary.

    Raises:
        SiteError: ``resid_mid`` on a model with parallel attention and MLP blocks.
    """

    def __init__(self, model: Any, stepper: Optional[Stepper], site: str, base_tokens: torch.Tensor,
                 source_tokens: torch.Tensor, n_last: Optional[int] = None,
                 columns: Optional[torch.Tensor] = None):
        check_n_last(n_last, int(base_tokens.shape[1]))
        self.model, self.stepper, self.site = model, stepper, site
        self.tokens = base_tokens
        self.n_last, self.columns = n_last, columns
        # [B, T]: the base and source prompts agree on every token up to and including this position.
        # Attention is causal, so every activation there is the same in both runs whatever the model
        # computes: a patch there changes nothing, provably, without comparing activations (which
        # whole forwards of different batches need not reproduce bit for bit)
        self.shared = (base_tokens == source_tokens).int().cumprod(1).bool()
        self.n_layers = site_lib.n_layers(model)
        if site == "resid_mid" and getattr(model.cfg, "parallel_attn_mlp", False):
            raise SiteError("'resid_mid' does not exist in parallel attention/MLP blocks; patch attn_out or mlp_out")
        names = [self._read_name(layer) for layer in range(self.n_layers)]
        extra = (
            [site_lib.hook_name("resid_pre", layer) for layer in range(self.n_layers)] if site == "resid_mid" else []
        )
        if stepper is not None:  # the stepper records the residual stream before each block itself
            reads = [] if site == "resid_pre" else names
            both = stepper.base(torch.cat([base_tokens, source_tokens]), read=reads, n_last=n_last, read_only=True,
                                columns=columns)
            B = base_tokens.shape[0]
            self.base, self.source = both.rows(slice(0, B)), both.rows(slice(B, 2 * B))
            self.base_logits, self.source_logits = self.base.logits, self.source.logits
            self.base_acts = [self._stepped_activation(self.base, layer) for layer in range(self.n_layers)]
            self.source_acts = [self._stepped_activation(self.source, layer) for layer in range(self.n_layers)]
            self.base_resid_pre = self.base.resid[: self.n_layers] if extra else []
            self.split = repeated_rows(base_tokens, source_tokens, n_last) if stepper.reuses_prefix else None
        else:
            self.base, self.source = None, None
            self.base_logits, base_acts = _cached_run(model, base_tokens, names + extra, n_last, columns)
            self.source_logits, source_acts = _cached_run(model, source_tokens, names, n_last, columns)
            self.base_acts = [self._shaped(base_acts[name]) for name in names]
            self.source_acts = [self._shaped(source_acts[name]) for name in names]
            self.base_resid_pre = [base_acts[name] for name in extra]
            self.split = None

    def _read_name(self, layer: int) -> str:
        return site_lib.hook_name(self.site, layer)

    def _shaped(self, activation: torch.Tensor) -> torch.Tensor:
        """Split heads of a flat ``attn_z`` ``[B, T, H * d_head]`` (bridges fire it flat)."""
        if self.site == "attn_z" and activation.ndim == 3:
            return activation.unflatten(-1, (self.model.cfg.n_heads, -1))
        return activation

    def _stepped_activation(self, run: BaseRun, layer: int) -> torch.Tensor:
        """The site's activation in a stepped base run, ``[B, T, ...]`` (patterns ``[B, H, T, T]``).

        The last block of a stepped base run computes its read positions only; its activations
        are NaN at the others, which no cell reads (patches there leave the logits as they are).
        """
        if self.site == "resid_pre":
            return run.resid[layer]
        activation = self._shaped(run.acts[self._read_name(layer)])
        return unread_as_nan(activation, run.tokens.shape[1], _position_dim(self.site))

    def _on_device(self, index: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if index is None else index.to(self.base_logits.device)

    @property
    def reuses_prefix(self) -> bool:
        """Whether patched runs resume from the base run's keys and values."""
        return self.stepper is not None and self.stepper.reuses_prefix

    def grouping(self, layer: int) -> str:
        """How cells patched at ``layer`` may share a stacked run: ``"one"`` position per run (a
        patch that runs its block at that position alone), ``"near"`` positions (the run starts
        at the earliest), ``"any"`` (positions do not matter: whole forwards, or the last block
        entered with one changed position per row), given the positions each cell patches.

        Args:
            layer: The patched layer.

        Returns:
            ``"one"``, ``"near"`` or ``"any"``.
        """
        if not self.reuses_prefix:
            return "any"
        if self.site in LOCAL_SITES:
            return "one"
        if self.site in ("resid_pre", "resid_post") and layer + (self.site == "resid_post") == self.n_layers - 1:
            return "any"
        return "near"

    def cell_states(self, layer: int, pos: Optional[torch.Tensor], unit: Optional[torch.Tensor]) -> torch.Tensor:
        """What each cell's patch does to each pair, ``[C, B]``: ``UNCHANGED`` (the source activation
        equals the base one where it is patched, or the two prompts agree on every token up to
        there: the patched run is the base run, on both engines), ``SOURCE`` (a
        residual-stream site that then equals the source run's at every position: everything
        downstream, the logits included, is the source run's) or ``RUN``.

        Args:
            layer: The patched layer.
            pos (Int[Tensor, "cell batch"] | None): Each row's patched position; ``None``: every position.
            unit (Int[Tensor, "cell"] | None): Each cell's head or neuron; ``None``: all of them.

        Returns:
            Int[Tensor, "cell batch"]: The state of each cell and pair (on the CPU).
        """
        site = self.site
        C = pos.shape[0] if pos is not None else len(unit) if unit is not None else 1
        pos, unit = self._on_device(pos), self._on_device(unit)
        if self.stepper is None:  # whole forwards: every cell is run unless its positions are all shared
            per = (~self.shared)[None].expand(C, -1, -1)
            if layer == self.n_layers - 1 and self.site != "resid_pre":
                per = self._read_only(per)
        else:
            per = self._changed(layer, unit).expand(C, -1, -1)
        if pos is None:  # every position patched
            patched, elsewhere = per.any(-1), torch.zeros(per.shape[:2], dtype=torch.bool, device=per.device)
        else:
            patched = per.gather(2, pos[:, :, None])[..., 0]
            elsewhere = per.sum(-1) > patched.long()
        states = torch.where(patched, RUN, UNCHANGED)
        if site in RESIDUAL_SITES:
            states = torch.where(patched & ~elsewhere, SOURCE, states)
        return states.cpu()

    def _changed(self, layer: int, unit: Optional[torch.Tensor]) -> torch.Tensor:
        """Where patching the cells' units (``unit [C]``, None: all) at ``layer`` can change the
        logits ``[C or 1, B, T]``: where the source activation differs from the base one, except in
        the prompts' shared prefix and, inside the last block, at positions that are not read."""
        per = per_unit(self.site, self.source_acts[layer] != self.base_acts[layer], torch.any)  # [B, T, units]
        per = per.any(-1)[None] if unit is None else per[:, :, unit].permute(2, 0, 1)
        per = per & ~self.shared.to(per.device)[None]  # a shared prefix is the same run, bit for bit or not
        if layer == self.n_layers - 1 and self.site != "resid_pre":
            per = self._read_only(per)
        return per

    def _read_only(self, per: torch.Tensor) -> torch.Tensor:
        """``per [C, B, T]`` with the positions that are not read set False: inside the last block a
        position's activation reaches only that position's output, and only the final position (the
        last ``n_last``) is read, so patches anywhere else leave the logits as they are."""
        per = per.clone()
        per[:, :, : -(self.n_last or 1)] = False
        return per

    def first_changed(self, layer: int, unit: Optional[torch.Tensor]) -> torch.Tensor:
        """For cells that patch every position: the earliest position ``[C]`` at which any pair's
        patch changes anything (``T`` where none does). Before it the source activation equals
        the base one, so the patched run starts there, reusing the base run's earlier keys and
        values, exactly as a cell patched at that position does.

        Args:
            layer: The patched layer.
            unit (Int[Tensor, "cell"] | None): Each cell's head or neuron; ``None``: all of them.

        Returns:
            Int[Tensor, "cell"]: The earliest changed position (on the CPU); 0 without keys and
            values reused.

        Raises:
            AnalysisError: ``layer`` is out of range.
        """
        C = len(unit) if unit is not None else 1
        T = int(self.tokens.shape[1])
        if not self.reuses_prefix:
            return torch.zeros(C, dtype=torch.long)
        changed = self._changed(self._check_layer(layer), self._on_device(unit)).any(1).expand(C, -1)  # [C, T]
        first = torch.where(changed.any(1), changed.int().argmax(1), T)
        return first.cpu()

    def _check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.n_layers:
            raise AnalysisError(f"layer {layer} is out of range; accepted: 0..{self.n_layers - 1}")
        return layer

    def patched(self, layer: int, pos: Optional[torch.Tensor], unit: Optional[torch.Tensor]) -> torch.Tensor:
        """The base run's logits with each cell's patch applied.

        Args:
            layer: The patched layer.
            pos (Int[Tensor, "cell batch"] | None): Each row's patched position; ``None``: every position.
            unit (Int[Tensor, "cell"] | None): Each cell's head or neuron; ``None``: all of them.

        Returns:
            Float[Tensor, "cell batch vocab"]: Final-position logits (``[cell, batch, k, vocab]`` at
            the last ``k`` positions when the runner was made with ``n_last=k``).
        """
        site = self.site
        B = self.tokens.shape[0]
        C = len(pos) if pos is not None else len(unit) if unit is not None else 1
        if pos is None:  # every position patched: the run starts where the first patch changes anything
            # (at the first read position at the latest: the run computes every position it reads)
            start = min(int(self.first_changed(layer, unit).min()), int(self.tokens.shape[1]) - (self.n_last or 1))
        else:
            start = int(pos.min()) if self.reuses_prefix else 0
        pos, unit = self._on_device(pos), self._on_device(unit)
        # one patched position in every row: the patched block runs there alone
        local = site in LOCAL_SITES and pos is not None and self.reuses_prefix and bool((pos == start).all())
        dim = _position_dim(site)
        width = 1 if local else self.base_acts[layer].shape[dim] - start
        base = self.base_acts[layer].narrow(dim, start, width)
        source = self.source_acts[layer].narrow(dim, start, width)
        if site == "resid_mid":  # reached through attn_out: resid_mid = resid_pre + attn_out
            resid_pre = self.base_resid_pre[layer].narrow(1, start, width)
            base, source = base - resid_pre, source - resid_pre
        patch = self._patch_fn(base, source, C, start, pos, unit)

        if self.stepper is None or self.base is None:  # a stepper always comes with its base run
            name = site_lib.hook_name("attn_out" if site == "resid_mid" else site, layer)
            logits = forward_with_hooks(self.model, self.tokens.repeat(C, 1), [(name, patch)], return_type="logits",
                                        last=self.n_last or 1)
            logits = logits[:, -1] if self.n_last is None else logits[:, -self.n_last:]
            logits = logits if self.columns is None else logits[..., self.columns.to(logits.device)]
            return logits.reshape(C, B, *logits.shape[1:])
        stepper = self.stepper
        entry = layer + (site == "resid_post")
        if self._splits(site, entry, start, local, pos):
            logits = self._patched_split(layer, entry, start, base, source, patch, pos, unit, C)
        elif site in ("resid_pre", "resid_post"):
            hidden = patch(base[None].expand(C, *base.shape)).flatten(0, 1)
            if entry == self.n_layers:
                logits = stepper.read_logits(hidden, self.n_last, self.columns)
            elif entry == self.n_layers - 1 and pos is not None and self.reuses_prefix:
                logits = stepper.resume_last(self.base, hidden, start, pos.flatten(), n_stack=C, n_last=self.n_last,
                                             columns=self.columns)
            else:
                logits = stepper.resume(self.base, entry, hidden, start, n_stack=C, n_last=self.n_last,
                                        columns=self.columns)
        else:
            name = site_lib.hook_name("attn_out" if site == "resid_mid" else site, layer)
            hidden = self.base.resid[layer][:, start : start + width].repeat(C, 1, 1)
            logits = stepper.resume(self.base, layer, hidden, start, edits=[(name, patch)], n_stack=C,
                                    n_last=self.n_last, local=local, columns=self.columns)
        return logits.reshape(C, B, *logits.shape[1:])

    def _splits(self, site: str, entry: int, start: int, local: bool, pos: Optional[torch.Tensor]) -> bool:
        """Whether a stack of cells runs through :meth:`_patched_split`: the rows repeat prompts
        from before ``start`` on, every repeat is patched at the same position, and the run is
        not a one-position block or the last block entered through the residual stream."""
        if self.split is None or local or site not in SPLIT_SITES or start >= self.split[0]:
            return False
        if site in RESIDUAL_SITES and entry >= self.n_layers - 1:
            return False
        B1 = self.split[1]
        return pos is None or bool((pos.reshape(pos.shape[0], -1, B1) == pos[:, None, :B1]).all())

    def _patch_fn(self, base: torch.Tensor, source: torch.Tensor, C: int, start: int, pos: Optional[torch.Tensor],
                  unit: Optional[torch.Tensor]) -> Callable:
        """The hook writing the source activation into the patched cells of ``base`` (``[B, S, ...]``
        from position ``start``: the stacked activation's rows and positions)."""
        mask = patch_mask(self.site, (C, *base.shape), start, pos, unit)

        def patch(activation, hook=None):
            stacked = activation.reshape(C, *base.shape)
            return torch.where(mask, source[None].to(stacked.dtype), stacked).reshape(activation.shape)

        return patch

    def _patched_split(self, layer: int, entry: int, start: int, base: torch.Tensor, source: torch.Tensor,
                       patch: Callable, pos: Optional[torch.Tensor], unit: Optional[torch.Tensor],
                       C: int) -> torch.Tensor:
        """:meth:`patched` through :meth:`Stepper.resume_split`: rows that repeat a prompt (with
        different answers fed after it) compute the positions before ``P`` once per prompt."""
        assert self.stepper is not None and self.base is not None and self.split is not None
        P, B1 = self.split
        cut = P - start
        first_pos = None if pos is None else pos[:, :B1]
        if self.site in RESIDUAL_SITES:  # the patched residual stream is the input of block ``entry``
            hidden = patch(base[None].expand(C, *base.shape)).reshape(C, *base.shape)
            first = hidden[:, :B1, :cut].flatten(0, 1)
            rest = hidden[:, :, cut:].flatten(0, 1)
            edits = []
        else:
            first = self.base.resid[layer][:B1, start:P].repeat(C, 1, 1)
            rest = self.base.resid[layer][:, P:].repeat(C, 1, 1)
            name = site_lib.hook_name(self.site, layer)
            first_fn = self._patch_fn(base[:B1, :cut], source[:B1, :cut], C, start, first_pos, unit)
            rest_fn = self._patch_fn(base[:, cut:], source[:, cut:], C, P, pos, unit)
            edits = [(name, first_fn, rest_fn)]
        return self.stepper.resume_split(self.base, entry, first, rest, start, (P, B1), edits, n_stack=C,
                                         n_last=self.n_last, columns=self.columns)


def repeated_rows(base_tokens: torch.Tensor, source_tokens: torch.Tensor,
                  n_last: Optional[int]) -> Optional[tuple[int, int]]:
    """``(P, B1)`` when the rows of both token sets are ``F > 1`` copies of their first ``B1`` rows
    up to position ``P`` (prompts with different answers fed after them), capped at the first read
    position: the split with the largest ``P`` (a patched run starts late in the prompts, so only
    the positions just before ``P`` are saved; a few-shot prefix every row shares comes earlier),
    or None when the rows repeat nothing."""
    N, T = base_tokens.shape
    best, saved = None, (0, 0)
    for F in range(2, N + 1):
        if N % F:
            continue
        B1 = N // F
        same = torch.ones(T, dtype=torch.bool, device=base_tokens.device)
        for tokens in (base_tokens, source_tokens):
            same &= (tokens.view(F, B1, T) == tokens[None, :B1]).all(1).all(0)
        P = min(int(same.int().argmin()) if not bool(same.all()) else T, T - (n_last or 1))
        if P > 0 and (P, (F - 1) * B1) > saved:  # the most positions repeated, then the most rows
            best, saved = (P, B1), (P, (F - 1) * B1)
    return best


def _cached_run(
    model: Any, tokens: torch.Tensor, names: list, n_last: Optional[int] = None,
    columns: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict]:
    """Final-position logits ``[B, V]`` (the last ``n_last`` positions' ``[B, n_last, V]``; at
    ``columns`` alone when given) and the named activations of one whole forward."""
    cache: dict = {}

    def keep(name):
        def hook(activation, hook=None):
            cache[name] = activation

        return hook

    logits = forward_with_hooks(model, tokens, [(name, keep(name)) for name in names], return_type="logits",
                                last=n_last or 1)
    logits = logits[:, -1] if n_last is None else logits[:, -n_last:]
    logits = logits if columns is None else logits[..., columns.to(logits.device)]
    if not torch.isfinite(logits).all():
        raise AnalysisError(
            "the model's logits on the base prompts are not finite (NaN or inf): its weights or activations are broken"
        )
    return logits, {name: cache[name] for name in names}
