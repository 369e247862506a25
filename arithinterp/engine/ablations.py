"""Stacked ablations: many ablation cells of one batch of prompts in a few resumed runs.

A *cell* sets some activations to given values (zero, a mean, another prompt's) at one position
per prompt, in one or more layers: a head at the position that predicts an answer digit
(:func:`arithinterp.patching.digit_ablation`), one MLP neuron at the final position
(:func:`arithinterp.neurons.importance` with ``"mean-ablation"``), a heuristic's neurons
(:func:`arithinterp.neurons.ablate_heuristic`). A cell's run equals the base run before its first
ablated layer and before its first ablated position, so :class:`AblationRunner` runs the base
prompts once (:meth:`arithinterp.engine.Stepper.base`), groups the cells by that layer and position
and resumes each group as one stack from there, the base run's keys and values of the earlier
positions reused (:meth:`arithinterp.engine.Stepper.resume`). The ablated block runs at the ablated
position alone when every ablation in it sits there. Without a stepper each stack is one whole
forward of the prompts repeated, with the same edits as hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from arithinterp import sites as site_lib
from arithinterp.engine.hooks import forward_with_hooks
from arithinterp.engine.stepping import Stepper, check_n_last
from arithinterp.errors import AnalysisError, SiteError, accepted

ABLATION_SITES = ("attn_z", "mlp_pre", "mlp_post", "attn_out", "mlp_out")  # their edit at a position stays there
_UNIT_SITES = ("attn_z", "mlp_pre", "mlp_post")
DEFAULT_STACK_BYTES = 2**26  # memory one stacked run may take by default (larger stacks ran no faster)


@dataclass(frozen=True)
class Ablation:
    """Set ``site`` of block ``layer`` at one position per prompt.

    Attributes:
        site: One of :data:`ABLATION_SITES` (``attn_z``, ``mlp_pre``, ``mlp_post``, ``attn_out``, ``mlp_out``).
        layer: The block.
        positions (int | Int[Tensor, "batch"]): One position for every prompt, or one per prompt
            (the tokens' frame).
        units (Int[Tensor, "k"] | Bool[Tensor, "batch n_units"] | None): ``None`` (the whole
            activation there), unit indices (heads of ``attn_z``, neurons of ``mlp_*``; the same for
            every prompt) or a per-prompt mask.
        value (Float[Tensor, "n_units ..."] | None): ``None`` (zero), one position's activation
            (``attn_z`` ``[n_heads, d_head]``, ``mlp_post`` ``[d_mlp]``, ``attn_out`` ``[d_model]``) or
            one per prompt ``[batch, n_units, ...]``; only the chosen units are read.
    """

    site: str
    layer: int
    positions: Union[int, torch.Tensor]
    units: Optional[torch.Tensor] = None
    value: Optional[torch.Tensor] = None


class _Entries:
    """The (row, position, unit, value) writes of one site and layer in one stack of cells."""

    def __init__(self) -> None:
        self.rows: list = []
        self.positions: list = []
        self.units: list = []  # unit indices, or None for the whole activation
        self.values: list = []

    def add(self, rows, positions, units, values) -> None:
        self.rows.append(rows)
        self.positions.append(positions)
        self.units.append(units)
        self.values.append(values)

    def tensors(self):
        whole = self.units[0] is None
        return (torch.cat(self.rows), torch.cat(self.positions), None if whole else torch.cat(self.units),
                torch.cat(self.values))


class AblationRunner:
    """A base run of some prompts and ablated runs of it, stacked.

    Args:
        model: The hooked model.
        stepper: The model's :class:`Stepper` (from :func:`arithinterp.engine.stepper_for`), or
            ``None`` for whole forwards.
        tokens (Int[Tensor, "batch pos"]): Same-length prompts.
        n_last: The positions whose logits the base run reads (``None``: the final one).
        read: Hook names (position on dim 1) whose base-run activations at those positions are kept.

    Attributes:
        base_logits (Float[Tensor, "batch vocab"]): The base run's logits (``[batch, n_last, vocab]``
            with ``n_last``).
        read (dict[str, Tensor]): ``{name: [batch, n_last or 1, ...]}``, the base run's activations.

    Raises:
        SiteError: A read never fired.
        AnalysisError: The base run's logits are not finite.
    """

    def __init__(self, model: Any, stepper: Optional[Stepper], tokens: torch.Tensor, n_last: Optional[int] = None,
                 read: Sequence[str] = ()):
        check_n_last(n_last, int(tokens.shape[1]))
        self.model, self.stepper, self.tokens, self.n_last = model, stepper, tokens, n_last
        self.n_layers = site_lib.n_layers(model)
        cfg = model.cfg
        self._unit_shapes = {"attn_z": (int(cfg.n_heads), int(cfg.d_head)), "mlp_pre": (int(cfg.d_mlp or 0),),
                             "mlp_post": (int(cfg.d_mlp or 0),), "attn_out": (int(cfg.d_model),),
                             "mlp_out": (int(cfg.d_model),)}
        n_read = n_last or 1
        with torch.inference_mode():
            if stepper is not None:
                self.base = stepper.base(tokens, read=read, n_last=n_last, read_only=True)
                self.base_logits, acts = self.base.logits, self.base.acts
            else:
                self.base, acts = None, {}

                def keep(name):
                    def hook(activation, hook=None):
                        acts[name] = activation

                    return hook

                logits = forward_with_hooks(model, tokens, [(name, keep(name)) for name in read], return_type="logits",
                                            last=n_read)
                self.base_logits = logits[:, -1] if n_last is None else logits[:, -n_last:]
        missing = [name for name in read if name not in acts]
        if missing:
            raise SiteError(f"these reads never fired (not computed by this model): {missing}")
        # the last block of a stepped base run computes its read positions only: reads cover those
        self.read = {name: acts[name][:, acts[name].shape[1] - n_read :] for name in read}
        if not torch.isfinite(self.base_logits).all():
            raise AnalysisError("the model's logits on the base prompts are not finite (NaN or inf)")

    # --- input ----------------------------------------------------------------------------------

    def _checked(self, ablation: Ablation) -> tuple:
        """``(site, layer, rows [n], positions [n], units [n] or None, values [n, ...])`` of one
        ablation's writes, validated."""
        if not isinstance(ablation, Ablation):
            raise AnalysisError(f"cells must be sequences of engine Ablation objects, got {type(ablation).__name__}")
        site = ablation.site
        if site not in ABLATION_SITES:
            raise SiteError(f"cannot ablate {site!r} in stacked runs; accepted: {accepted(ABLATION_SITES)}")
        layer = site_lib.check_layers(self.model, site, [ablation.layer])[0]
        B, T = self.tokens.shape
        positions = ablation.positions
        if isinstance(positions, torch.Tensor):
            if positions.shape != (B,) or positions.is_floating_point() or positions.dtype == torch.bool:
                raise SiteError(f"an ablation's positions must be one int or a long tensor [{B}], got "
                                f"{positions.dtype} {tuple(positions.shape)}")
            positions = positions.long().cpu()
        else:
            positions = torch.full((B,), int(positions), dtype=torch.long)
        if len(positions) and not (0 <= int(positions.min()) and int(positions.max()) < T):
            raise SiteError(f"ablation positions {int(positions.min())}..{int(positions.max())} fall outside "
                            f"prompts of {T} tokens; accepted: 0..{T - 1}")
        shape = self._unit_shapes[site]
        rows = torch.arange(B)
        units = ablation.units
        if units is None:
            unit_index = None
        elif site not in _UNIT_SITES:
            raise SiteError(f"units (heads or neurons) apply to {accepted(_UNIT_SITES)}, not {site!r}")
        elif units.dtype == torch.bool:
            if units.shape != (B, shape[0]):
                raise SiteError(f"a unit mask must be [{B}, {shape[0]}], got {tuple(units.shape)}")
            rows, unit_index = torch.nonzero(units.cpu(), as_tuple=True)
            positions = positions[rows]
        else:
            unit_index = torch.as_tensor(units).long().flatten().cpu()
            if len(unit_index) and not (0 <= int(unit_index.min()) and int(unit_index.max()) < shape[0]):
                raise SiteError(f"{site} units must be in 0..{shape[0] - 1}, got {unit_index.tolist()}")
            k = len(unit_index)
            rows, positions = rows.repeat_interleave(k), positions.repeat_interleave(k)
            unit_index = unit_index.repeat(B)
        value = ablation.value
        if value is None:
            width = shape if unit_index is None else shape[1:]
            values = torch.zeros(len(rows), *width)
        else:
            value = value.detach().cpu().float()
            if value.shape == shape:
                value = value[None].expand(B, *shape)
            if value.shape != (B, *shape):
                raise SiteError(f"an ablation value of {site} must be {list(shape)} or {[B, *shape]}, got "
                                f"{list(value.shape)}")
            values = value[rows] if unit_index is None else value[rows, unit_index]
        return site, layer, rows, positions, unit_index, values

    # --- running --------------------------------------------------------------------------------

    def run(
        self, cells: Sequence[Sequence[Ablation]], n_last: Optional[int] = None,
        score: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, max_memory: Optional[float] = None,
    ) -> torch.Tensor:
        """The logits of each cell's ablated run, or a score of them, computed chunk by chunk.

        Args:
            cells: One sequence of :class:`Ablation` s per cell, applied together; a cell with no
                ablation is the base run.
            n_last: Score the last ``n_last`` positions (at most the runner's own ``n_last``).
            score: ``f(logits [c, batch, ...]) -> [c, batch, ...]``, applied per chunk, so that the
                ``[cell, batch, vocab]`` logits are never held at once.
            max_memory: Bytes one stacked run may take (default 64 MiB).

        Returns:
            Float[Tensor, "cell batch vocab"]: The logits (``[cell, batch, n_last, vocab]`` with
            ``n_last``), or what ``score`` returns, stacked over cells.

        Raises:
            SiteError: An ablation at an unsupported site, or positions, units or values out of shape.
            AnalysisError: A cell holds something other than Ablations, or ``n_last`` exceeds what
                the base run read.
        """
        T = int(self.tokens.shape[1])
        check_n_last(n_last, T)
        n_read = n_last or 1
        if n_read > (self.n_last or 1):  # the base run's final residual stream covers its own read positions only
            raise AnalysisError(f"the base run read the last {self.n_last or 1} positions; n_last={n_last} needs a "
                                f"runner made with n_last >= {n_last}")
        parsed = [[self._checked(a) for a in cell] for cell in cells]
        groups: dict[tuple, list[int]] = {}
        for c, cell in enumerate(parsed):
            entries = [e for e in cell if len(e[2])]
            if not entries:  # nothing ablated: the base run
                groups.setdefault((self.n_layers, T - n_read), []).append(c)
                continue
            layer = min(e[1] for e in entries)
            start = min(int(e[3].min()) for e in entries)
            if self.stepper is None or not self.stepper.reuses_prefix:
                start = 0
            groups.setdefault((layer, min(start, T - n_read)), []).append(c)
        out: Optional[torch.Tensor] = None
        budget = DEFAULT_STACK_BYTES if max_memory is None else float(max_memory)
        for (layer, start), members in groups.items():
            per_row = self._row_bytes(layer, start, n_read)
            chunk = max(1, int(budget // (per_row * len(self.tokens))))
            for i in range(0, len(members), chunk):
                part = members[i : i + chunk]
                with torch.inference_mode():
                    logits = self._stack([parsed[c] for c in part], layer, start, n_last)
                    values = score(logits) if score is not None else logits
                if out is None:
                    out = values.new_empty(len(cells), *values.shape[1:])
                out[torch.tensor(part, device=out.device)] = values
        if out is None:
            raise AnalysisError("no cells to run")
        return out

    def _row_bytes(self, layer: int, start: int, n_read: int) -> float:
        """Rough float32 bytes of one stacked row: the reused keys and values, the positions run, the logits."""
        cfg = self.model.cfg
        T = int(self.tokens.shape[1])
        kv_heads = int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
        kv = 2 * max(0, self.n_layers - layer) * kv_heads * int(cfg.d_head) * T
        width = T - start
        forward = width * (12 * int(cfg.d_model) + 4 * int(cfg.d_mlp or 4 * cfg.d_model) + 3 * int(cfg.n_heads) * T)
        vocab = int(getattr(cfg, "d_vocab_out", -1) or -1)
        vocab = vocab if vocab > 0 else int(cfg.d_vocab)
        return 4.0 * (kv + forward + 2 * n_read * vocab)

    def _stack(self, cells: list, layer: int, start: int, n_last: Optional[int]) -> torch.Tensor:
        """Logits ``[c, B, ...]`` of one stack of cells resumed at block ``layer`` and position ``start``."""
        B, T = self.tokens.shape
        C = len(cells)
        if layer == self.n_layers:  # nothing ablated: the base run's logits
            return self._base_logits(n_last)[None].expand(C, B, *self._base_logits(n_last).shape[1:])
        writes: dict[tuple, _Entries] = {}
        # the entry block runs the start position alone when every ablation in it sits there
        local = self.stepper is not None and self.stepper.reuses_prefix
        for c, cell in enumerate(cells):
            for site, site_layer, rows, positions, units, values in cell:
                if not len(rows):
                    continue
                writes.setdefault((site, site_layer), _Entries()).add(rows + c * B, positions, units, values)
                if site_layer == layer and bool((positions != start).any()):
                    local = False
        offset = 0 if self.stepper is None or self.base is None else start
        edits = [(site_lib.hook_name(site, lay), self._edit(site, entries, offset))
                 for (site, lay), entries in writes.items()]
        if self.stepper is None or self.base is None:
            logits = forward_with_hooks(self.model, self.tokens.repeat(C, 1), edits, return_type="logits",
                                        last=n_last or 1)
            logits = logits[:, -1] if n_last is None else logits[:, -n_last:]
        else:
            width = 1 if local else T - start
            hidden = self.base.resid[layer][:, start : start + width].repeat(C, 1, 1)
            logits = self.stepper.resume(self.base, layer, hidden, start, edits=edits, n_stack=C, n_last=n_last,
                                         local=local)
        return logits.reshape(C, B, *logits.shape[1:])

    def _base_logits(self, n_last: Optional[int]) -> torch.Tensor:
        """The base run's logits at the last ``n_last`` positions (``None``: the final one)."""
        have = self.n_last or 1
        if (n_last or 1) > have:
            raise AnalysisError(f"the base run read the last {have} positions; n_last={n_last} needs a runner "
                                f"made with n_last >= {n_last}")
        logits = self.base_logits if self.n_last is not None else self.base_logits[:, None]
        return logits[:, -1] if n_last is None else logits[:, logits.shape[1] - n_last :]

    def _edit(self, site: str, entries: _Entries, start: int) -> Callable:
        """A hook writing ``entries`` into ``site``'s activation, whose position 0 is ``start``."""
        rows, positions, units, values = entries.tensors()
        index = positions - start
        heads = self._unit_shapes["attn_z"][0]

        def edit(activation: torch.Tensor, hook: Any = None) -> torch.Tensor:
            flat = site == "attn_z" and activation.ndim == 3
            act = activation.unflatten(-1, (heads, -1)) if flat else activation
            if len(index) and int(index.max()) >= act.shape[1]:
                raise AnalysisError(f"an ablation at position {int(positions.max())} lies outside the positions "
                                    f"{start}..{start + act.shape[1] - 1} this run computes")
            device = act.device
            where = (rows.to(device), index.to(device)) + (() if units is None else (units.to(device),))
            values_ = values.to(device, act.dtype)
            if act.requires_grad:
                act = act.index_put(where, values_)
            else:  # written in place: the hook's output replaces the activation either way
                act.index_put_(where, values_)
            return act.flatten(-2) if flat else act

        return edit
