"""The report's prompts and their evaluation: the task's prompts with the user's template,
few-shot prefix and operands (:func:`report_prompts`), and a seeded sample of them evaluated
within the evaluation's share of the budget (:func:`evaluate_within`).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Optional, Union

from arithinterp.errors import ConfigError
from arithinterp.report.budget import Budget, secs
from arithinterp.tasks.operators import parse_operands  # noqa: F401 - the report's operands, parsed as the tasks parse them

if TYPE_CHECKING:
    from arithinterp.tasks import Evaluation, PromptSet
    from arithinterp.types import HookedModel


#: The most operand pairs a report builds (every pair of ``operands`` is built before ``limit`` are sampled).
MAX_OPERAND_PAIRS = 2**24


def check_operand_pairs(values: list[int]) -> None:
    """Refuse operands whose pairs a report cannot build (before the model loads).

    Args:
        values: The operand values (:func:`parse_operands`).

    Raises:
        ConfigError: More than :data:`MAX_OPERAND_PAIRS` pairs.
    """
    if len(values) ** 2 > MAX_OPERAND_PAIRS:
        raise ConfigError(f"operands gives {len(values):,} values, {len(values) ** 2:,} operand pairs; the report "
                          f"builds at most {MAX_OPERAND_PAIRS:,} operand pairs ({math.isqrt(MAX_OPERAND_PAIRS):,} "
                          "values)")


def check_report_template(model: Any, template: str) -> None:
    """Refuse a template the report's task cannot use, before the model loads (fields, operands, the
    operator of a zoo model's task).

    Args:
        model: The model spec (``zoo:NAME`` names its task's operator) or a loaded model (``+``).
        template: The template.

    Raises:
        TaskError: An unknown field, ``{a}`` or ``{b}`` missing or repeated, another operator's symbol.
        ModelSpecError: An unknown zoo model.
    """
    from arithinterp.tasks.templates import check_template

    op = "+"
    if isinstance(model, str) and model.startswith("zoo:"):
        from arithinterp.models.zoo import get_entry

        op = get_entry(model).task.op
    check_template(template, op)


def _check_context(model: HookedModel, prompts: PromptSet) -> None:
    n_ctx = getattr(model.cfg, "n_ctx", None)
    longest = int(prompts.lengths.max()) + prompts.answer_tokens.shape[1]
    if isinstance(n_ctx, int) and longest > n_ctx:
        raise ConfigError(f"the prompts with their answers are up to {longest} tokens long, more than the model's "
                          f"context of {n_ctx} tokens; use fewer few-shot examples or a shorter template")


def report_prompts(model: HookedModel, spec: str, limit: int, seed: int, template: Optional[str],
                   few_shot: Union[int, str], operands: Any) -> PromptSet:
    """The report's prompts: the model's own task (a zoo task, else single-token addition), with
    the template, few-shot prefix and operand values replaced where given; a seeded sample."""
    import torch

    from arithinterp.models.zoo import get_entry, task_prompts
    from arithinterp.tasks import number_check, prompts_for_pairs

    if template is None and not few_shot and operands is None:
        return task_prompts(model, spec, limit, seed)
    op, modulus, answer_digits, default_template = "+", None, 0, "{a}+{b}="
    if spec.startswith("zoo:"):
        task = get_entry(spec).task
        op, modulus, answer_digits, default_template = task.op, task.modulus, task.answer_digits, task.template
        values = list(range(*task.a_range))
    else:
        values = number_check(model, range(100))["single_token"]
    if operands is not None:
        values = parse_operands(operands)
    check_operand_pairs(values)
    a = torch.tensor(values).repeat_interleave(len(values))
    b = torch.tensor(values).repeat(len(values))
    pick = torch.randperm(len(a), generator=torch.Generator().manual_seed(seed))[:limit]
    # one prompt first: a few-shot prefix or template that cannot fit the context is refused in a
    # moment, not after the whole set is built
    _check_context(model, prompts_for_pairs(model, op, a[pick[:1]].tolist(), b[pick[:1]].tolist(),
                                            template or default_template, modulus=modulus,
                                            answer_digits=answer_digits, few_shot=few_shot, seed=seed))
    prompts = prompts_for_pairs(model, op, a[pick].tolist(), b[pick].tolist(), template or default_template,
                                modulus=modulus, answer_digits=answer_digits, few_shot=few_shot, seed=seed)
    _check_context(model, prompts)
    return prompts


WARM_UP = 8  # prompts evaluated first, untimed: they pay the one-off costs (the engine's checks of the model)
EVAL_CHUNK = 64  # prompts per later round of the evaluation; each round's time gives the rate per prompt
EVAL_CAP = 0.5  # the largest share of the whole budget the evaluation may take to reach the stages' minimums


def correct_needed(stages: list[str]) -> int:
    """The correctly answered prompts the evaluation aims for: every chosen stage's minimum that
    counts them (probes, neurons, digits), and twice the pair minimum for the stages that use
    counterfactual pairs (a correct prompt gives at most one pair, and pairs whose answers start
    with the same token are left out).

    Args:
        stages: The chosen stages' names.

    Returns:
        The number of correct prompts; 0 when no chosen stage uses them.
    """
    from arithinterp.report.stages import MINIMUMS  # the stages import this module

    needs = [MINIMUMS[name][0] for name in ("digits", "probes", "neurons") if name in stages]
    if any(name in stages for name in ("patching", "fourier", "circuits", "features", "causal")):
        needs.append(2 * MINIMUMS["patching"][0])
    if "errors" in stages:  # a third is held out, and it needs the minimum of each kind
        needs.append(3 * MINIMUMS["errors"][0])
    return max(needs, default=0)


def evaluate_within(model: HookedModel, prompts: PromptSet, seconds: float, cap: float, budget: Budget, seed: int,
                    need: int = 0) -> tuple[PromptSet, Evaluation, float, str]:
    """Evaluate a seeded sample of ``prompts``: rounds of :data:`EVAL_CHUNK` prompts (in a seeded
    order) while the ``seconds`` of the evaluation's share last, and past them, up to ``cap``
    seconds, until ``need`` prompts are answered correctly (the stages' minimums,
    :func:`correct_needed`). The first :data:`WARM_UP` prompts pay the one-off costs and are not
    timed; the rate per prompt comes from the later rounds (``0`` prompts: the warm-up's).

    Returns ``(prompts evaluated, their evaluation, seconds per prompt, sample sentence)``; when
    ``need`` is not reached, the sentence says how many prompts it would take and how long."""
    import torch

    from arithinterp.tasks import Evaluation

    n = len(prompts)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    batch = budget.batch_size(model, int(prompts.lengths.max()), n_new=int(prompts.answer_tokens.shape[1]))
    start = time.perf_counter()
    parts = [prompts[order[:WARM_UP]].evaluate(model, batch_size=batch)]
    done, timed, timed_seconds = min(WARM_UP, n), 0, 0.0
    per_prompt = (time.perf_counter() - start) / done  # until a timed round: an over-estimate

    def n_correct() -> int:
        return sum(int(part.correct.sum()) for part in parts)

    while done < n:
        elapsed = time.perf_counter() - start
        limit = seconds if n_correct() >= need else cap
        # the first timed round small; later ones a batch, but a quarter of the share at most: a round
        # that ends far past the stages' minimums, or past the share, is time the stages do not get
        size = min(max(EVAL_CHUNK, min(batch, int(0.25 * seconds / per_prompt))) if timed else WARM_UP, n - done)
        if timed and elapsed + size * per_prompt > limit:  # the next round would overrun: a smaller last one, or stop
            size = int(max(limit - elapsed, 0.0) / per_prompt)
            if size < min(EVAL_CHUNK, n - done) // 4:
                break
        round_start = time.perf_counter()
        parts.append(prompts[order[done:done + size]].evaluate(model, batch_size=batch))
        timed, timed_seconds, done = timed + size, timed_seconds + time.perf_counter() - round_start, done + size
        per_prompt = timed_seconds / timed
    chosen = order[:done]
    keep, where = chosen.sort()  # the sample in the prompt set's order, and where each was evaluated
    joined = Evaluation(torch.cat([p.correct for p in parts]), torch.cat([p.model_answer for p in parts]),
                        [t for p in parts for t in p.answer_text], torch.cat([p.generated_tokens for p in parts]))
    evaluation = joined[where]
    took = time.perf_counter() - start
    note = (f"all {n:,} prompts evaluated in {secs(took)}" if done == n else
            f"sampled {done:,} of {n:,} prompts in {secs(took)} ({secs(seconds)} budget"
            + (f", extended up to {secs(cap)} to reach {need} correct)" if took > seconds else ")"))
    correct = int(evaluation.correct.sum())
    if correct < need:
        accuracy = max(correct, 1) / done
        wanted = math.ceil(need / accuracy)
        note += (f"; {correct} answered correctly, fewer than the {need} the stages need"
                 + (f": at this accuracy ({accuracy:.1%}) that takes about {wanted:,} prompts "
                    f"(about {secs(wanted * per_prompt)} to evaluate); give the report more time (--budget) "
                    if wanted <= n else
                    f", and all {n:,} prompts hold only {correct} (about {wanted:,} would be needed at "
                    f"{accuracy:.1%}): use more operand values (--operands), more prompts (--limit) ")
                 + "or an easier task (smaller operands, more --few-shot examples)")
    return prompts[keep], evaluation, per_prompt, note
