"""The model zoo: small arithmetic transformers trained with :mod:`arithinterp.models.train`
and shipped inside the package (``models/checkpoints/NAME/``).

Each entry says what the model computes (its task), how its tokenizer and architecture are
built, and the recipe that reproduces it. The measured accuracy lives next to the weights in
``card.json`` (written by training), so the registry never states a number it did not measure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from arithinterp.cyclic import CONCEPTS, MONTHS, WEEKDAYS
from arithinterp.errors import ModelSpecError, accepted
from arithinterp.types import HookedModel, checked

CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"


@dataclass(frozen=True)
class Task:
    """The arithmetic a zoo model was trained on.

    ``template`` uses ``{a}`` and ``{b}``; the answer follows the template directly.
    ``answer_digits`` > 0 means the answer is written as that many zero-padded digit tokens.
    ``names`` writes ``a`` and the answer as words (weekdays, months: :mod:`arithinterp.cyclic`);
    ``family`` names the task in a model's card when it was trained on several.
    """

    op: str
    a_range: tuple[int, int]  # [start, stop)
    b_range: tuple[int, int]
    template: str
    modulus: Optional[int] = None
    answer_digits: int = 0
    names: Optional[tuple[str, ...]] = None
    family: str = "addition"

    @property
    def op_name(self) -> str:
        return "mod" if self.modulus else self.op


@dataclass(frozen=True)
class Recipe:
    """How a zoo model is trained (AdamW with linear warm-up, constant rate after)."""

    steps: int
    lr: float = 1e-3
    weight_decay: float = 1.0
    betas: tuple[float, float] = (0.9, 0.98)
    warmup: int = 10
    batch_size: Optional[int] = None  # None = full batch
    train_frac: float = 0.3
    seed: int = 0
    eval_every: int = 500
    stop_at_accuracy: Optional[float] = None  # stop once held-out accuracy reaches this ...
    steps_after_stop: int = 0  # ... and this many steps later (lets a grokked circuit clean up)
    snapshot_every: int = 0  # save float16 weights every this many steps (0 = none)
    monitor_size: int = 4096  # held-out problems checked every eval_every steps


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    purpose: str
    tokenizer: str  # "number:MAX", "calendar:MAX" (numbers, weekday and month names) or "digit"
    config: dict[str, Any]
    task: Task
    recipe: Recipe
    target: str  # what the model must reach, in words
    prepend_bos: bool = True
    extra_tasks: tuple[Task, ...] = ()  # further task families trained into the same model

    @property
    def tasks(self) -> tuple[Task, ...]:
        """Every task family the model was trained on, its main ``task`` first."""
        return (self.task, *self.extra_tasks)

    @property
    def directory(self) -> Path:
        return CHECKPOINT_DIR / self.name

    def card(self) -> dict[str, Any]:
        """The measured facts written by training (accuracy, wall time, step count)."""
        path = self.directory / "card.json"
        if not path.exists():
            return {}
        return json.loads(path.read_text())

    def snapshot_steps(self) -> list[int]:
        return [int(s) for s in self.card().get("snapshot_steps", [])]


def _config(n_layers: int, d_model: int, n_heads: int, d_mlp: int, n_ctx: int, norm: Optional[str]):
    return dict(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        d_head=d_model // n_heads,
        d_mlp=d_mlp,
        n_ctx=n_ctx,
        act_fn="relu",
        normalization_type=norm,
        positional_embedding_type="standard",
    )


_THREE_DIGIT = Task(op="+", a_range=(100, 1000), b_range=(100, 1000), template="{a}+{b}=", answer_digits=4)

ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in [
        ZooEntry(
            name="modadd-113",
            description="(a + b) mod 113 with tokens `a b =`; Nanda et al. 2023 architecture",
            purpose="Grokking and Fourier circuits: key frequencies, restricted/excluded loss, progress measures.",
            tokenizer="number:112",
            config=_config(1, 128, 4, 512, 3, None),
            task=Task(op="+", a_range=(0, 113), b_range=(0, 113), template="{a} {b} =", modulus=113),
            recipe=Recipe(
                steps=15000, lr=3e-3, weight_decay=1.0, train_frac=0.3, eval_every=100,
                stop_at_accuracy=0.999, steps_after_stop=1500, snapshot_every=400,
            ),
            target="grokked: >= 99.5% on the held-out 70% of pairs",
            prepend_bos=False,
        ),
        ZooEntry(
            name="add-100",
            description="a + b for a, b in 0..99, every number one token, prompt `{a}+{b}=`",
            purpose="Helix / Fourier number features, activation patching, heuristic neurons.",
            tokenizer="number:198",
            config=_config(2, 128, 4, 512, 8, "LN"),
            task=Task(op="+", a_range=(0, 100), b_range=(0, 100), template="{a}+{b}="),
            recipe=Recipe(steps=6000, lr=1e-3, weight_decay=0.5, train_frac=0.8, batch_size=1000, eval_every=100,
                          stop_at_accuracy=0.999),
            target=">= 99% on held-out pairs",
        ),
        ZooEntry(
            name="add-cyclic",
            description="a + b for a, b in 0..99 (`{a}+{b}=`) and weekday / month arithmetic "
                        "(`Monday + 3 days =`, `March + 5 months =`, offsets 0..99), one vocabulary",
            purpose="Cyclic concepts: do addition and weekday / month arithmetic share features and circuits?",
            tokenizer="calendar:198",
            config=_config(2, 128, 4, 512, 8, "LN"),
            task=Task(op="+", a_range=(0, 100), b_range=(0, 100), template="{a}+{b}="),
            extra_tasks=(
                Task(op="+", a_range=(0, 7), b_range=(0, 100), template="{a} + {b} days =", modulus=7,
                     names=WEEKDAYS, family="weekday"),
                Task(op="+", a_range=(0, 12), b_range=(0, 100), template="{a} + {b} months =", modulus=12,
                     names=MONTHS, family="month"),
            ),
            recipe=Recipe(steps=6000, lr=1e-3, weight_decay=0.5, train_frac=0.8, batch_size=1000, eval_every=100,
                          stop_at_accuracy=0.999, steps_after_stop=200),
            target=">= 99% on held-out problems of every task family",
        ),
        ZooEntry(
            name="add-3digit",
            description="3-digit addition over digit tokens, `123+456=` then 4 zero-padded answer digits",
            purpose="Digit-level circuits (carries), per-digit probes, multi-token answers.",
            tokenizer="digit",
            config=_config(2, 128, 4, 512, 16, "LN"),
            task=_THREE_DIGIT,
            recipe=Recipe(
                steps=8000, lr=1e-3, weight_decay=0.1, train_frac=0.9, batch_size=512, eval_every=250,
                stop_at_accuracy=0.995,
            ),
            target=">= 99% exact match on held-out problems, generated greedily",
        ),
        ZooEntry(
            name="add-3digit-weak",
            description="the add-3digit task, stopped early so it still makes real errors",
            purpose="Probe-based error detection: a model with genuine mistakes.",
            tokenizer="digit",
            config=_config(2, 128, 4, 512, 16, "LN"),
            task=_THREE_DIGIT,
            recipe=Recipe(
                steps=8000, lr=1e-3, weight_decay=0.1, train_frac=0.9, batch_size=512, eval_every=50,
                stop_at_accuracy=0.85,
            ),
            target="75-95% exact match on held-out problems",
        ),
    ]
}


def get_entry(name: str) -> ZooEntry:
    """The registry entry for ``name`` (``zoo:`` prefix optional)."""
    name = name.removeprefix("zoo:").split("@", 1)[0]
    if name not in ZOO:
        raise ModelSpecError(f"unknown zoo model {name!r}; the zoo has {accepted(ZOO)}")
    return ZOO[name]


@checked
def list_zoo() -> list[dict[str, Any]]:
    """The zoo's models, one row each.

    Returns:
        Dicts of ``name``, ``description``, ``layers``, ``d_model``, ``heads``, ``d_mlp``,
        ``held_out_accuracy`` (from the model card) and ``shipped`` (whether the weights are in the package).
    """
    rows = []
    for entry in ZOO.values():
        card = entry.card()
        cfg = entry.config
        rows.append(
            dict(
                name=entry.name,
                description=entry.description,
                layers=cfg["n_layers"],
                d_model=cfg["d_model"],
                heads=cfg["n_heads"],
                d_mlp=cfg["d_mlp"],
                held_out_accuracy=card.get("held_out_accuracy"),
                shipped=(entry.directory / "model.safetensors").exists(),
            )
        )
    return rows


def task_of(entry: ZooEntry, family: Optional[str] = None) -> Task:
    """The task family ``family`` of a zoo model (default its main task)."""
    if family is None:
        return entry.task
    for task in entry.tasks:
        if task.family == family:
            return task
    raise ModelSpecError(f"zoo model {entry.name!r} was not trained on {family!r}; "
                         f"its task families are {accepted([t.family for t in entry.tasks])}")


def zoo_prompts(model: HookedModel, entry: ZooEntry, a: Optional[list[int]] = None, b: Optional[list[int]] = None,
                family: Optional[str] = None):
    """The prompts of a zoo model's task (``family``: one of its task families, default the main
    one), exactly as it was trained on them.

    With ``a`` and ``b`` lists, those pairs; otherwise the full operand grid.
    """
    from arithinterp.tasks import arithmetic, prompts_for_pairs

    task = task_of(entry, family)
    if a is None or b is None:
        prompts = arithmetic(model, task.op, range(*task.a_range), range(*task.b_range), task.template,
                             modulus=task.modulus, answer_digits=task.answer_digits, names=task.names)
    else:
        prompts = prompts_for_pairs(model, task.op, a, b, task.template,
                                    modulus=task.modulus, answer_digits=task.answer_digits, names=task.names)
    if task.family in CONCEPTS and task.modulus == CONCEPTS[task.family].period:
        prompts.meta["concept"] = dict(name=task.family, period=task.modulus)  # as arithinterp.cyclic builds it
    return prompts


def operand_grid(task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (a, b) of a task, a-major: two [N] tensors."""
    a = torch.arange(*task.a_range).repeat_interleave(task.b_range[1] - task.b_range[0])
    b = torch.arange(*task.b_range).repeat(task.a_range[1] - task.a_range[0])
    return a, b


def split(
    entry: ZooEntry, seed: Optional[int] = None, task: Optional[Task] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded train / held-out split of a task's operand grid (default the main task's):
    sorted index tensors. Each task family of a model is split by problem on its own."""
    recipe = entry.recipe
    task = entry.task if task is None else task
    n = (task.a_range[1] - task.a_range[0]) * (task.b_range[1] - task.b_range[0])
    order = torch.randperm(n, generator=torch.Generator().manual_seed(recipe.seed if seed is None else seed))
    n_train = int(round(recipe.train_frac * n))
    return order[:n_train].sort().values, order[n_train:].sort().values


def held_out_prompts(model: HookedModel, entry: ZooEntry, limit: Optional[int] = None, seed: int = 0,
                     family: Optional[str] = None):
    """Prompts for a zoo model's held-out problems (a seeded sample of ``limit`` of them) of one
    task family (default the main one).

    The held-out split is the training split's complement (same seed as training), so these
    are problems the model never saw.
    """
    task = task_of(entry, family)
    held_out = split(entry, task=task)[1]
    if limit is not None and limit < len(held_out):
        pick = torch.randperm(len(held_out), generator=torch.Generator().manual_seed(seed))[:limit]
        held_out = held_out[pick]  # seeded random order: any prefix is a fair sample
    a_all, b_all = operand_grid(task)
    return zoo_prompts(model, entry, a_all[held_out].tolist(), b_all[held_out].tolist(), family)


def evaluate(entry: ZooEntry, model: HookedModel, limit: Optional[int] = None, seed: int = 0) -> dict[str, Any]:
    """Held-out accuracy of a zoo model on its task (greedy generation of every answer token).

    A model trained on several task families is measured on each (``families``, ``limit``
    problems apiece); ``accuracy`` is then the lowest of them.
    """
    families = {}
    for task in entry.tasks:
        prompts = held_out_prompts(model, entry, limit, seed, task.family)
        accuracy = prompts.evaluate(model).accuracy
        families[task.family] = dict(held_out_problems=len(prompts), accuracy=round(accuracy, 5))
    if len(families) == 1:
        return next(iter(families.values()))
    return dict(held_out_problems=sum(f["held_out_problems"] for f in families.values()),
                accuracy=min(f["accuracy"] for f in families.values()), families=families)


def task_prompts(model: HookedModel, spec: str, limit: int = 2000, seed: int = 0):
    """A seeded sample of ``limit`` prompts of the model's own task (zoo) or of single-token addition."""
    from arithinterp.errors import TaskError
    from arithinterp.tasks import number_check, prompts_for_pairs

    if isinstance(limit, bool) or not hasattr(limit, "__index__") or limit < 1:
        raise TaskError(f"limit must be a positive number of prompts (e.g. --limit 1000), got {limit!r}")
    limit = int(limit)
    entry = get_entry(spec) if spec.startswith("zoo:") else None
    if entry is not None:
        a, b = operand_grid(entry.task)
    else:
        single = torch.tensor(number_check(model, range(100))["single_token"])
        if len(single) < 10:
            raise TaskError(f"{spec}: fewer than 10 numbers below 100 are single tokens; pass a zoo model")
        a, b = single.repeat_interleave(len(single)), single.repeat(len(single))
    # sample the operand grid before building prompts: a large grid (810,000 problems) never gets tokenized
    # seeded random order (not sorted): any prefix of the result is a fair sample of the task
    pick = torch.randperm(len(a), generator=torch.Generator().manual_seed(seed))[:limit]
    if entry is not None:
        return zoo_prompts(model, entry, a[pick].tolist(), b[pick].tolist())
    return prompts_for_pairs(model, "+", a[pick].tolist(), b[pick].tolist(), "{a}+{b}=")


def grid_prompts(model: HookedModel, spec: str, side: int = 100):
    """The model's task (zoo) or single-token addition over a full operand grid: every pair of at
    most ``side`` evenly spaced values of each operand (all of them when there are no more), in
    a-major order — the grid :func:`arithinterp.features.feature_maps` reads operand plots over."""
    from arithinterp.errors import TaskError
    from arithinterp.tasks import number_check, prompts_for_pairs

    if isinstance(side, bool) or not isinstance(side, int) or side < 2:
        raise TaskError(f"side must be an int >= 2 (operand values per axis), got {side!r}")
    entry = get_entry(spec) if spec.startswith("zoo:") else None
    if entry is not None:
        a_values, b_values = list(range(*entry.task.a_range)), list(range(*entry.task.b_range))
    else:
        a_values = b_values = [int(v) for v in number_check(model, range(100))["single_token"]]
        if len(a_values) < 10:
            raise TaskError(f"{spec}: fewer than 10 numbers below 100 are single tokens; pass a zoo model")
    a_values = a_values[:: -(-len(a_values) // side)]
    b_values = b_values[:: -(-len(b_values) // side)]
    a = [x for x in a_values for _ in b_values]
    b = [y for _ in a_values for y in b_values]
    if entry is not None:
        return zoo_prompts(model, entry, a, b)
    return prompts_for_pairs(model, "+", a, b, "{a}+{b}=")
