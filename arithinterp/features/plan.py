"""How a model's transcoders are trained: the task, the held-out split and the settings, planned from the
model's shape and the task alone, and one function that runs the plan and caches the result.

``arithinterp train-transcoders MODEL`` (any model the toolkit loads: a zoo name, a Hugging Face
folder, a ``.gguf`` file, ``pkg:gemma-3-270m``) runs :func:`train_planned` on :func:`plan_transcoders`.

**The task.** Addition prompts over the operand values (a zoo model's own task and operands;
otherwise ``{a}+{b}=`` over 0–99, with ``few_shot`` solved examples before each prompt, 3 by default
for a model that is not a zoo model: pretrained models need them to answer). Prompts are drawn from
several few-shot prefixes, each prompt under one.

**Held out by operand range and by prefix.** A block of the operand grid — ``a`` in the fifth of
its values from 40% to 60% of their range, ``b`` in the fifth from 20% to 40% — is never trained
on, and the held-out prompts put that block under few-shot prefixes never trained on either (for a
zoo model, which takes no prefix, the block alone). The numbers the card gives (FVU, the
replacement model's agreement and KL) are measured there, so they say how the transcoders carry
the computation on problems and contexts they have not seen.

**The settings** (:class:`TranscoderPlan`) follow from the model's shape (``d_model``, layers,
the work of a forward per token) and the task (how many distinct MLP inputs it has); nothing is
looked up by the model's name. What each choice rests on is measured in ``docs/features.md``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from arithinterp.checks import check_model, fingerprint
from arithinterp.errors import ConfigError
from arithinterp.features.transcoder import Transcoders, transcoders_digest
from arithinterp.outputs import check_target, write_folder, writes
from arithinterp.tasks import PromptSet, concat
from arithinterp.types import HookedModel, NonNegativeInt, PathLike, Seed, checked

#: Training prompts under each few-shot prefix, and the prefixes trained on / held out.
TRAIN_PREFIXES = 4
HELD_OUT_PREFIXES = 2
#: Prompts the held-out metrics are measured on.
HELD_OUT_PROMPTS = 200
#: The share of each operand's values in the held-out block, and where the blocks start.
BLOCK = 0.2
BLOCK_START = (0.4, 0.2)
#: Multiply-adds of reading the training prompts may take (the prompts' count follows from it).
READ_BUDGET = 2e13
#: The most training prompts (zoo:add-3digit kept 0.98 of its answers with 10,000 of its 810,000).
MAX_PROMPTS = 10000
#: Distinct training rows per feature, and passes over the distinct rows (both from zoo:add-100).
ROWS_PER_FEATURE = 280
EPOCHS = 40


@dataclasses.dataclass(frozen=True)
class TranscoderPlan:
    """Everything one transcoder training run does, decided before it starts.

    Attributes:
        op: The operator.
        template: The prompt template.
        a_values: The first operand's values.
        b_values: The second operand's values.
        modulus: Answers reduced mod this, or None.
        answer_digits: Answers zero-padded to this many digits (0: plain).
        few_shot: Solved examples before each prompt (0: none).
        train_prefixes: The seeds of the few-shot prefixes trained on.
        held_out_prefixes: The seeds of the prefixes held out.
        held_out_a: The first operand's held-out block ``[lo, hi)``.
        held_out_b: The second operand's held-out block ``[lo, hi)``.
        n_train: Training prompts.
        n_held_out: Held-out prompts.
        n_features: Features per transcoder.
        k: Features that fire per row (TopK).
        steps: Adam steps per layer.
        batch_size: Rows per step.
        lr: Adam's learning rate.
        skip: Whether the transcoders have a linear skip.
        seed: Seeds the prompts, the split and the training.
        zoo: The zoo model whose task this is, or ``""``.
    """

    op: str
    template: str
    a_values: tuple
    b_values: tuple
    modulus: Optional[int]
    answer_digits: int
    few_shot: int
    train_prefixes: tuple
    held_out_prefixes: tuple
    held_out_a: tuple
    held_out_b: tuple
    n_train: int
    n_held_out: int
    n_features: int
    k: int
    steps: int
    batch_size: int
    lr: float
    skip: bool
    seed: int
    zoo: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-able data (the card records it)."""
        out = dataclasses.asdict(self)
        out["a_values"] = _span(self.a_values)
        out["b_values"] = _span(self.b_values)
        return out


def _span(values: Sequence[int]) -> str:
    values = list(values)
    if values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def _block(values: Sequence[int], start: float) -> tuple[int, int]:
    """The held-out block of an operand: the fifth of its sorted values from ``start`` of the way."""
    values = sorted(values)
    lo = int(len(values) * start)
    hi = max(lo + 1, int(len(values) * (start + BLOCK)))
    return values[lo], values[min(hi, len(values)) - 1] + 1


def _forward_flops_per_token(model: Any) -> float:
    """A forward's multiply-adds per token of the blocks (attention projections and MLP), from the config."""
    cfg = model.cfg
    d, n_layers = int(cfg.d_model), int(cfg.n_layers)
    d_head, n_heads = int(getattr(cfg, "d_head", d // max(int(cfg.n_heads), 1))), int(cfg.n_heads)
    kv_heads = int(getattr(cfg, "n_key_value_heads", None) or n_heads)
    d_mlp = int(getattr(cfg, "d_mlp", None) or 4 * d)
    gated = bool(getattr(cfg, "gated_mlp", False)) or "gemma" in str(getattr(cfg, "original_architecture", "")).lower()
    attention = d * d_head * (2 * n_heads + 2 * kv_heads)
    mlp = (3 if gated else 2) * d * d_mlp
    return float(n_layers * (attention + mlp))


@checked
def plan_transcoders(model: HookedModel, *, template: Optional[str] = None, few_shot: Optional[NonNegativeInt] = None,
                     operands: Any = None, seed: Seed = 0) -> TranscoderPlan:
    """The training plan for ``model``'s transcoders, from its shape and the task.

    Args:
        model: The hooked model (a zoo model's task is its own).
        template: The prompt template (default: the zoo task's, else ``"{a}+{b}="``).
        few_shot: Solved examples before each prompt (default: 0 for a zoo model, else 3).
        operands: Both operands' values: ``"LO-HI"``, ``"1,5,9"`` or ints (default: the zoo task's, else 0–99).
        seed: Seeds the prompts, the split and the training.

    Returns:
        The plan.

    Raises:
        ConfigError: Fewer than ten operand values (no block can be held out).
    """
    from arithinterp.models.zoo import ZOO, get_entry
    from arithinterp.tasks.operators import parse_operands
    from arithinterp.tasks import prompts_for_pairs

    check_model(model, "plan_transcoders")
    spec = str(getattr(model, "arithinterp_spec", "") or "")
    zoo = spec.removeprefix("zoo:") if spec.startswith("zoo:") and spec.removeprefix("zoo:") in ZOO else ""
    op, modulus, answer_digits = "+", None, 0
    if zoo:
        task = get_entry(spec).task
        op, modulus, answer_digits = task.op, task.modulus, task.answer_digits
        a_values, b_values = list(range(*task.a_range)), list(range(*task.b_range))
        template = template or task.template
        few_shot = 0 if few_shot is None else few_shot
    else:
        a_values = b_values = list(range(100))
        template = template or "{a}+{b}="
        few_shot = 3 if few_shot is None else few_shot
    if operands is not None:
        a_values = b_values = parse_operands(operands)
    if min(len(a_values), len(b_values)) < 10:
        raise ConfigError(f"transcoders are trained with a block of operands held out, which needs at least 10 "
                          f"values of each operand; got {len(a_values)} and {len(b_values)}")
    held_a, held_b = _block(a_values, BLOCK_START[0]), _block(b_values, BLOCK_START[1])
    in_block = sum(held_a[0] <= a < held_a[1] for a in a_values) * sum(held_b[0] <= b < held_b[1] for b in b_values)
    grid = len(a_values) * len(b_values) - in_block
    d = int(model.cfg.d_model)
    # the prompts a budget of reading allows (READ_BUDGET multiply-adds: minutes on two CPU cores), at
    # most the training grid and MAX_PROMPTS, at least 1,000
    tokens = int(prompts_for_pairs(model, op, [a_values[0]], [b_values[0]], template, modulus=modulus,
                                   answer_digits=answer_digits, few_shot=few_shot, seed=seed).tokens.shape[1])
    n_train = int(min(grid, MAX_PROMPTS, max(1000, READ_BUDGET / (tokens * _forward_flops_per_token(model)))))
    # distinct MLP inputs per layer: the positions that see both operands are new in every prompt
    # (about two of them), the others repeat across prompts (measured on zoo:add-100: 18,000 of 10,000 prompts)
    distinct_rows = 2 * n_train
    # about 280 distinct rows per feature (zoo:add-100: 64 features kept 0.985 of held-out answers; larger
    # dictionaries leave features that fire on a handful of training rows and never on held-out ones)
    n_features = int(min(8 * d, max(64, 32 * round(distinct_rows / ROWS_PER_FEATURE / 32))))
    k = int(min(64, n_features // 4, max(16, 16 * round(math.sqrt(d / 128)))))
    batch_size = 1024
    steps = int(min(2000, max(200, math.ceil(EPOCHS * distinct_rows / batch_size))))
    prefixes = tuple(range(seed, seed + TRAIN_PREFIXES)) if few_shot else (seed,)
    held_prefixes = tuple(range(seed + 1000, seed + 1000 + HELD_OUT_PREFIXES)) if few_shot else (seed,)
    return TranscoderPlan(op=op, template=template, a_values=tuple(a_values), b_values=tuple(b_values),
                          modulus=modulus, answer_digits=answer_digits, few_shot=few_shot, train_prefixes=prefixes,
                          held_out_prefixes=held_prefixes, held_out_a=held_a, held_out_b=held_b, n_train=n_train,
                          n_held_out=min(HELD_OUT_PROMPTS, in_block), n_features=n_features, k=k,
                          steps=steps, batch_size=batch_size, lr=2e-3, skip=False, seed=seed, zoo=zoo)


def _pairs(plan: TranscoderPlan, held: bool, n: int, seed: int) -> list[tuple[int, int]]:
    """``n`` operand pairs (a seeded sample, without repeats) inside or outside the held-out block."""
    (a_lo, a_hi), (b_lo, b_hi) = plan.held_out_a, plan.held_out_b
    inside = [(a, b) for a in plan.a_values for b in plan.b_values if (a_lo <= a < a_hi and b_lo <= b < b_hi) == held]
    order = torch.randperm(len(inside), generator=torch.Generator().manual_seed(seed))[:n]
    return [inside[i] for i in order.tolist()]


def _prompts(model: Any, plan: TranscoderPlan, pairs: list, prefix_seed: int) -> PromptSet:
    from arithinterp.tasks import prompts_for_pairs

    return prompts_for_pairs(model, plan.op, [a for a, _ in pairs], [b for _, b in pairs], plan.template,
                             modulus=plan.modulus, answer_digits=plan.answer_digits, few_shot=plan.few_shot,
                             seed=prefix_seed)


@checked
def plan_prompts(model: HookedModel, plan: TranscoderPlan) -> tuple[PromptSet, PromptSet]:
    """The plan's training prompts (outside the held-out block, under the training prefixes) and
    held-out prompts (inside it, under the held-out prefixes).

    Args:
        model: The hooked model.
        plan: The plan.

    Returns:
        ``(train, held_out)``.
    """
    pairs = _pairs(plan, False, plan.n_train, plan.seed)
    parts = [pairs[i :: len(plan.train_prefixes)] for i in range(len(plan.train_prefixes))]
    train = concat([_prompts(model, plan, part, seed) for part, seed in zip(parts, plan.train_prefixes) if part])
    held = _pairs(plan, True, plan.n_held_out, plan.seed + 1)
    parts = [held[i :: len(plan.held_out_prefixes)] for i in range(len(plan.held_out_prefixes))]
    held_out = concat([_prompts(model, plan, part, seed) for part, seed in zip(parts, plan.held_out_prefixes) if part])
    return train, held_out


#: Values of each operand in the operand plots' grid (every units digit equally often).
GRID_VALUES = 50


@checked
def plan_grid(model: HookedModel, plan: TranscoderPlan) -> PromptSet:
    """The grid the transcoders' operand plots are read over: :data:`GRID_VALUES` values of each
    operand (a seeded sample that holds every units digit equally often where the values allow),
    all their pairs, under the first training prefix.

    Args:
        model: The hooked model.
        plan: The plan.

    Returns:
        The grid's prompts.
    """
    generator = torch.Generator().manual_seed(plan.seed + 2)

    def sample(values: Sequence[int]) -> list[int]:
        if len(values) <= GRID_VALUES:
            return sorted(values)
        by_digit: dict[int, list[int]] = {}
        for i in torch.randperm(len(values), generator=generator).tolist():
            by_digit.setdefault(values[i] % 10, []).append(values[i])
        pools, chosen = [by_digit[digit] for digit in sorted(by_digit)], []
        while len(chosen) < GRID_VALUES:  # a value of each units digit in turn
            chosen += [pool.pop() for pool in pools if pool][: GRID_VALUES - len(chosen)]
        return sorted(chosen)

    a_values, b_values = sample(plan.a_values), sample(plan.b_values)
    pairs = [(a, b) for a in a_values for b in b_values]
    return _prompts(model, plan, pairs, plan.train_prefixes[0])


@checked
def transcoder_plots(model: HookedModel, transcoders: Transcoders, *, progress: bool = True) -> Any:
    """The operand plots of ``model``'s transcoders: the ones saved beside them in the cache when
    those are the transcoders given, else read now over the plan's grid (:func:`plan_grid`).

    Args:
        model: The hooked model.
        transcoders: The transcoders.
        progress: Show a progress bar while reading.

    Returns:
        The :class:`~arithinterp.features.operand_plots.OperandPlots`.
    """
    from arithinterp.features.cache import find_operand_plots
    from arithinterp.features.operand_plots import operand_plots

    cached = find_operand_plots(model)
    if cached is not None and cached.meta.get("transcoders") == transcoders_digest(transcoders):
        return cached
    return operand_plots(model, plan_grid(model, plan_transcoders(model)), transcoders, progress=progress)


@writes
@checked
def train_planned(model: HookedModel, plan: TranscoderPlan, out: Optional[PathLike] = None, *,
                  overwrite: bool = False, progress: bool = True) -> tuple[Transcoders, dict[str, Any]]:
    """Train ``model``'s transcoders as ``plan`` says, save them with a ``card.json`` and return both.

    Args:
        model: The hooked model.
        plan: The plan (:func:`plan_transcoders`).
        out: The folder to write (default: the model's cache folder,
            :func:`~arithinterp.features.cache.cache_folder`, where the report, the notebooks and
            :func:`~arithinterp.features.attribution_graph` find them).
        overwrite: Replace what ``out`` holds (refused before any work otherwise).
        progress: Show progress bars.

    Returns:
        ``(transcoders, card)``; the card holds the plan, the wall time and the held-out numbers. The
        transcoders' operand plots over :func:`plan_grid` are saved beside them (``operand_plots/``).
    """
    from arithinterp.features.cache import PLOTS_FOLDER, cache_folder
    from arithinterp.features.operand_plots import operand_plots
    from arithinterp.features.training import train_transcoders

    target = check_target(Path(out) if out is not None else cache_folder(model), overwrite=overwrite, what="out",
                          folder=True)
    train, held_out = plan_prompts(model, plan)
    start = time.perf_counter()
    transcoders = train_transcoders(model, train, held_out=held_out, n_features=plan.n_features, k=plan.k,
                                    steps=plan.steps, batch_size=plan.batch_size, lr=plan.lr, skip=plan.skip,
                                    seed=plan.seed, distinct=True, sequential=True, progress=progress)
    plots = operand_plots(model, plan_grid(model, plan), transcoders, progress=progress)
    wall = round(time.perf_counter() - start, 1)
    card = dict(model=str(getattr(model, "arithinterp_spec", "") or ""), fingerprint=fingerprint(model),
                plan=plan.as_dict(), wall_seconds=wall, torch_threads=torch.get_num_threads(),
                n_train_prompts=len(train), n_held_out_prompts=len(held_out),
                layers=transcoders.metrics["layers"], replacement=transcoders.metrics["replacement"])
    with write_folder(target, overwrite=overwrite) as folder:  # the transcoders and their plots, whole
        transcoders.save(folder, overwrite=True, extra_files={"card.json": json.dumps(card, indent=1)})
        plots.save(folder / PLOTS_FOLDER)
    return transcoders, dict(card, out=str(target))
