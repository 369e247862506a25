"""Exact activation patching sweeps, many cells per forward (Meng et al. 2022; Heimersheim & Nanda 2024)."""

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
from arithinterp.engine import PatchRunner, stepper_for
from arithinterp.engine.patches import RUN, SOURCE


def _site_width(model, site: str, length: int) -> int:
    """Floats per pair and position that one stacked cell holds while its run is resumed."""
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
    position (Meng et al. 2022's causal tracing; component patching as in Nikankin et al. 2025 and
    Stolfo et al. 2023).

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
        engine: ``"auto"`` (the model's own blocks stepped from the patched layer and position
            when that reproduces its logits, else whole forwards with a warning), ``"stepped"``
            (refuse to fall back) or ``"hooks"`` (whole forwards).

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
    engines, n_run = set(), 0
    groups = pairs.clean.length_groups()
    with torch.inference_mode():
        bar = tqdm(total=len(table) * len(groups), desc=f"sweep {site}", disable=not progress)
        for idx in groups:
            base_tokens, source_tokens = base_set.unpadded(idx), source_set.unpadded(idx)
            length = base_tokens.shape[1]
            offset = base_set.offset(idx)
            stepper, engine_used = stepper_for(model, base_tokens, engine)
            engines.add(engine_used)
            runner = PatchRunner(model, stepper, site, base_tokens, source_tokens)
            base_logits, source_logits = runner.base_logits.float(), runner.source_logits.float()
            ctx = metric_context(pairs[idx], direction, base_logits, source_logits, device=base_logits.device)
            base_metric, source_metric = fn(base_logits, ctx).float().cpu(), fn(source_logits, ctx).float().cpu()
            clean_base[idx], corrupt_base[idx] = (source_metric, base_metric) if direction == "denoise" else (base_metric, source_metric)
            pos_group = None if pos_index is None else pos_index[:, idx] - offset  # [n_pos, B] unpadded
            chunk = batch_cells or max(1, ELEMENT_BUDGET // (len(idx) * length * _site_width(model, site, length)))
            unit_ids = torch.tensor(units, dtype=torch.long)
            cell_pos = lambda rows: None if pos_group is None else pos_group[table[rows, 1]]  # noqa: E731
            cell_unit = lambda rows: None if not units else unit_ids[table[rows, 2]]  # noqa: E731
            for layer_i, layer in enumerate(layer_list):
                rows = torch.nonzero(table[:, 0] == layer_i).flatten()
                # cells whose patched run is the base run or the source run for every pair are not run
                states = runner.cell_states(layer, cell_pos(rows), cell_unit(rows))  # [C, B]
                settled = (states != RUN).all(1)
                known = torch.where(states[settled] == SOURCE, source_metric, base_metric)
                values[idx[:, None], rows[settled][None, :]] = known.T.float()
                bar.update(int(settled.sum()))
                rows = rows[~settled]
                starts = None
                if pos_group is not None and runner.reuses_prefix:  # cells patched at similar positions share a start
                    rows = rows[torch.argsort(cell_pos(rows).min(1).values, stable=True)]
                    starts = cell_pos(rows).min(1).values
                n_run += len(rows)
                for part in _chunks(rows, starts, chunk, len(idx), length):
                    logits = runner.patched(layer, cell_pos(part), cell_unit(part)).float()
                    values[idx[:, None], part[None, :]] = fn(logits, ctx).T.float().cpu()
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
