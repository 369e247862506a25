"""The report's plan: what every part of the report runs — how many prompts the evaluation reads,
each stage's sample, layers, positions, steps and folds — decided before the work from the
model's shape, the task, the seed and the budget (never from a clock), and written into the page
so that ``arithinterp report --plan PAGE.html`` runs the same plan again.

The plan sits in the page as JSON, in ``<script type="application/json" id="arithinterp-plan">``
(:data:`PLAN_ELEMENT`). It is read back through a declared schema (:class:`PlanRecord`) before
anything is built from it, and is refused for a model whose weights differ from the model it was
made for (by :func:`~arithinterp.checks.fingerprint`) or a task whose prompts differ.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import pydantic

from arithinterp.errors import ConfigError, ModelMismatchError

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

PLAN_ELEMENT = "arithinterp-plan"  # the id of the page's <script> element that holds the plan
PLAN_VERSION = 1

# A stage's choices are plain JSON: counts, flags, names, and lists of them (layers, positions, sizes)
Choice = Union[bool, int, float, str, None, list[Union[bool, int, float, str, None]]]


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid", frozen=True)


class TaskRecord(_Strict):
    """What the report's prompts are made from (``write_report``'s arguments)."""

    limit: int
    seed: int
    template: Optional[str] = None
    few_shot: Union[int, str] = 0
    operands: Union[None, str, list[int]] = None
    correct_only: bool = True
    stages: list[str]
    digest: str  # sha256 of the prompts' texts and answers, in order: the same task makes the same prompts


class StageRecord(_Strict):
    """One stage's plan: its share of the budget and its cost (reference seconds), what it runs."""

    share: float
    seconds: float
    choices: dict[str, Choice] = {}


class PlanRecord(_Strict):
    """The plan as the page records it.

    Attributes:
        version: The layout of this record (:data:`PLAN_VERSION`).
        model: The model's spec or id, as the page names it.
        fingerprint: The model's weight fingerprint (:func:`arithinterp.checks.fingerprint`).
        task: What the prompts are made from, and their digest.
        budget: Seconds of model work at the reference rate (:mod:`arithinterp.report.work`).
        memory: Bytes each stage's batches may use beyond the model.
        reference: The reference rate the budget is counted at (:data:`~arithinterp.report.work.REFERENCE`).
        deadline: Wall-clock seconds the plan was fitted to on the machine that made it, or None.
        evaluated: Prompts the evaluation read (the first ones of the seeded order).
        stages: Each planned stage's record, by name.
    """

    version: int
    model: str
    fingerprint: str
    task: TaskRecord
    budget: float
    memory: int
    reference: str
    deadline: Optional[float] = None
    evaluated: int
    stages: dict[str, StageRecord] = {}


def task_digest(prompts: PromptSet) -> str:
    """A digest of the prompts a plan was made on: their texts and answers, in order.

    Args:
        prompts: The report's prompts, before the evaluation samples them.

    Returns:
        16 hex digits.
    """
    digest = hashlib.sha256()
    for text, answer in zip(prompts.texts, prompts.answer.tolist()):
        digest.update(f"{text}\x1f{answer}\x1e".encode())
    return digest.hexdigest()[:16]


def plan_html(record: PlanRecord) -> str:
    """The ``<script>`` element that carries ``record`` in a page (``</`` escaped, so that no value
    can close the element)."""
    text = record.model_dump_json().replace("</", "<\\/")
    return f"<script type='application/json' id='{PLAN_ELEMENT}'>{text}</script>"


_ELEMENT = re.compile(rf"<script type=['\"]application/json['\"] id=['\"]{PLAN_ELEMENT}['\"]>(.*?)</script>", re.S)


def read_plan(page: Union[str, os.PathLike]) -> PlanRecord:
    """The plan recorded in a report page.

    Args:
        page: The page's path.

    Returns:
        The plan, checked against :class:`PlanRecord`.

    Raises:
        ConfigError: The file cannot be read, holds no plan (not a report page, or one written
            before pages carried their plan), or its plan does not match the schema.
    """
    path = Path(page).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"plan: cannot read {page} ({error}); give a report page written by arithinterp") from None
    found = _ELEMENT.search(text)
    if found is None:
        raise ConfigError(f"plan: {page} holds no report plan (no <script id='{PLAN_ELEMENT}'> element); give a "
                          "page written by `arithinterp report`")
    try:
        raw = json.loads(html.unescape(found.group(1)) if "&quot;" in found.group(1) else found.group(1))
        record = PlanRecord.model_validate(raw)
    except (json.JSONDecodeError, pydantic.ValidationError) as error:
        raise ConfigError(f"plan: the plan in {page} is damaged or of another layout: "
                          f"{' '.join(str(error).split())[:300]}") from None
    if record.version != PLAN_VERSION:
        raise ConfigError(f"plan: the plan in {page} has layout version {record.version}; this arithinterp reads "
                          f"version {PLAN_VERSION}")
    return record


def check_plan_model(record: PlanRecord, fingerprint: str, model: str, page: Any) -> None:
    """Refuse a plan made for another model.

    Raises:
        ModelMismatchError: The weights' fingerprints differ.
    """
    if record.fingerprint != fingerprint:
        raise ModelMismatchError(
            f"plan: the plan in {page} was made for {record.model} (weights fingerprint {record.fingerprint}), not "
            f"for {model} (fingerprint {fingerprint}); replay it on that model, or run the report without --plan")


def check_plan_task(record: PlanRecord, digest: str, page: Any) -> None:
    """Refuse a plan whose prompts differ from the ones made now (another tokenizer, or another
    version's prompt building).

    Raises:
        ConfigError: The prompts' digests differ.
    """
    if record.task.digest != digest:
        raise ConfigError(
            f"plan: the prompts made from the plan's task (template, few-shot, operands, limit, seed) differ from "
            f"the ones the plan in {page} was made on (digest {digest}, not {record.task.digest}); the task "
            "cannot be replayed on this model and version")
