"""Exact activation patching sweeps, many cells per forward (RECIPES §1, §4, §6)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from arithinterp import sites as site_lib
from arithinterp.errors import ConfigError, SiteError, accepted
from arithinterp.patching.core import (
    DIRECTIONS,
    ELEMENT_BUDGET,
    ENGINES,
    SWEEP_SITES,
    Cells,
    PatchResult,
    check_choice,
    check_pairs,
    metric_context,
    metric_fn,
    patch_result,
    resolve_positions,
    resolve_units,
)
from arithinterp.patching.replica import Replica, patch_mask, replica_for, slice_positions

UNCHANGED, SOURCE, RUN = 0, 1, 2  # what patching a cell does to a pair (see _ReplicaRunner.cell_states)
_RESIDUAL_SITES = ("resid_pre", "resid_mid", "resid_post")  # everything downstream depends on them alone


def _site_width(model, site: str, length: int) -> int:
    cfg = model.cfg
    return {
        "attn_z": cfg.n_heads * cfg.d_head,
        "pattern": cfg.n_heads * length,
        "mlp_pre": cfg.d_mlp,
        "mlp_post": cfg.d_mlp,
    }.get(site, cfg.d_model) + max(cfg.d_model, cfg.d_mlp or 0, cfg.n_heads * length)


def sweep(
    model: Any,
    pairs: Any,
    site: str,
    metric: Union[str, Callable] = "logit_diff",
    layers: Optional[Sequence[int]] = None,
    positions=None,
    heads: Optional[Sequence[int]] = None,
    neurons: Optional[Sequence[int]] = None,
    direction: str = "denoise",
    normalize: bool = False,
    *,
    per_position: bool = True,
    batch_cells: Optional[int] = None,
    engine: str = "auto",
    seed: int = 0,
    progress: bool = True,
) -> PatchResult:
    """Exact activation patching of ``site`` over layers × positions (× heads / neurons).

    Every cell is its own patch: the base run (corrupt for ``"denoise"``, clean for ``"noise"``)
    with the cell's activation replaced by the source run's, and ``metric`` read at the final
    position (RECIPES §1 layer patch, §4/§6 component patching).

    Args:
        site: ``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_out``, ``mlp_out``, ``attn_z``
            (per head), ``pattern`` (per head; positions are query positions), ``mlp_pre`` /
            ``mlp_post`` (per neuron).
        metric: ``"logit_diff"`` (clean answer − corrupt answer logit), ``"prob"`` / ``"logprob"``
            of the clean answer, ``"ie"`` (Stolfo et al. 2023; r the base prompt's answer, r′ the
            source's), or ``f(logits [B, V], pairs) -> [B]``.
        positions: None (every position, or the named positions ``a``, ``b``, ``final`` when the
            pairs differ in length), names, or ints in the left-padded frame.
        per_position: False patches every position at once (no position axis).
        batch_cells: cells stacked per forward (default: as many as fit a 64 MB activation).
        engine: ``"auto"`` (replica forward from the patched layer when it reproduces the model,
            else hooks), ``"replica"`` or ``"hooks"``.

    Returns a :class:`PatchResult` whose ``values`` are ``[n_pairs, n_layers, n_positions?,
    n_heads_or_neurons?]``.
    """
    check_pairs(pairs)
    site_lib.check_site(site)
    if site not in SWEEP_SITES:
        raise SiteError(f"site {site!r} cannot be swept; accepted: {accepted(SWEEP_SITES)}")
    check_choice("direction", direction, DIRECTIONS)
    check_choice("engine", engine, ENGINES)
    fn = metric_fn(metric)
    layer_list = site_lib.check_layers(model, site, layers)
    unit_kind, units = resolve_units(model, site, heads, neurons)
    if per_position:
        pos_labels, pos_index = resolve_positions(pairs, positions)
    else:
        if positions is not None:
            raise SiteError("positions cannot be given with per_position=False (every position is patched at once)")
        pos_labels, pos_index = [], None
    if batch_cells is not None and (not isinstance(batch_cells, int) or batch_cells < 1):
        raise ConfigError(f"batch_cells must be a positive integer or None, got {batch_cells!r}")
    cells = Cells(layer_list, len(pos_labels), units)
    table = cells.table()
    n = len(pairs)
    values = torch.empty(n, len(table))
    clean_base, corrupt_base = torch.empty(n), torch.empty(n)
    base_set, source_set = (pairs.corrupt, pairs.clean) if direction == "denoise" else (pairs.clean, pairs.corrupt)
    engines, replica, n_run = set(), None, 0
    groups = pairs.clean.length_groups()
    with torch.inference_mode():
        bar = tqdm(total=len(table) * len(groups), desc=f"sweep {site}", disable=not progress)
        for idx in groups:
            base_tokens, source_tokens = base_set.unpadded(idx), source_set.unpadded(idx)
            length = base_tokens.shape[1]
            offset = base_set.offset(idx)
            replica, engine_used = replica_for(model, base_tokens, engine, replica)
            engines.add(engine_used)
            runner = _ReplicaRunner(replica, base_tokens, source_tokens) if replica else _HookRunner(model, site, base_tokens, source_tokens)
            ctx = metric_context(pairs[idx], direction, runner.base_logits, runner.source_logits)
            base_metric, source_metric = fn(runner.base_logits, ctx), fn(runner.source_logits, ctx)
            clean_base[idx], corrupt_base[idx] = (source_metric, base_metric) if direction == "denoise" else (base_metric, source_metric)
            pos_group = None if pos_index is None else pos_index[:, idx] - offset  # [n_pos, B] unpadded
            answer_tokens = torch.stack([ctx.clean_tok, ctx.corrupt_tok], dim=1)  # [B, 2]
            chunk = batch_cells or max(1, ELEMENT_BUDGET // (len(idx) * length * _site_width(model, site, length)))
            unit_ids = torch.tensor(units, dtype=torch.long)
            cell_pos = lambda rows: None if pos_group is None else pos_group[table[rows, 1]]  # noqa: E731
            cell_unit = lambda rows: None if not units else unit_ids[table[rows, 2]]  # noqa: E731
            for layer_i, layer in enumerate(layer_list):
                rows = torch.nonzero(table[:, 0] == layer_i).flatten()
                # cells whose patched run is the base run or the source run for every pair are not run
                states = runner.cell_states(site, layer, cell_pos(rows), cell_unit(rows))  # [C, B]
                settled = (states != RUN).all(1)
                known = torch.where(states[settled] == SOURCE, source_metric, base_metric)
                values[idx[:, None], rows[settled][None, :]] = known.T.float()
                bar.update(int(settled.sum()))
                rows = rows[~settled]
                if pos_group is not None:  # cells patched at similar positions share a start position
                    rows = rows[torch.argsort(cell_pos(rows).min(1).values, stable=True)]
                starts = None if pos_group is None else cell_pos(rows).min(1).values
                n_run += len(rows)
                # a residual patch entering the last block recomputes one position whatever its start
                last_point = site in ("resid_pre", "resid_post") and layer + (site == "resid_post") >= site_lib.n_layers(model) - 1
                for part in _chunks(rows, None if last_point else starts, chunk, len(idx), length):
                    if metric == "logit_diff" and replica is not None:  # two unembedding columns suffice
                        logits = runner.patched(site, layer, cell_pos(part), cell_unit(part), tokens=answer_tokens)
                        metric_values = logits[..., 0] - logits[..., 1]
                    else:
                        metric_values = fn(runner.patched(site, layer, cell_pos(part), cell_unit(part)), ctx)
                    values[idx[:, None], part[None, :]] = metric_values.T.float()
                    bar.update(len(part))
        bar.close()
    values = values.reshape(n, *cells.shape())
    return patch_result(
        model, pairs, values, clean_base, corrupt_base, cells, pos_labels, pos_index, site, metric, direction,
        "exact", normalize, seed, dict(engine=sorted(engines), unit=unit_kind, cells_run=n_run, cells_settled=len(table) * len(groups) - n_run),
    )


def _chunks(rows: torch.Tensor, starts: Optional[torch.Tensor], size: int, n_pairs: int, length: int) -> list:
    """Split cells (sorted by start position) into forwards of at most ``size`` cells.

    A chunk runs from its earliest start position, so a cell that starts later recomputes a few
    unchanged positions; a new chunk begins once that waste would pass 1/8 of the chunk's
    positions, unless the chunk is still too small for the waste to matter.
    """
    if len(rows) == 0:
        return []
    if starts is None:
        return list(rows.split(size))
    chunks, begin = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows):
            chunks.append(rows[begin:i])
            break
        first = int(starts[begin])
        tokens = (i - begin) * n_pairs * (length - first)
        if i - begin >= size or (int(starts[i]) - first > (length - first) // 8 and tokens >= 2048):
            chunks.append(rows[begin:i])
            begin = i
    return chunks


_POS_DIM = {site: 2 if site == "pattern" else 1 for site in SWEEP_SITES}  # position axis of a cached [B, ...] activation


class _ReplicaRunner:
    """Patched runs on the replica, starting at the patched layer and earliest patched position."""

    def __init__(self, replica: Replica, base_tokens: torch.Tensor, source_tokens: torch.Tensor):
        self.replica = replica
        # two forwards rather than one of both: activations of twice the size fall out of cache
        self.base_logits, self.base = replica.run(base_tokens)
        self.source_logits, self.source = replica.run(source_tokens)
        self.length = base_tokens.shape[1]

    def cell_states(self, site: str, layer: int, pos: Optional[torch.Tensor], unit: Optional[torch.Tensor]) -> torch.Tensor:
        """What each cell's patch does to each pair, ``[C, B]``: ``UNCHANGED`` (the source activation
        equals the base one where it is patched: the patched run is the base run), ``SOURCE`` (a
        residual-stream site that then equals the source run's at every position: everything
        downstream, the logits included, is the source run's) or ``RUN``."""
        neq = self.source[site][layer] != self.base[site][layer]
        if self._final_only(site, layer):  # only the final position is kept; patches elsewhere are no-ops
            full = torch.zeros(*neq.shape[:_POS_DIM[site]], self.length, *neq.shape[_POS_DIM[site] + 1 :], dtype=torch.bool)
            full.narrow(_POS_DIM[site], self.length - 1, 1).copy_(neq)
            neq = full
        if site == "pattern":
            per = neq.any(-1).transpose(1, 2)  # [B, T_query, H]
        elif site == "attn_z":
            per = neq.any(-1)  # [B, T, H]
        elif site in ("mlp_pre", "mlp_post"):
            per = neq  # [B, T, d_mlp]
        else:
            per = neq.any(-1, keepdim=True)  # [B, T, 1]
        per = per.any(-1)[None] if unit is None else per[:, :, unit].permute(2, 0, 1)  # [C or 1, B, T]
        C = pos.shape[0] if pos is not None else len(unit) if unit is not None else 1
        per = per.expand(C, -1, -1)
        if pos is None:  # every position patched
            patched, elsewhere = per.any(-1), torch.zeros(per.shape[:2], dtype=torch.bool)
        else:
            patched = per.gather(2, pos[:, :, None])[..., 0]
            elsewhere = per.sum(-1) > patched.long()
        states = torch.where(patched, RUN, UNCHANGED)
        if site in _RESIDUAL_SITES:
            states = torch.where(patched & ~elsewhere, SOURCE, states)
        return states

    def _final_only(self, site: str, layer: int) -> bool:
        return self.base[site][layer].shape[_POS_DIM[site]] != self.length

    def patched(self, site: str, layer: int, pos: Optional[torch.Tensor], unit: Optional[torch.Tensor], tokens=None) -> torch.Tensor:
        # the last block keeps only the final position: a patch anywhere else leaves the logits as they are
        s = self.length - 1 if self._final_only(site, layer) else 0 if pos is None else int(pos.min())
        sliced = 0 if self._final_only(site, layer) else s
        base = slice_positions(site, self.base[site][layer], sliced)[None]
        source = slice_positions(site, self.source[site][layer], sliced)[None]
        C = len(pos) if pos is not None else len(unit) if unit is not None else 1
        shape = (C,) + tuple(base.shape[1:])
        value = torch.where(patch_mask(site, shape, s, pos, unit), source, base)
        point = pos if site in ("resid_pre", "resid_post") else None
        return self.replica.resume(layer, site, value, s, self.base, point=point, tokens=tokens)


class _HookRunner:
    """Patched runs on the model itself: cells stacked along the batch, one hook per forward.

    ``resid_mid`` is patched through ``hook_attn_out`` (``resid_mid = resid_pre + attn_out``):
    on a ``TransformerBridge`` the ``hook_resid_mid`` alias is the input of ``ln2`` only, so
    editing it would leave the residual stream that skips the MLP untouched.
    """

    def __init__(self, model, site: str, base_tokens: torch.Tensor, source_tokens: torch.Tensor):
        self.model, self.tokens = model, base_tokens
        layers = range(site_lib.n_layers(model))
        names = [site_lib.hook_name(site, layer) for layer in layers]
        base_names = [site_lib.hook_name("resid_pre", layer) for layer in layers] if site == "resid_mid" else []
        logits, cache = model.run_with_cache(base_tokens, names_filter=lambda name: name in base_names) if base_names else (model(base_tokens, return_type="logits"), {})
        self.base_logits = logits[:, -1]
        self.base = {name: cache[name] for name in base_names}
        logits, cache = model.run_with_cache(source_tokens, names_filter=lambda name: name in names)
        self.source_logits = logits[:, -1]
        self.source = {name: cache[name] for name in names}

    def cell_states(self, site: str, layer: int, pos, unit) -> torch.Tensor:
        """Every cell is run: the base activations are not kept on this path."""
        return torch.full((len(pos) if pos is not None else len(unit) if unit is not None else 1, self.tokens.shape[0]), RUN)

    def patched(self, site: str, layer: int, pos, unit) -> torch.Tensor:
        name = site_lib.hook_name(site, layer)
        source = self.source[name]
        if site == "resid_mid":
            name = site_lib.hook_name("attn_out", layer)
            source = source - self.base[site_lib.hook_name("resid_pre", layer)]
        B = self.tokens.shape[0]
        C = len(pos) if pos is not None else len(unit) if unit is not None else 1

        def hook(activation, hook):
            stacked = activation.reshape(C, *source.shape)
            mask = patch_mask(site, tuple(stacked.shape), 0, pos, unit)
            return torch.where(mask, source[None], stacked).reshape(activation.shape)

        logits = self.model.run_with_hooks(self.tokens.repeat(C, 1), fwd_hooks=[(name, hook)], return_type="logits")
        return logits[:, -1].reshape(C, B, -1)


