"""Answer positions: activations before each answer token, and the answer slots' values.

:func:`answer_activations` reads the position before each answer token with the model's own
answer teacher-forced; :func:`answer_slots` gives, per answer slot, the true value, the model's
value and whether the slot exists. Both feed probe sweeps and the error detector.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from arithinterp.checks import check_belongs
from arithinterp.errors import AnalysisError
from arithinterp.tasks import UNPARSABLE as _UNPARSABLE  # a generated answer that is not a number
from arithinterp.tasks.places import answer_token_places, place_name
from arithinterp.tasks.positions import predicting_position
from arithinterp.types import HookedModel, checked

if TYPE_CHECKING:
    from arithinterp.activations import Activations
    from arithinterp.tasks import Evaluation

from arithinterp.tasks import PromptSet  # noqa: E402 - declared parameter types are checked at run time


# --- activations before each answer token ---------------------------------------------------------


def check_evaluation(prompts: PromptSet, evaluation: Any) -> None:
    """Refuse an ``evaluation`` that is not ``prompts.evaluate(model)`` of these prompts."""
    n, k = prompts.answer_tokens.shape
    generated = getattr(evaluation, "generated_tokens", None)
    if generated is None or tuple(generated.shape) != (n, k) or tuple(evaluation.correct.shape) != (n,):
        raise AnalysisError(
            f"evaluation must be prompts.evaluate(model) for these {n} prompts "
            f"(generated_tokens [{n}, {k}], correct [{n}])"
        )
    if (generated < 0).any():
        raise AnalysisError("evaluation.generated_tokens holds negative token ids; pass prompts.evaluate(model)")


def answer_digit_count(prompts: PromptSet) -> int:
    return len(str(int(prompts.answer.abs().max()))) if len(prompts) else 1


@checked
def slot_names(prompts: PromptSet) -> list[str]:
    """What each answer slot of :func:`answer_slots` holds, named as a digit or as a position.

    Args:
        prompts: The prompts.

    Returns:
        One name per slot. Single-token answers: the places, units first (``"units"``,
        ``"tens"``, ...). Multi-token answers: the place of each answer token where every answer
        writes one digit per token in as many tokens (``"thousands"``, ``"hundreds"``, ``"tens"``,
        ``"units"``), else the answer token's position (``"answer[0]"``, ``"answer[1]"``, ...).
    """
    k = prompts.answer_tokens.shape[1]
    if k == 1:
        return [place_name(i) for i in range(answer_digit_count(prompts))]
    return answer_token_places(prompts) or [f"answer[{j}]" for j in range(k)]


@checked
def answer_activations(
    model: HookedModel,
    prompts: PromptSet,
    evaluation: Optional[Evaluation] = None,
    site: str = "resid_post",
    *,
    layers: Optional[Sequence[int]] = None,
    batch_size: int = 256,
    progress: bool = True,
) -> Activations:
    """Activations at the position that predicts each answer token, the model's own answer fed back.

    Answer token ``j`` is predicted at the token before it: ``"final"`` for the first (``j = 0``),
    ``"answer[j-1]"`` for the others, with the model's first ``j`` generated answer tokens appended
    (teacher forcing its *own* answer, so the activation is the one it had when it emitted token j).
    The position names are those of :meth:`arithinterp.tasks.PromptSet.locate`: written order,
    ``answer[0]`` the first answer token.

    Args:
        model: The hooked model.
        prompts: The prompts.
        evaluation: The model's answers to them; ``None`` runs ``prompts.evaluate(model)``.
        site: The site to read.
        layers: The layers to read (default: all).
        batch_size: Prompts per forward.
        progress: Show a progress bar.

    Returns:
        Activations (via :func:`~arithinterp.activations.collect`) whose ``data[site]`` is
        ``[prompt, layer, answer_token, *site_shape]``, positions ``final``, ``answer[0]`` ...
        ``answer[k-2]`` (where answer tokens 0 .. k-1 are predicted), and whose ``prompts`` are
        ``prompts``.

    Raises:
        AnalysisError: ``evaluation`` does not belong to ``prompts``.
        ModelMismatchError: The prompts were built for another model.
    """
    check_belongs(model, "probes.answer_activations", prompts=prompts)
    from arithinterp.activations import collect

    evaluation = evaluation if evaluation is not None else prompts.evaluate(model, batch_size=batch_size)
    check_evaluation(prompts, evaluation)
    k = prompts.answer_tokens.shape[1]
    # prompts are left-padded, so appending the generated tokens on the right keeps them aligned
    # (and "answer[j]", the final position + 1 + j, names the j-th appended token)
    forced = replace(
        prompts,
        tokens=torch.cat([prompts.tokens, evaluation.generated_tokens[:, : k - 1]], dim=1),
        lengths=prompts.lengths + (k - 1),
    )
    positions = [predicting_position(j) for j in range(k)]
    acts = collect(
        model, forced, sites=[site], layers=layers, positions=positions, batch_size=batch_size, progress=progress
    )
    acts.prompts = prompts
    acts.meta.update(teacher_forced="the model's own generated answer tokens")
    return acts


# --- answer slots: what each answer digit should be and what the model wrote ---------------------


def _token_values(tokenizer: Any, ids: torch.Tensor) -> torch.Tensor:
    """The number each token id spells (``"7"`` → 7); other tokens map to ``-(id + 2)``."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    values = []
    for token in unique.tolist():
        text = tokenizer.decode([token]).strip() if token >= 0 else ""
        values.append(int(text) if text.isdigit() else -(token + 2))
    return torch.tensor(values, dtype=torch.long)[inverse]


def answer_slot_mask(prompts: PromptSet, n_slots: int) -> torch.Tensor:
    """Which answer slots exist per prompt [N, S] (answer tokens past a short answer do not)."""
    if prompts.answer_tokens.shape[1] == 1:
        return torch.ones(len(prompts), n_slots, dtype=torch.bool)
    return torch.arange(n_slots)[None, :] < prompts.n_answer_tokens[:, None]


@checked
def answer_slots(prompts: PromptSet, evaluation: Evaluation) -> dict[str, torch.Tensor]:
    """Per answer slot: the true value, the model's value, and whether the slot exists.

    Single-token answers: one slot per decimal digit of the answer (units first), read from
    the answer value. Multi-token answers: one slot per answer token (first written first), valued
    as the number the token spells (one digit for digit tokenizers). :func:`slot_names` names them.

    Args:
        prompts: The prompts.
        evaluation: The model's answers to them (``prompts.evaluate(model)``).

    Returns:
        ``true`` and ``output`` (Int[Tensor, "prompt slot"], −1 where a slot does not exist or the
        answer does not parse), ``valid`` (Bool[Tensor, "prompt slot"]) and ``correct``
        (Bool[Tensor, "prompt"]).

    Raises:
        AnalysisError: ``evaluation`` does not belong to ``prompts``.
    """
    check_evaluation(prompts, evaluation)
    n, k = prompts.answer_tokens.shape
    if k == 1:
        powers = 10 ** torch.arange(answer_digit_count(prompts))
        true = (prompts.answer.abs()[:, None] // powers) % 10
        answer = evaluation.model_answer
        output = torch.where((answer != _UNPARSABLE)[:, None], (answer.abs()[:, None] // powers) % 10, -1)
        valid = torch.ones_like(true, dtype=torch.bool)
    else:
        valid = answer_slot_mask(prompts, k)
        true = torch.where(valid, _token_values(prompts.tokenizer, prompts.answer_tokens.clamp_min(0)), -1)
        output = torch.where(valid, _token_values(prompts.tokenizer, evaluation.generated_tokens), -1)
    return dict(true=true.long(), output=output.long(), valid=valid, correct=evaluation.correct.bool())
