"""The report's prompts and their evaluation: the task's prompts with the user's template,
few-shot prefix and operands (:func:`report_prompts`), what evaluating one costs in model work
(:func:`evaluation_seconds`), and a seeded sample of them evaluated (:func:`evaluate_planned`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Union

from arithinterp.errors import ConfigError
from arithinterp.report.work import Shape, work_seconds
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


EVAL_CHUNK = 64  # prompts per round of the evaluation past its share, while the stages lack correct prompts
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


def prompt_positions(prompts: PromptSet, n_read: int = 1) -> float:
    """Positions one prompt's forward computes, on average: a prefix that several prompts share
    is computed once for them (as the engine does, :func:`~arithinterp.engine.shared_prefixes.shared_prefix`).

    Args:
        prompts: The prompts.
        n_read: Positions read at the end of each (never part of the shared prefix).

    Returns:
        The positions per prompt.
    """
    from arithinterp.engine.shared_prefixes import shared_prefix

    n, width = len(prompts), int(prompts.tokens.shape[1])
    if n == 0:
        return 0.0
    mean = float(prompts.lengths.float().mean())
    if not prompts.uniform_length or n < 2:
        return mean
    shared = shared_prefix(prompts.tokens, n_read)
    if shared is None:
        return float(width)
    k, representatives, _ = shared
    return width - k + k * len(representatives) / n


def evaluation_seconds(model: HookedModel, prompts: PromptSet, batch: int) -> float:
    """Reference seconds of one prompt's greedy evaluation (its positions through every block, then
    each answer token but the last through every block again, each answer token unembedded over
    the vocabulary; each batch steps every block once per token generated, and once for the
    prompt and once for a shared prefix).

    Args:
        model: The hooked model.
        prompts: The prompts.
        batch: Prompts per forward.

    Returns:
        Seconds per prompt at the reference rate (:mod:`arithinterp.report.work`).
    """
    n_new = int(prompts.answer_tokens.shape[1])
    shape = Shape.of(model)
    return work_seconds(shape, token_layers=shape.n_layers * (prompt_positions(prompts) + n_new - 1), unembeds=n_new,
                        calls=shape.n_layers * (n_new + 2) / max(batch, 1))


def evaluate_planned(model: HookedModel, prompts: PromptSet, first: int, cap: int, need: int, batch: int,
                     seed: int) -> tuple[PromptSet, Evaluation, str]:
    """Evaluate the first ``first`` prompts of a seeded order of ``prompts`` and, while fewer than
    ``need`` are answered correctly (the stages' minimums, :func:`correct_needed`), more in rounds
    of :data:`EVAL_CHUNK`, up to ``cap`` prompts in all. What is evaluated depends on the model's
    answers, the seed and the counts only.

    Args:
        model: The hooked model.
        prompts: Every prompt of the task.
        first: Prompts evaluated whatever the answers (the evaluation's share).
        cap: The most prompts evaluated to reach ``need``.
        need: Correctly answered prompts the stages need.
        batch: Prompts per forward.
        seed: Seeds the order.

    Returns:
        ``(prompts evaluated in the set's order, their evaluation, sample sentence)``; when
        ``need`` is not reached, the sentence says how many prompts it would take and what budget.
    """
    import torch

    from arithinterp.tasks import Evaluation

    n = len(prompts)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    done = min(max(first, 1), n)
    parts = [prompts[order[:done]].evaluate(model, batch_size=batch)]

    def n_correct() -> int:
        return sum(int(part.correct.sum()) for part in parts)

    while done < min(cap, n) and n_correct() < need:
        size = min(EVAL_CHUNK, min(cap, n) - done)
        parts.append(prompts[order[done:done + size]].evaluate(model, batch_size=batch))
        done += size
    keep, where = order[:done].sort()  # the sample in the prompt set's order, and where each was evaluated
    joined = Evaluation(torch.cat([p.correct for p in parts]), torch.cat([p.model_answer for p in parts]),
                        [t for p in parts for t in p.answer_text], torch.cat([p.generated_tokens for p in parts]))
    evaluation = joined[where]
    note = (f"all {n:,} prompts evaluated" if done == n else
            f"sampled {done:,} of {n:,} prompts" + (f" ({first:,} for the evaluation's share, then more to reach "
                                                    f"{need} correct)" if done > first else ""))
    correct = int(evaluation.correct.sum())
    if correct < need:
        accuracy = max(correct, 1) / done
        wanted = math.ceil(need / accuracy)
        note += (f"; {correct} answered correctly, fewer than the {need} the stages need"
                 + (f": at this accuracy ({accuracy:.1%}) that takes about {wanted:,} prompts; give the report more "
                    "time (--budget) " if wanted <= n else
                    f", and all {n:,} prompts hold only {correct} (about {wanted:,} would be needed at "
                    f"{accuracy:.1%}): use more operand values (--operands), more prompts (--limit) ")
                 + "or an easier task (smaller operands, more --few-shot examples)")
    return prompts[keep], evaluation, note
