"""What a probe is fitted to: a prompt label, the model's own answer, or an array of values.

:func:`resolve_target` turns a target name (``"a"``, ``"answer_units"``, ``"carry_tens"``,
``"model_answer"``, ``"model_correct"``, ``"model_answer_tens"``) or an array into labels, and
says which prompts it keeps (those whose generated answer is a number, for model targets).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.probes.probe_base import to_tensor
from arithinterp.tasks import UNPARSABLE as _UNPARSABLE  # a generated answer that is not a number
from arithinterp.tasks.places import refuse_renamed, split_place
from arithinterp.types import checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

_MODEL_TARGETS = ("model_answer", "model_correct", "model_answer_<place>")  # model_answer_units, _tens, ...


def _model_answer_values(model_answer: Any, n: int, prompts: Any = None) -> torch.Tensor:
    """The model's answer per prompt, from the model (which evaluates ``prompts``), an
    ``Evaluation`` or a tensor [n].
    """
    if model_answer is None:
        raise AnalysisError(
            "targets about the model's own answer need model_answer=: pass the model, "
            "prompts.evaluate(model) (an Evaluation) or its .model_answer tensor"
        )
    if hasattr(model_answer, "cfg") and callable(model_answer):  # a model: evaluate the prompts with it
        if prompts is None:
            raise AnalysisError("model_answer=model needs activations that carry their prompts")
        model_answer = prompts.evaluate(model_answer)
    values = getattr(model_answer, "model_answer", model_answer)
    values = to_tensor(values, "model_answer").long()
    if values.shape != (n,):
        raise AnalysisError(f"model_answer must have one answer per prompt ({n}), got shape {tuple(values.shape)}")
    return values


@checked
def resolve_target(
    prompts: Optional[PromptSet], target: Any, n: int, model_answer: Any = None
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Labels for ``target``.

    Prompts whose generated answer is not a number are left out of model-answer targets (``keep``).

    Args:
        prompts: The prompts the activations were read on (``None``: only an array target works).
        target: A label name of ``prompts.label`` (``"a"``, ``"answer_units"``, ``"carry_tens"``,
            ...), ``"model_answer"``, ``"model_correct"``, ``"model_answer_<place>"`` (the model's
            answer's digit at that place: ``"model_answer_units"``, ...) or an array of ``n`` values.
        n: How many prompts there are.
        model_answer: For model targets: the model (which evaluates ``prompts``), an
            ``Evaluation`` or a tensor ``[n]``.

    Returns:
        ``(y [n_kept], keep BoolTensor [n], name)``.

    Raises:
        ConfigError: the target is unknown, or numbers a digit by its index (``answer_digit_0``): the
            error names the place-value name.
        AnalysisError: the target has the wrong length, or needs prompts or ``model_answer`` that are
            missing.
    """
    keep = torch.ones(n, dtype=torch.bool)
    if not isinstance(target, str):
        y = to_tensor(target, "target")
        if y.ndim != 1 or len(y) != n:
            raise AnalysisError(f"a target array must have one value per prompt ({n}), got shape {tuple(y.shape)}")
        return y, keep, "custom"
    if target.startswith("model_"):
        place = split_place(target, ("model_answer",))
        if target not in ("model_answer", "model_correct") and not place:
            refuse_renamed(target, what="target", known=list(_MODEL_TARGETS), carry_into=False)
            raise ConfigError(f"unknown target {target!r}; model targets: {accepted(_MODEL_TARGETS)}")
        values = _model_answer_values(model_answer, n, prompts)
        if target == "model_correct":
            if prompts is None:
                raise AnalysisError("target 'model_correct' needs the prompts (acts.prompts) for the true answers")
            return (values == prompts.answer).long(), keep, target
        keep = values != _UNPARSABLE
        values = values[keep]
        if place:
            values = (values.abs() // 10 ** place[1]) % 10
        return values, keep, target
    if prompts is None:
        raise AnalysisError(f"target {target!r} names a label but these activations carry no prompts; pass an array")
    try:
        return prompts.label(target), keep, target
    except ConfigError as error:
        raise ConfigError(
            f"{error}; or a model target {accepted(_MODEL_TARGETS)}; or an array of {n} values") from error
