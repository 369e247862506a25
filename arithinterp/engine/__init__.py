"""The intervention engine: the one place that runs a model with hooks or steps its blocks.

Analyses say *what* to change and *what* to read; the engine decides how to run the forward:
:mod:`~arithinterp.engine.forward` runs interventions and reads given as data in one forward,
:mod:`~arithinterp.engine.stepping` resumes the model's own blocks from any layer and position,
:mod:`~arithinterp.engine.patches` stacks many patch cells into one resumed run,
:mod:`~arithinterp.engine.ablations` many ablation cells.
"""

from arithinterp.engine.ablations import Ablation, AblationRunner
from arithinterp.engine.forward import Output, Read, RunningMean, Write, mean_activation, run
from arithinterp.engine.patches import PatchRunner, patch_mask
from arithinterp.engine.base_run import BaseRun
from arithinterp.engine.stepping import Stepper
from arithinterp.engine.steppers import stepper_for

__all__ = [
    "Ablation", "AblationRunner", "BaseRun", "Output", "PatchRunner", "Read", "RunningMean", "Stepper", "Write",
    "mean_activation", "patch_mask", "run", "stepper_for",
]
