"""Exact activation patching sweeps, many cells per forward (Meng et al. 2022; Heimersheim & Nanda 2024)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from arithinterp.checks import check_belongs, check_choice, check_pairs
from arithinterp import sites as site_lib
from arithinterp.errors import SiteError, accepted
from arithinterp.metrics import DIRECTIONS, LOGIT_METRICS, answer_columns, metric_context, metric_fn
from arithinterp.engine.steppers import ENGINES
from arithinterp.patching.core import (
    ELEMENT_BUDGET,
    PATCHING_SITES,
    Cells,
    FullAnswer,
    PatchResult,
    answer_logprob,
    patch_result,
    resolve_scoring,
    resolve_units,
)
from arithinterp.engine import PatchRunner, stepper_for
from arithinterp.engine.patches import RUN, SOURCE
from arithinterp.progress import progress_bar
from arithinterp.tasks import resolve_positions
from arithinterp.types import PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs
    from arithinterp.types import HookedModel


def _site_width(model, site: str, length: int) -> int:
    """Floats per pair and position that one stacked cell holds while its run is resumed."""
    cfg = model.cfg
    return {
        "attn_z": cfg.n_heads * cfg.d_head,
        "pattern": cfg.n_heads * length,
        "mlp_pre": cfg.d_mlp,
        "mlp_post": cfg.d_mlp,
    }.get(site, cfg.d_model) + max(cfg.d_model, cfg.d_mlp or 0, cfg.n_heads * length)


@checked
def activation_patching(
    model: HookedModel,
    pairs: PromptPairs,
    site: str,
    metric: Union[str, Callable] = "logit_diff",
    *,
    layers: Optional[Sequence[int]] = None,
    positions: Optional[Sequence[Union[str, int]]] = None,
    heads: Optional[Sequence[int]] = None,
    neurons: Optional[Sequence[int]] = None,
    direction: str = "denoise",
    normalize: bool = False,
    per_position: bool = True,
    batch_cells: Optional[PositiveInt] = None,
    engine: str = "auto",
    scoring: Optional[str] = None,
    seed: int = 0,
    progress: bool = True,
) -> PatchResult:
    """Exact activation patching of ``site`` over layers × positions (× heads / neurons).

    Every cell is its own patch: the base run (corrupt for ``"denoise"``, clean for ``"noise"``)
    with the cell's activation replaced by the source run's, and ``metric`` read at the final
    position (Meng et al. 2022's causal tracing; component patching as in Nikankin et al. 2025 and
    Stolfo et al. 2023).

    Args:
        model: The hooked model.
        pairs: Clean / corrupt prompt pairs (:meth:`PromptSet.counterfactual`).
        site: ``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_out``, ``mlp_out``, ``attn_z``
            (per head), ``pattern`` (per head; positions are query positions), ``mlp_pre`` /
            ``mlp_post`` (per neuron).
        metric: ``"logit_diff"`` (clean answer − corrupt answer logit), ``"prob"`` / ``"logprob"``
            of the clean answer, ``"ie"`` (Stolfo et al. 2023; r the base prompt's answer, r′ the
            source's), or ``f(logits [B, V], pairs) -> [B]``.
        layers: Layers to patch (default: all).
        positions: None (every position, or the named positions ``a``, ``b``, ``final`` when the
            pairs differ in length), names, or ints in the left-padded frame.
        heads: Heads to patch at ``attn_z`` / ``pattern`` (default: all).
        neurons: Neurons to patch at ``mlp_pre`` / ``mlp_post`` (default: all).
        direction: ``"denoise"`` (patch clean activations into the corrupt run) or ``"noise"`` (the reverse).
        normalize: Report ``(v − corrupt) / (mean clean − mean corrupt)`` instead of the raw metric.
        per_position: False patches every position at once (no position axis).
        batch_cells: cells stacked per forward (default: as many as fit a 64 MB activation).
        engine: ``"auto"`` (the model's own blocks stepped from the patched layer and position
            when that reproduces its logits, else whole forwards with a warning), ``"stepped"``
            (refuse to fall back) or ``"hooks"`` (whole forwards).
        scoring: ``"first-token"`` (the metric on the final position's logits, which predict the
            answer's first token), ``"full-answer"`` (the named metrics over every answer token,
            teacher-forced: each answer the metric compares is appended to the base and the source
            prompt, and ``logit_diff`` becomes ``log P(clean answer) − log P(corrupt answer)``,
            ``logprob`` / ``prob`` those of the whole clean answer, ``ie`` Stolfo et al.'s with
            whole-answer probabilities), or ``None``: the prompts' own ``scoring``
            (``prompts.with_scoring("full-answer")``; a metric callable always reads the final
            position). Patch positions stay prompt positions; ``per_position=False`` patches the
            fed answer tokens too (the source prompt is fed the same answer).
        seed: Seeds the bootstrap interval.
        progress: Show a progress bar.

    Returns:
        The result, a :class:`PatchResult` whose ``values`` are ``[pair, layer, position?, head_or_neuron?]``.

    Raises:
        SiteError: A site that cannot be patched, a layer, position, head or neuron out of range, or
            units given for a site without them.
        ConfigError: An unknown metric, direction, engine or scoring.
        AnalysisError: Pairs that cannot be patched (empty, misaligned), or ``engine="stepped"``
            where stepping does not reproduce the model's logits.
        ModelMismatchError: The pairs were built for another model.
    """
    check_belongs(model, "patching.activation_patching", pairs=pairs)
    check_pairs(pairs)
    site_lib.check_site(site)
    if site not in PATCHING_SITES:
        raise SiteError(f"site {site!r} cannot be patched; accepted: {accepted(PATCHING_SITES)}")
    check_choice("direction", direction, DIRECTIONS)
    check_choice("engine", engine, ENGINES)
    fn = metric_fn(metric)
    scoring = resolve_scoring(pairs, scoring, metric)
    layer_list = site_lib.check_layers(model, site, layers)
    unit_kind, units = resolve_units(model, site, heads, neurons)
    if per_position:
        pos_labels, pos_index = resolve_positions(pairs, positions)
    else:
        if positions is not None:
            raise SiteError("positions cannot be given with per_position=False (every position is patched at once)")
        pos_labels, pos_index = [], None
    cells = Cells(layer_list, len(pos_labels), units)
    table = cells.table()
    n = len(pairs)
    values = torch.empty(n, len(table))
    clean_base, corrupt_base = torch.empty(n), torch.empty(n)
    base_set, source_set = (pairs.corrupt, pairs.clean) if direction == "denoise" else (pairs.clean, pairs.corrupt)
    engines, n_run = set(), 0
    groups = pairs.clean.length_groups()
    with torch.inference_mode():
        bar = progress_bar(total=len(table) * len(groups), desc=f"sweep {site}", disable=not progress)
        for idx in groups:
            base_tokens, source_tokens = base_set.unpadded(idx), source_set.unpadded(idx)
            offset = base_set.offset(idx)
            full = None
            if scoring == "full-answer":  # every row: a pair's prompt with one of the answers teacher-forced after it
                assert isinstance(metric, str)  # resolve_scoring refuses "full-answer" with a metric callable
                full = FullAnswer.of(metric, pairs[idx], direction)
                fed = full.fed()
                base_tokens = torch.cat([base_tokens.repeat(full.n_feeds, 1), fed], dim=1)
                source_tokens = torch.cat([source_tokens.repeat(full.n_feeds, 1), fed], dim=1)
            length, n_rows = base_tokens.shape[1], base_tokens.shape[0]
            stepper, engine_used = stepper_for(model, base_tokens, engine)
            engines.add(engine_used)
            columns = None  # a logit difference reads the answers' columns of the unembedding alone
            if full is None and metric in LOGIT_METRICS:
                columns, _ = answer_columns(pairs.clean_answer_token[idx], pairs.corrupt_answer_token[idx])
            runner = PatchRunner(model, stepper, site, base_tokens, source_tokens,
                                 n_last=None if full is None else full.n_answer, columns=columns)
            base_logits, source_logits = runner.base_logits.float(), runner.source_logits.float()
            if full is None:  # rows are pairs; the metric is read straight off the final-position logits
                ctx = metric_context(pairs[idx], direction, base_logits, source_logits, device=base_logits.device,
                                     columns=columns)
                row_values = lambda logits: fn(logits, ctx)  # noqa: E731
                per_pair = lambda rows: rows  # noqa: E731
            else:  # rows are (answer fed, pair); a row's value is its answer's teacher-forced log-probability
                answers = full.rows()
                row_values = lambda logits: answer_logprob(logits, answers)  # noqa: E731
                per_pair = full.metric_of
            base_rows, source_rows = row_values(base_logits).float().cpu(), row_values(source_logits).float().cpu()
            if full is not None:
                full.base_rows = base_rows  # "ie" compares with the unpatched base run
            base_metric, source_metric = per_pair(base_rows).float(), per_pair(source_rows).float()
            if direction == "denoise":
                clean_base[idx], corrupt_base[idx] = source_metric, base_metric
            else:
                clean_base[idx], corrupt_base[idx] = base_metric, source_metric
            pos_group = None if pos_index is None else pos_index[:, idx] - offset  # [n_pos, B] unpadded
            if pos_group is not None and full is not None:
                pos_group = pos_group.repeat(1, full.n_feeds)  # [n_pos, F * B]: the same prompt positions on every row
            floats_per = n_rows * _site_width(model, site, length)  # floats per cell and computed position
            chunk = batch_cells or max(1, ELEMENT_BUDGET // (floats_per * length))
            most = None  # the stacked logits [C, rows, K, V] within the budget too
            if full is not None and batch_cells is None:
                most = max(1, ELEMENT_BUDGET // (n_rows * full.n_answer * int(model.cfg.d_vocab)))
                chunk = min(chunk, most)
            unit_ids = torch.tensor(units, dtype=torch.long)
            cell_pos = lambda rows: None if pos_group is None else pos_group[table[rows, 1]]  # noqa: E731
            cell_unit = lambda rows: None if not units else unit_ids[table[rows, 2]]  # noqa: E731
            for layer_i, layer in enumerate(layer_list):
                rows = torch.nonzero(table[:, 0] == layer_i).flatten()
                # cells whose patched run is the base run or the source run for every pair are not run
                states = runner.cell_states(layer, cell_pos(rows), cell_unit(rows))  # [C, rows]
                settled = (states != RUN).all(1)
                known = per_pair(torch.where(states[settled] == SOURCE, source_rows, base_rows))
                values[idx[:, None], rows[settled][None, :]] = known.T.float()
                bar.update(int(settled.sum()))
                rows = rows[~settled]
                starts, grouping = None, runner.grouping(layer)
                if grouping != "any" and len(rows):  # cells patched at similar positions share a start
                    # a cell patching every position starts where its patch first changes anything
                    starts = (runner.first_changed(layer, cell_unit(rows)) if pos_group is None
                              else pos_group[table[rows, 1]].min(1).values)
                    order = torch.argsort(starts, stable=True)
                    rows, starts = rows[order], starts[order]
                n_run += len(rows)
                size = chunk
                if batch_cells is None and starts is not None and len(rows):  # the budget counts computed positions
                    size = max(1, ELEMENT_BUDGET // (floats_per * max(1, length - int(starts.min()))))
                    size = size if most is None else min(size, most)
                for part in _chunks(rows, starts, size, n_rows, length, one_start=grouping == "one"):
                    logits = runner.patched(layer, cell_pos(part), cell_unit(part)).float()
                    values[idx[:, None], part[None, :]] = per_pair(row_values(logits).float().cpu()).T.float()
                    bar.update(len(part))
        bar.close()
    values = values.reshape(n, *cells.shape())
    return patch_result(
        model, pairs, values, clean_base, corrupt_base, cells, pos_labels, pos_index, site, metric, direction,
        "exact", normalize, seed, dict(engine=sorted(engines), unit=unit_kind, scoring=scoring, cells_run=n_run,
                                      cells_settled=len(table) * len(groups) - n_run),
    )


def _chunks(
    rows: torch.Tensor, starts: Optional[torch.Tensor], size: int, n_pairs: int, length: int, one_start: bool = False
) -> list:
    """Split cells (sorted by start position) into forwards of at most ``size`` cells.

    A chunk runs from its earliest start position, so a cell that starts later recomputes a few
    unchanged positions; a new chunk begins once that waste would pass 1/8 of the chunk's
    positions, unless the chunk is still too small for the waste to matter. With ``one_start``
    every chunk has one start (patches whose block then runs at that position alone).
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
        waste = int(starts[i]) - first
        if i - begin >= size or (waste and one_start) or (waste > (length - first) // 8 and tokens >= 2048):
            chunks.append(rows[begin:i])
            begin = i
    return chunks
