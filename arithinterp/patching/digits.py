"""Which head computes which answer digit (Quirke & Barez 2024): per-head, per-digit ablation, and
the teacher-forced pairs that score one answer digit at the position that emits it.

* :func:`digit_ablation` — each head ablated at each answer position alone, each digit scored.
* :func:`digit_pairs` — pairs whose prompts end with the answer's first ``k`` tokens fed, so any
  final-position analysis (patching sweeps, edge circuits) scores answer token ``k``.
* :func:`vary_digit` — pairs that differ in one digit of the operands only (named by its place).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from arithinterp.checks import check_belongs, check_choice, check_pairs
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError, TaskError, accepted
from arithinterp import sites as site_lib
from arithinterp.engine import AblationRunner, Ablation, Read, RunningMean, stepper_for
from arithinterp.engine.budget import memory_budget
from arithinterp.engine import run as engine_run
from arithinterp.patching.component_ablation import (
    ablated_scores, answer_scores, position_rows, teacher_forced, token_scores,
)
from arithinterp.patching.components import parse_components
from arithinterp.engine.steppers import ENGINES
from arithinterp.patching.core import COMPONENT_ABLATIONS
from arithinterp.progress import progress_bar
from arithinterp.results import DISTINCT, PROBABILITY, Result, build_meta
from arithinterp.tasks.places import answer_token_places, place_power
from arithinterp.tasks.positions import predicting_position
from arithinterp.types import HookedModel, NonNegativeInt, checked

from arithinterp.tasks import PromptPairs, PromptSet  # at run time: @checked enforces them

FEEDS = ("own", "clean")
OPERANDS = ("a", "b", "both")


@dataclass(frozen=True)
class DigitAblationResult(Result):
    """Accuracy of each answer token with one head ablated at the position that predicts it.

    Causal attention keeps the earlier tokens as they were, so ``baseline − accuracy`` is the
    head's share at that step.

    Attributes:
        heads: ``"L{layer}H{head}"`` names.
        accuracy (Float[Tensor, "head answer_token"]): The fraction of prompts whose answer token k
            is still the argmax (teacher-forced) when head ``heads[i]`` is ablated at the position
            that predicts token k alone.
        baseline (Float[Tensor, "answer_token"]): The same with nothing ablated.
        ablation: The ablation: ``"mean"``, ``"zero"`` or ``"resample"``.
        meta: Provenance, the number of prompts, the seed, the engine used and ``answer_places``,
            the place of each answer token where every answer writes one digit per token in as
            many tokens (``None`` otherwise).
    """

    heads: list
    accuracy: torch.Tensor
    baseline: torch.Tensor
    ablation: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"heads": "head", "accuracy": "head digit", "baseline": "digit"}
    _legal = {"accuracy": PROBABILITY, "baseline": PROBABILITY, "heads": DISTINCT, "ablation": COMPONENT_ABLATIONS}

    @property
    def drop(self) -> torch.Tensor:
        """``baseline − accuracy``, ``[n_heads, n_answer_tokens]``."""
        return self.baseline[None] - self.accuracy

    def to_frame(self):
        """One row per (head, answer token): accuracy with the head ablated, baseline, drop."""
        import pandas as pd

        rows = [
            dict(
                head=head,
                answer_token=k,
                accuracy=float(self.accuracy[i, k]),
                baseline=float(self.baseline[k]),
                drop=float(self.drop[i, k]),
            )
            for i, head in enumerate(self.heads)
            for k in range(self.accuracy.shape[1])
        ]
        frame = pd.DataFrame(rows)
        frame["ablation"], frame["n_prompts"] = self.ablation, self.meta.get("n_prompts")
        return frame

    def plot(self, **kwargs):
        """Heads × answer tokens heatmap of the accuracy drop (see viz.patching)."""
        return draw(self, **kwargs)


@checked
def digit_ablation(
    model: HookedModel, prompts: PromptSet, *, heads: Optional[Sequence[str]] = None, ablation: str = "mean",
    seed: int = 0, engine: str = "auto", progress: bool = True,
) -> DigitAblationResult:
    """Ablate each head at each answer position alone and score that answer token (Quirke & Barez 2024,
    "Understanding Addition in Transformers").

    Quirke & Barez read a digit-addition model's heads as a staircase: each answer digit is
    computed one token before it is emitted, by heads that attend to the matching operand digits.
    This measures it: for every head and every answer token k, the head is ablated (``ablation``:
    ``"mean"``, ``"zero"`` or ``"resample"``) at the position
    that predicts token k, the answer is teacher-forced, and token k's accuracy is read.

    Args:
        model: The hooked model.
        prompts: A PromptSet with multi-token answers (e.g. ``zoo:add-3digit``'s); its scoring is
            set to ``"full-answer"`` here.
        heads: ``"L{layer}H{head}"`` names (default: every head).
        ablation: ``"mean"``, ``"zero"`` or ``"resample"``.
        seed: Seeds the resample ablation.
        engine: ``"auto"`` (the heads of one layer at one answer position stacked and resumed at
            that layer and position, the teacher-forced prompts' base run reused, when the model's
            blocks can be stepped; else whole forwards), ``"stepped"`` (refuse to fall back) or
            ``"hooks"`` (one whole forward per head and answer position).
        progress: Show a progress bar.

    Returns:
        The accuracy of each answer token with each head ablated, and the baseline.

    Raises:
        ConfigError: An unknown ablation or engine, or a head named with ``@position``.
        AnalysisError: An empty prompt set, or single-token answers.
        ModelMismatchError: The prompts were built for another model.
    """
    check_belongs(model, "patching.digit_ablation", prompts=prompts)
    check_choice("ablation", ablation, COMPONENT_ABLATIONS)
    check_choice("engine", engine, ENGINES)
    if len(prompts) == 0:
        raise AnalysisError("the prompt set is empty; nothing to ablate")
    n_answer = prompts.answer_tokens.shape[1]
    if n_answer < 2:
        raise AnalysisError(
            "the answers are single tokens; per-digit ablation needs multi-token answers (e.g. zoo:add-3digit)"
        )
    cfg = model.cfg
    names = (
        [f"L{layer}H{head}" for layer in range(cfg.n_layers) for head in range(cfg.n_heads)] if heads is None else heads
    )
    parsed = parse_components(model, names, ("head",))
    if any(c.position is not None for c in parsed):
        raise ConfigError("heads are ablated at each answer position in turn; name them without '@position'")
    baseline, cells, used = digit_scores(model, prompts, parsed, ablation, seed, engine=engine, progress=progress)
    return DigitAblationResult(
        heads=[c.name for c in parsed], accuracy=cells[..., 0].mean(-1), baseline=baseline[..., 0].mean(0),
        ablation=ablation,
        meta=build_meta(model, n_prompts=len(prompts), seed=seed, engine=used,
                        answer_places=answer_token_places(prompts)),
    )


def digit_scores(
    model: HookedModel, prompts: PromptSet, parsed: list, ablation: str, seed: int, *, engine: str = "auto",
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Per-prompt scores behind :func:`digit_ablation`: ``(baseline [N, n_answer, 2], cells [n_heads,
    n_answer, N, 2], engine used)``, the last axis (argmax correct, log-probability) of answer token
    k, teacher-forced, with head ``parsed[i]`` ablated at the position predicting token k (cells) or
    nothing ablated (baseline). ``engine="hooks"`` runs one whole forward per cell (the reference)."""
    prompts = prompts.with_scoring("full-answer")
    n_answer = prompts.answer_tokens.shape[1]
    if engine != "hooks":
        stepped = _stepped_digit_scores(model, prompts, parsed, ablation, seed, engine, progress)
        if stepped is not None:
            return (*stepped, "stepped")
    score, means = token_scores(prompts), {}  # each layer's mean head output is computed once

    def scores(components) -> torch.Tensor:  # [n_prompts, n_answer, 2]
        return ablated_scores(model, prompts, components, ablation, seed, keep=False, score=score, means=means)

    baseline = scores([])
    cells = torch.empty(len(parsed), n_answer, len(prompts), 2)
    jobs = [(i, k) for i in range(len(parsed)) for k in range(n_answer)]
    for i, k in progress_bar(jobs, desc="digit ablation", disable=not progress):
        cells[i, k] = scores([replace(parsed[i], position=predicting_position(k))])[:, k]
    return baseline, cells, "hooks"


def _stepped_digit_scores(model, prompts, parsed, ablation, seed, engine, progress, batch_size: int = 512):
    """:func:`digit_scores` through the engine's stacked ablations (:class:`arithinterp.engine.AblationRunner`):
    per batch of equal-length prompts, one base run of the teacher-forced prompts, then per layer and
    answer position one run of that layer's heads stacked, resumed at that layer and position. The
    ablation values are those of :func:`~arithinterp.patching.component_ablation.ablated_scores`: the mean
    over the prompts at each answer position (read from the base runs; every prompt has the answer
    positions), zero, or the same resampling draws. None when the model cannot be stepped
    (``engine="auto"``)."""
    n_answer = prompts.answer_tokens.shape[1]
    fed, fed_lengths = teacher_forced(prompts, n_answer)
    width = fed.shape[1]
    layers = sorted({c.layer for c in parsed})
    names = {layer: site_lib.hook_name("attn_z", layer) for layer in layers}
    generator = torch.Generator().manual_seed(seed)
    score = token_scores(prompts)
    batches = []  # (rows, tokens, offset, length, stepper) per batch of equal-length prompts
    for group in prompts.length_groups():
        length = int(fed_lengths[group[0]])
        tokens = fed[group, width - length :]
        stepper, _ = stepper_for(model, tokens, engine, warn=False)
        if stepper is None:
            return None
        shuffled: dict = {}
        if ablation == "resample":  # the group's own head outputs, each prompt given another's (ablated_scores' draw)
            reads = [Read("attn_z", layer) for layer in layers]
            with torch.inference_mode():
                runs = [engine_run(model, tokens[chunk], reads=reads, logits="none").reads
                        for chunk in torch.arange(len(group)).split(batch_size)]
            order = torch.randperm(len(group), generator=generator)
            shuffled = {layer: torch.cat([r[j] for r in runs]).float().cpu()[order] for j, layer in enumerate(layers)}
        for chunk in torch.arange(len(group)).split(batch_size):
            values = {layer: shuffled[layer][chunk] for layer in layers} if ablation == "resample" else None
            batches.append((group[chunk], tokens[chunk], prompts.offset(group), length, stepper, values))
    # base runs: kept for the ablations when they fit the memory budget, else run again
    keep = len(fed) * _base_run_bytes(model, width) <= memory_budget(model)
    runners: list = []
    means = {layer: RunningMean() for layer in layers}
    for _rows, tokens, _, _, stepper, _ in batches:
        runner = AblationRunner(model, stepper, tokens, n_last=n_answer, read=list(names.values()))
        for layer in layers:  # the answer positions: a one-frame mean over every prompt
            means[layer].add(_heads(model, runner.read[names[layer]]).float().cpu())
        runners.append(runner if keep else None)
    mean = {layer: means[layer].value() for layer in layers}  # [n_answer, H, d_head]
    baseline = torch.empty(len(prompts), n_answer, 2)
    cells = torch.empty(len(parsed), n_answer, len(prompts), 2)
    by_layer: dict[int, list[int]] = {}
    for i, c in enumerate(parsed):
        by_layer.setdefault(c.layer, []).append(i)
    for j, (rows, tokens, offset, length, stepper, shuffled) in enumerate(progress_bar(batches, desc="digit ablation",
                                                                               disable=not progress)):
        runner = runners[j] or AblationRunner(model, stepper, tokens, n_last=n_answer)
        runners[j] = None
        baseline[rows] = score(runner.base_logits.float(), rows).cpu()
        for k in range(n_answer):
            positions = position_rows(prompts, predicting_position(k), rows, offset, length)  # [B], unpadded
            assert positions is not None  # a named position always resolves to one per prompt
            cell_list, order = [], []
            for layer, members in by_layer.items():
                if ablation == "mean":
                    value = mean[layer][positions - (length - n_answer)]  # [B, H, d_head]
                elif ablation == "resample":
                    value = _heads(model, shuffled[layer])[torch.arange(len(rows)), positions]
                else:
                    value = None
                for i in members:
                    cell_list.append([Ablation("attn_z", layer, positions, torch.tensor([parsed[i].unit]), value)])
                    order.append(i)

            def token_k(logits, k=k, rows=rows):  # [c, B, n_answer - k, V] -> [c, B, 2] of token k
                return answer_scores(logits[:, :, 0], prompts.answer_tokens[rows, k].expand(len(logits), -1)).cpu()

            cells[torch.tensor(order)[:, None], k, rows[None]] = runner.run(cell_list, n_last=n_answer - k,
                                                                           score=token_k)
    return baseline, cells


def _base_run_bytes(model, T: int) -> int:
    """Rough bytes a stepped base run keeps per prompt: every block's input, keys and values."""
    cfg = model.cfg
    kv_heads = int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
    return 4 * T * int(cfg.n_layers) * (int(cfg.d_model) + 2 * kv_heads * int(cfg.d_head))


def _heads(model, activation: torch.Tensor) -> torch.Tensor:
    """``attn_z`` ``[B, T, H, d_head]`` (bridges fire it flat)."""
    return activation.unflatten(-1, (int(model.cfg.n_heads), -1)) if activation.ndim == 3 else activation


def _fed(prompts: PromptSet, fed: torch.Tensor, k: int) -> PromptSet:
    """``prompts`` with ``fed [N, k]`` appended (the left-padded frame keeps every position) and
    answer token ``k`` of each prompt's own answer as the one scored at the new last position."""
    tok = prompts.tokenizer
    text = (lambda row: tok.decode(row)) if tok is not None else (lambda row: " ".join(map(str, row)))  # noqa: E731
    rest = prompts.answer_tokens[:, k:]
    meta = dict(prompts.meta)
    n_rest = (rest >= 0).sum(1)
    meta["answer_tokens"] = dict(max=int(n_rest.max()), min=int(n_rest.min()))
    meta["teacher_forced"] = k
    return replace(
        prompts,
        texts=tuple(t + text(row) for t, row in zip(prompts.texts, fed.tolist())),
        tokens=torch.cat([prompts.tokens, fed], dim=1),
        lengths=prompts.lengths + k,
        answer_tokens=rest,
        answer_texts=tuple(text([x for x in row if x >= 0]) for row in rest.tolist()),
        positions={**prompts.positions, "emit": torch.full((len(prompts),), prompts.tokens.shape[1] + k - 1)},
        scoring="first-token",
        meta=meta,
    )


@checked
def digit_pairs(pairs: PromptPairs, answer_token: NonNegativeInt, feed: str = "own") -> PromptPairs:
    """Pairs that score answer token ``answer_token`` (0 = the first emitted) at the position that
    emits it (Quirke & Barez 2024: each answer digit is computed one token before it is emitted).

    Each prompt is teacher-forced with its answer's first ``answer_token`` tokens (``feed="own"``:
    each prompt its own answer, as :func:`digit_ablation` and generation do; ``"clean"``: the
    clean answer after both prompts, so the pair differs only where the operands do). The new
    prompts' answer starts at token ``answer_token``, so every final-position analysis
    (``activation_patching``, ``circuits.score_edges``) scores that digit; the earlier positions
    keep their labels (``"a"``, ``"final"`` is still the ``=`` token) and ``"emit"`` names the
    new last position. Tokens ``[N, T + answer_token]``.

    Args:
        pairs: Clean / corrupt pairs with multi-token answers.
        answer_token: The answer token to score, 0 = the first emitted.
        feed: ``"own"`` (each prompt its own answer) or ``"clean"`` (the clean answer after both).

    Returns:
        The teacher-forced pairs, tokens ``[pair, pos + answer_token]``;
        ``meta["same_answer_token"]`` counts pairs whose clean and corrupt token there are equal
        (their ``logit_diff`` is 0 by definition; ``"logprob"`` still scores them).

    Raises:
        ConfigError: An unknown ``feed`` or an ``answer_token`` beyond the longest answer.
        AnalysisError: Pairs that cannot be patched, or whose answers do not reach token
            ``answer_token`` (refused, not dropped).
    """
    from arithinterp.tasks import PromptPairs as Pairs

    check_pairs(pairs)
    check_choice("feed", feed, FEEDS)
    clean, corrupt = pairs.clean, pairs.corrupt
    width = max(clean.answer_tokens.shape[1], corrupt.answer_tokens.shape[1])
    k = answer_token
    if k >= width:  # the lower bound and the type are declared; the width is the data's
        raise ConfigError(f"answer_token must be an integer in 0..{width - 1} (these answers have at most {width} "
                          f"tokens), got {k}")
    short = (clean.n_answer_tokens <= k) | (corrupt.n_answer_tokens <= k)
    if short.any():
        i = int(torch.nonzero(short)[0])
        raise AnalysisError(
            f"{int(short.sum())} of {len(pairs)} pairs have an answer without token {k} (e.g. "
            f"{clean.texts[i]!r} -> {clean.answer_texts[i]!r}, {corrupt.texts[i]!r} -> {corrupt.answer_texts[i]!r}); "
            f"keep the pairs whose answers are long enough, pairs[(pairs.clean.n_answer_tokens > {k}) & "
            f"(pairs.corrupt.n_answer_tokens > {k})], or write answers zero-padded (answer_digits=)"
        )
    fed_clean = clean.answer_tokens[:, :k]
    fed_corrupt = fed_clean if feed == "clean" else corrupt.answer_tokens[:, :k]
    same = int((clean.answer_tokens[:, k] == corrupt.answer_tokens[:, k]).sum())
    meta = {**pairs.meta, "answer_token": k, "feed": feed, "same_answer_token": same}
    return Pairs(_fed(clean, fed_clean, k), _fed(corrupt, fed_corrupt, k), vary=pairs.vary, seed=pairs.seed,
                 meta=meta)


@checked
def vary_digit(prompts: PromptSet, place: str, operand: str = "a", seed: int = 0) -> PromptPairs:
    """Pairs whose corrupt prompt changes the ``place`` digit (``"units"``, ``"tens"``, ...) of
    ``operand`` (``"a"``, ``"b"`` or ``"both"``) to another digit drawn at random and keeps every
    other digit: the counterfactual that asks which circuit carries one digit column (Quirke &
    Barez 2024: an answer digit reads the operand digits of its own place and the one below). A
    leading digit never becomes 0, so each number keeps its digit count.

    Args:
        prompts: Prompts of one operator and one template.
        place: The digit to change, by its place (:data:`~arithinterp.tasks.PLACES`).
        operand: ``"a"``, ``"b"`` or ``"both"``.
        seed: Seeds the new digits.

    Returns:
        The pairs (``vary`` is ``"{operand}_{place}"``, e.g. ``"b_tens"``); those whose tokens or
        answer lengths do not align (the sum gains a digit) are dropped and counted in ``meta``.

    Raises:
        ConfigError: An unknown ``operand`` or ``place``.
        TaskError: An empty set, mixed operators or prefixes, an operand without that digit,
            undefined corrupt prompts, or no prompt that keeps its token positions.
    """
    from arithinterp.tasks import OPERATORS, PromptPairs, prompts_for_pairs

    check_choice("operand", operand, OPERANDS)
    column = place_power(place)
    if len(prompts) == 0:
        raise TaskError("cannot vary a digit of an empty prompt set")
    prompts.require_one_prefix("vary_digit()")
    if prompts.op not in OPERATORS:
        raise TaskError(f"vary_digit() needs prompts of one operator; these are {prompts.op!r}: "
                        f"build one set per operator ({accepted(OPERATORS)})")
    names = ["a", "b"] if operand == "both" else [operand]
    values = {name: getattr(prompts, name).tolist() for name in ("a", "b")}
    for name in names:
        narrow = [v for v in values[name] if v < 0 or v < 10**column and not (v == 0 and column == 0)]
        if narrow:
            raise TaskError(f"operand {name}={narrow[0]} has no {place} digit ({len(narrow)} of {len(prompts)} "
                            f"prompts); vary a place every operand has, or keep operands >= {10**column}")
    rng = random.Random(seed)
    corrupt = {name: list(v) for name, v in values.items()}
    for name in names:
        for i, v in enumerate(values[name]):
            old = v // 10**column % 10
            leading = v < 10 ** (column + 1)
            choices = [d for d in range(10) if d != old and not (leading and d == 0 and column > 0)]
            corrupt[name][i] = v + (rng.choice(choices) - old) * 10**column
    assert prompts.template is not None  # require_one_prefix() refuses a set without one
    other = prompts_for_pairs(
        prompts.tokenizer, prompts.op, corrupt["a"], corrupt["b"], prompts.template, modulus=prompts.modulus,
        few_shot=prompts.prefix or "", answer_digits=prompts.meta.get("answer_digits", 0),
        prepend_bos=prompts.prepend_bos, scoring=prompts.scoring,
    )
    if len(other) != len(prompts):  # b == 0 under // or mod
        raise TaskError(f"{len(prompts) - len(other)} corrupt prompts are undefined for {prompts.op!r} (b == 0); "
                        "vary another place or operand")
    # the same token positions and answer lengths (as counterfactual() requires: answer token k is
    # then the same digit place in both), and an answer that changes
    aligned = (other.lengths == prompts.lengths) & (other.tokens.shape == prompts.tokens.shape)
    aligned &= other.n_answer_tokens == prompts.n_answer_tokens
    for name, index in prompts.positions.items():
        aligned &= other.positions[name] == index if name in other.positions else False
    aligned &= other.answer != prompts.answer
    clean, corrupt_set = prompts[aligned], other[aligned]
    if len(clean) == 0:
        raise TaskError(f"no prompt keeps its token positions when the {place} digit of {operand} changes; "
                        "use a tokenizer that splits numbers into digits")
    meta = dict(dropped=len(prompts) - len(clean), kept=len(clean), place=place, operand=operand)
    return PromptPairs(clean, corrupt_set, vary=f"{operand}_{place}", seed=seed, meta=meta)
