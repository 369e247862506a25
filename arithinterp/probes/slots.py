"""Reading the answer slots for the error detector: the model's answers, where each slot is read, its carries.

:func:`model_answers` generates the model's answers once per model and prompt set;
:func:`shared_prefix_slots` reads the activations before each answer token from stepped runs that
compute the prompts' shared first tokens once; :func:`slot_offsets` says where each answer slot
is read; :func:`answer_carries` gives each slot's carry labels (Quirke & Barez 2023-24).
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from arithinterp import sites as site_lib
from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.probes.answers import answer_digit_count
from arithinterp.probes.probe_base import to_tensor
from arithinterp.types import checked

if TYPE_CHECKING:
    from arithinterp.tasks import Evaluation
    from arithinterp.tasks import PromptSet
    from arithinterp.types import HookedModel

DETECTOR_POSITIONS = ("final", "final-only")

# --- the model's answers, generated once per prompt set --------------------------------------------

_ANSWERS: "weakref.WeakKeyDictionary[Any, OrderedDict]" = weakref.WeakKeyDictionary()
_ANSWERS_KEPT = 8  # prompt sets remembered per model (an Evaluation is a few integers per prompt)


def _prompts_key(prompts: Any) -> str:
    """A digest of what decides the model's answers and their scoring: tokens, lengths, answers."""
    digest = hashlib.sha1()
    for tensor in (prompts.tokens, prompts.lengths, prompts.answer_tokens):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def model_answers(model: HookedModel, prompts: PromptSet, batch_size: Optional[int] = None) -> Evaluation:
    """``prompts.evaluate(model)``, generated once per model and prompt set.

    Greedy decoding is deterministic, so the answers are kept (for the last few prompt sets of
    each model, keyed on the prompts' tokens and answers and on the model's parameters, which a
    change to any weight invalidates): a detector fitted, evaluated and asked to flag on one
    prompt set generates its answers once.

    Args:
        model: The hooked model.
        prompts: The prompts to answer.
        batch_size: Prompts per forward; ``None`` chooses it from a memory budget.

    Returns:
        The model's evaluation on ``prompts`` (the same object on a repeated call).
    """
    from arithinterp.engine.steppers import model_fingerprint

    key = (model_fingerprint(model), _prompts_key(prompts))
    try:
        kept = _ANSWERS.setdefault(model, OrderedDict())
    except TypeError:  # not weak-referenceable: nothing is kept
        return prompts.evaluate(model, batch_size=batch_size)
    if key in kept:
        kept.move_to_end(key)
        return kept[key]
    evaluation = kept[key] = prompts.evaluate(model, batch_size=batch_size)
    while len(kept) > _ANSWERS_KEPT:
        kept.popitem(last=False)
    return evaluation


def shared_prefix_slots(model: Any, prompts: Any, evaluation: Any, site: str, layers: Sequence[int],
                        batch_size: int) -> Optional[torch.Tensor]:
    """Activations before each answer token with the model's own answer fed back (as
    :func:`~arithinterp.probes.answers.answer_activations`), from stepped runs that compute the
    prompts' shared first tokens (a few-shot prefix) once per batch.

    Args:
        model: The hooked model.
        prompts: The prompts (N of them, K answer tokens).
        evaluation: ``prompts.evaluate(model)``: its generated tokens are fed back.
        site: The site read (a per-layer site; not ``"pattern"``).
        layers: The layers read (L of them).
        batch_size: The most prompts per stepped run (fewer where memory requires).

    Returns:
        The activations ``[N, L, K, *site_shape]``, or ``None`` where the engine cannot share
        the prefix (then the whole forwards of ``collect`` run).

    Raises:
        AnalysisError: ``evaluation`` is not an evaluation of these prompts.
    """
    from arithinterp.engine.budget import forward_bytes_per_prompt
    from arithinterp.engine.decode import MIN_BUDGET
    from arithinterp.engine.steppers import read_last
    from arithinterp.probes.answers import check_evaluation

    if site in site_lib.GLOBAL_SITES or site == "pattern":
        return None
    check_evaluation(prompts, evaluation)
    k, cfg = prompts.answer_tokens.shape[1], model.cfg
    names = [site_lib.hook_name(site, layer) for layer in layers]
    shape = site_lib.site_shape(model, site)
    out = torch.empty(len(prompts), len(layers), k, *shape)
    # a stepped base run keeps every block's input, keys and values and the reads: size batches for that
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    width, first = int(torch.tensor(shape).prod()), True
    for group in prompts.length_groups():
        tokens = torch.cat([prompts.unpadded(group), evaluation.generated_tokens[group, : k - 1]], dim=1)
        T = tokens.shape[1]
        kv_width = 2 * (getattr(cfg, "n_key_value_heads", None) or cfg.n_heads) * cfg.d_head
        per_prompt = forward_bytes_per_prompt(model, T) + 4 * T * (
            (cfg.n_layers + 1) * cfg.d_model + cfg.n_layers * kv_width + len(layers) * width)
        size = max(1, min(batch_size, int(max(0.5 * model_bytes, MIN_BUDGET) // per_prompt)))
        for chunk in torch.arange(len(group)).split(size):
            rows = tokens[chunk].to(getattr(cfg, "device", None) or "cpu")
            read = read_last(model, rows, names, k, only_if_shared=first)
            if read is None:  # decided on the first batch: the others share the same prefix
                return None
            first = False
            for i, name in enumerate(names):
                out[group[chunk], i] = read[name].reshape(len(chunk), k, *shape).float().cpu()
    return out


# --- where each answer slot is read ---------------------------------------------------------------


def slot_offsets(prompts: Any, position: str) -> torch.Tensor:
    """Offset from the final prompt token of the position read for each answer slot.

    Args:
        prompts: The prompts (K answer tokens).
        position: ``"final"`` (slot j at the final prompt token + j) or ``"final-only"`` (every
            slot at the final prompt token).

    Returns:
        The offsets, long [S]: one slot per answer token, or one per digit of a single-token answer.

    Raises:
        ConfigError: ``position`` is unknown.
    """
    if position not in DETECTOR_POSITIONS:
        raise ConfigError(f"unknown position {position!r}; accepted: {accepted(DETECTOR_POSITIONS)}")
    k = prompts.answer_tokens.shape[1]
    if k == 1:  # a single answer token: every digit of it is read where it is predicted
        return torch.zeros(answer_digit_count(prompts), dtype=torch.long)
    return torch.arange(k) if position == "final" else torch.zeros(k, dtype=torch.long)


@checked
def answer_carries(prompts: PromptSet, slots: dict) -> Optional[dict]:
    """Per answer slot: the carry into its digit that the sum needs and the one the model used.

    Quirke & Barez: an answer digit is (a_i + b_i + carry_in) mod 10, and small models fail on
    the carry, above all in sum-9 cascades.

    Args:
        prompts: The prompts (N of them).
        slots: :func:`~arithinterp.probes.answer_slots` of the prompts: ``true``, ``output`` and
            ``valid`` [N, S].

    Returns:
        ``true`` [N, S], the carry into the slot's digit (0 / 1); ``output`` [N, S], the carry the
        model's digit implies, ``(digit - a_i - b_i) mod 10`` (0, 1, or 2 for "neither": the digit
        is wrong for another reason); ``valid`` [N, S], slots that are a digit with a carry into
        it. ``None`` when the prompts are not addition of non-negative numbers written one digit
        per slot (carries are then undefined).
    """
    if getattr(prompts, "op", None) != "+" or getattr(prompts, "modulus", None) is not None:
        return None
    a, b = prompts.a.long(), prompts.b.long()
    if (a < 0).any() or (b < 0).any():
        return None
    valid = slots["valid"]
    if ((slots["true"] < 0) | (slots["true"] > 9))[valid].any():
        return None  # a slot spells more than one digit (e.g. a BPE token "12")
    n, n_slots = slots["true"].shape
    if prompts.answer_tokens.shape[1] == 1:  # single-token answers: slot s is digit s (units first)
        power = torch.arange(n_slots)[None, :].expand(n, n_slots)
    else:  # one token per digit, most significant first
        power = (prompts.n_answer_tokens[:, None] - 1 - torch.arange(n_slots)[None, :]).clamp_min(0)
    scale = 10**power
    true = ((a[:, None] % scale) + (b[:, None] % scale) >= scale).long()
    base = (a[:, None] // scale) % 10 + (b[:, None] // scale) % 10
    output = (slots["output"] - base) % 10
    output = torch.where((slots["output"] >= 0) & (output <= 1), output, 2)
    return dict(true=true, output=output, valid=valid & (power > 0))


def check_slot_activations(X: Any, slots: dict) -> torch.Tensor:
    """Slot activations as a float tensor, checked against their labels.

    Args:
        X: Slot activations [N, L, S, d] (a tensor or an array).
        slots: :func:`~arithinterp.probes.answer_slots` labels (``true``, ``output``, ``valid``
            [N, S], ``correct`` [N]).

    Returns:
        ``X`` as a float tensor [N, L, S, d].

    Raises:
        AnalysisError: ``X`` is not 4-dimensional, or its prompts and slots disagree with the labels.
    """
    X = to_tensor(X, "X").float()
    if X.ndim != 4:
        raise AnalysisError(f"X must be [n_prompts, n_layers, n_slots, d], got shape {tuple(X.shape)}")
    expected = tuple(slots["true"].shape)
    for key in ("output", "valid"):
        if tuple(slots[key].shape) != expected:
            raise AnalysisError(f"slots[{key!r}] has shape {tuple(slots[key].shape)}, expected {expected}")
    if (X.shape[0], X.shape[2]) != expected or slots["correct"].shape != (X.shape[0],):
        raise AnalysisError(
            f"X has {X.shape[0]} prompts x {X.shape[2]} slots but the labels are {expected}; "
            "build them together with answer_slots(prompts, evaluation)"
        )
    return X


def check_carries(carries: Optional[dict], slots: dict) -> Optional[dict]:
    """Carry labels checked against the slot labels.

    Args:
        carries: :func:`answer_carries` labels, or ``None``.
        slots: :func:`~arithinterp.probes.answer_slots` labels.

    Returns:
        ``carries``, unchanged.

    Raises:
        AnalysisError: a carry label is missing or its shape is not the slots' [N, S].
    """
    if carries is None:
        return None
    for key in ("true", "output", "valid"):
        if key not in carries or tuple(carries[key].shape) != tuple(slots["true"].shape):
            raise AnalysisError("carries must hold 'true', 'output' and 'valid' [N, S] like the slots; "
                                "build them with answer_carries(prompts, slots)")
    return carries
