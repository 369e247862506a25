"""The report's stages, one module each: every module here declares one
:class:`~arithinterp.report.stage.Stage` as its ``STAGE``, and :data:`STAGES` is built from them,
in the page's order (each stage's ``order``). Adding a stage is adding a module.

:data:`MINIMUMS`, :data:`WEIGHTS` and :data:`STAGE_TITLES` are read from the stages'
declarations (by name), for code that needs one of them for every stage.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from types import ModuleType

from arithinterp.report.budget import EVALUATION_WEIGHT
from arithinterp.report.stage import MINIMUMS, Stage


def collect(*packages: ModuleType) -> dict[str, Stage]:
    """The ``STAGE`` of every module of ``packages``, by name, in the page's order (``order``)."""
    found = [importlib.import_module(f"{package.__name__}.{info.name}").STAGE
             for package in packages for info in pkgutil.iter_modules(package.__path__)]
    return {stage.name: stage for stage in sorted(found, key=lambda stage: stage.order)}


STAGES: dict[str, Stage] = collect(sys.modules[__name__])
MINIMUMS.update({stage.minimum_name or stage.name: stage.minimum for stage in STAGES.values()
                 if stage.minimum is not None})
# each stage's share of the budget, and the evaluation's (what a stage leaves unused goes to the later ones)
WEIGHTS: dict[str, float] = {"evaluation": EVALUATION_WEIGHT, **{name: s.weight for name, s in STAGES.items()}}
STAGE_TITLES: dict[str, str] = {name: stage.title for name, stage in STAGES.items()}
