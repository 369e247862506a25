"""Restricted / excluded loss and progress measures for modular addition (Nanda et al. 2023).

Logits [p, p, C] over every pair ``(a, b)`` (:func:`modular_logits`) are split into the key
directions ``cos / sin(w_k(a+b))`` and the rest; :func:`restricted_loss` / :func:`excluded_loss`
score each part and :func:`progress` tracks them over a zoo model's training snapshots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from arithinterp import engine
from arithinterp.checks import check_belongs, check_choice
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.fourier.basis import KEY_RULES, key_frequencies
from arithinterp.fourier.number_axes import grid_of, number_tokens
from arithinterp.progress import progress_bar
from arithinterp.results import INCREASING, NON_NEGATIVE, Result, build_meta
from arithinterp.types import IntList, PositiveInt, HookedModel, checked


# --- restricted / excluded loss (Nanda et al. 2023) ---------------------------------------------


def _check_logits(logits: torch.Tensor) -> int:
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or logits.shape[0] != logits.shape[1]:
        raise AnalysisError(
            f"logits must be [p, p, n_classes] over all (a, b) pairs, got {getattr(logits, 'shape', logits)}"
        )
    return logits.shape[0]


@checked
def sum_directions(p: PositiveInt, freqs: IntList, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal directions ``cos / sin(2πk(a+b)/p)`` over the p² pairs.

    Args:
        p: The modulus.
        freqs: The frequencies ``k``, in ``1..p // 2``.
        dtype: The directions' dtype.

    Returns:
        Float[Tensor, "pair direction"]: ``[p², 2K]`` for K frequencies, less the directions that
        vanish (``sin`` at ``k = p/2``).

    Raises:
        AnalysisError: A frequency out of range.
    """
    freqs = [int(k) for k in freqs]
    bad = [k for k in freqs if not 1 <= k <= p // 2]
    if bad:
        raise AnalysisError(f"frequencies {bad} are out of range for p={p}; accepted: 1..{p // 2}")
    s = (torch.arange(p)[:, None] + torch.arange(p)[None, :]).flatten().to(dtype)
    ks = torch.tensor(sorted(set(freqs)), dtype=dtype)
    angle = 2 * math.pi * s[:, None] * ks[None, :] / p
    directions = torch.cat([angle.cos(), angle.sin()], dim=1)
    norms = directions.norm(dim=0)
    keep = norms > 1e-8 * p
    return directions[:, keep] / norms[keep]


def _key_part(logits: torch.Tensor, freqs: Iterable[int]) -> torch.Tensor:
    """Projection of logits [p, p, C] onto the key ``cos / sin(w_k(a+b))`` directions."""
    p = logits.shape[0]
    flat = logits.reshape(p * p, -1).double()
    directions = sum_directions(p, list(freqs)).to(flat.device)
    return (directions @ (directions.T @ flat)).reshape(logits.shape)


@checked
def restricted_logits(logits: torch.Tensor, freqs: Iterable[int]) -> torch.Tensor:
    """Logits kept only in the key directions ``cos / sin(w_k(a+b))`` plus the per-class mean over
    pairs (Nanda et al. 2023 restricted logits).

    Args:
        logits (Float[Tensor, "p p classes"]): Logits over every pair ``(a, b)``.
        freqs: The key frequencies.

    Returns:
        Float[Tensor, "p p classes"]: The restricted logits (float64).

    Raises:
        AnalysisError: ``logits`` is not ``[p, p, classes]``, or a frequency is out of range.
    """
    _check_logits(logits)
    return logits.double().mean(dim=(0, 1), keepdim=True) + _key_part(logits, freqs)


@checked
def excluded_logits(logits: torch.Tensor, freqs: Iterable[int]) -> torch.Tensor:
    """Logits with the key directions ``cos / sin(w_k(a+b))`` removed (Nanda et al. 2023).

    Args:
        logits (Float[Tensor, "p p classes"]): Logits over every pair ``(a, b)``.
        freqs: The key frequencies.

    Returns:
        Float[Tensor, "p p classes"]: The excluded logits (float64).

    Raises:
        AnalysisError: ``logits`` is not ``[p, p, classes]``, or a frequency is out of range.
    """
    _check_logits(logits)
    return logits.double() - _key_part(logits, freqs)


def _loss(logits: torch.Tensor, labels: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> float:
    p = _check_logits(logits)
    if labels is None:
        if logits.shape[2] < p:
            raise AnalysisError(f"default labels (a + b) mod p need ≥ p={p} classes, got {logits.shape[2]}")
        labels = (torch.arange(p)[:, None] + torch.arange(p)[None, :]) % p
    labels = torch.as_tensor(labels).long().to(logits.device)
    if labels.shape != (p, p):
        raise AnalysisError(f"labels must be [p, p] = [{p}, {p}], got {tuple(labels.shape)}")
    mask = torch.ones((p, p), dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    if mask.shape != (p, p) or not mask.any():
        raise AnalysisError(
            f"mask must be a non-empty bool [p, p] = [{p}, {p}] selecting pairs, got {tuple(mask.shape)}"
        )
    mask = mask.to(logits.device)
    return float(F.cross_entropy(logits.double()[mask], labels[mask]))


@checked
def full_loss(logits: torch.Tensor, labels: Optional[torch.Tensor] = None,
              mask: Optional[torch.Tensor] = None) -> float:
    """Cross-entropy of logits over a set of pairs.

    Args:
        logits (Float[Tensor, "p p classes"]): Logits over every pair ``(a, b)``.
        labels (Int[Tensor, "p p"] | None): The classes (default ``(a + b) mod p``).
        mask (Bool[Tensor, "p p"] | None): The pairs to score (default: all).

    Returns:
        The mean cross-entropy.

    Raises:
        AnalysisError: Shapes that do not match, fewer than ``p`` classes with the default labels,
            or an empty mask.
    """
    return _loss(logits, labels, mask)


@checked
def restricted_loss(logits: torch.Tensor, freqs: Iterable[int], labels: Optional[torch.Tensor] = None,
                    mask: Optional[torch.Tensor] = None) -> float:
    """Loss of :func:`restricted_logits` (Nanda et al. 2023). Falls below the full loss once the
    model's answer is carried by the key frequencies and the rest is noise.

    Args:
        logits (Float[Tensor, "p p classes"]): Logits over every pair ``(a, b)``.
        freqs: The key frequencies.
        labels (Int[Tensor, "p p"] | None): The classes (default ``(a + b) mod p``).
        mask (Bool[Tensor, "p p"] | None): The pairs to score (default: all).

    Returns:
        The mean cross-entropy.

    Raises:
        AnalysisError: As for :func:`full_loss`.
    """
    return _loss(restricted_logits(logits, freqs), labels, mask)


@checked
def excluded_loss(logits: torch.Tensor, freqs: Iterable[int], labels: Optional[torch.Tensor] = None,
                  mask: Optional[torch.Tensor] = None) -> float:
    """Loss of :func:`excluded_logits` (Nanda et al. 2023; Nanda measure it on the training pairs).
    Rises far above the full loss as the Fourier circuit forms.

    Args:
        logits (Float[Tensor, "p p classes"]): Logits over every pair ``(a, b)``.
        freqs: The key frequencies.
        labels (Int[Tensor, "p p"] | None): The classes (default ``(a + b) mod p``).
        mask (Bool[Tensor, "p p"] | None): The pairs to score (default: all).

    Returns:
        The mean cross-entropy.

    Raises:
        AnalysisError: As for :func:`full_loss`.
    """
    return _loss(excluded_logits(logits, freqs), labels, mask)


@checked
def sum_frequency_power(logits: torch.Tensor) -> torch.Tensor:
    """Power of logits in each ``cos / sin(w_k(a+b))`` pair of directions. Its key frequencies
    (:func:`key_frequencies`) are the frequencies the logits are built from.

    Args:
        logits (Float[Tensor, "p p classes"]): Logits over every pair ``(a, b)``.

    Returns:
        Float[Tensor, "freq"]: ``p // 2 + 1`` powers (float64), index ``k``; index 0 is the per-class mean.

    Raises:
        AnalysisError: ``logits`` is not ``[p, p, classes]``.
    """
    p = _check_logits(logits)
    flat = logits.reshape(p * p, -1).double()
    power = [flat.mean(0).pow(2).sum() * p * p]
    for k in range(1, p // 2 + 1):
        power.append((sum_directions(p, [k]).T @ flat).pow(2).sum())
    return torch.stack(power)


@torch.inference_mode()
@checked
def modular_logits(model: HookedModel, p: Optional[PositiveInt] = None, *, template: str = "{a} {b} =",
                   batch_size: PositiveInt = 4096) -> torch.Tensor:
    """A model's logits over every pair ``(a, b)`` of ``0..p-1``, read at the final prompt token and
    restricted to the number tokens ``0..p-1`` (so class ``c`` = number ``c``).

    Args:
        model: The hooked model.
        p: The modulus; ``None`` reads it from a zoo modular-addition model.
        template: The prompt template.
        batch_size: Prompts per forward.

    Returns:
        Float[Tensor, "p p p"]: The logits (float32).

    Raises:
        AnalysisError: ``p`` is not given and the model is not a zoo modular-addition model.
        ConfigError: ``p`` exceeds the vocabulary.
    """
    check_belongs(model, "fourier.modular_logits")
    from arithinterp.tasks import arithmetic

    if p is None:
        p = _zoo_modulus(model)
    vocabulary = int(model.cfg.d_vocab)
    if p > vocabulary:  # before the p x p prompts are built: each of 0..p-1 must be a token
        raise ConfigError(f"p={p} needs the numbers 0..{p - 1} as tokens, more than this model's vocabulary of "
                          f"{vocabulary} tokens holds")
    prompts = arithmetic(model, "+", a=range(p), b=range(p), template=template, modulus=p)
    tokens = number_tokens(model, range(p))
    out = torch.empty((len(prompts), p))
    for group in prompts.length_groups():
        for idx in group.split(batch_size):
            logits = engine.run(model, prompts.unpadded(idx)).logits  # the final position's alone
            assert logits is not None  # run keeps the final logits unless told not to
            out[idx] = logits[:, tokens].float()
    return grid_of(prompts, out, range(p))


def _zoo_modulus(model: HookedModel) -> int:
    from arithinterp.models.zoo import get_entry

    try:
        modulus = get_entry(str(getattr(model, "arithinterp_spec", ""))).task.modulus
    except Exception:  # not a zoo model: the caller must say p
        modulus = None
    if not modulus:
        raise AnalysisError("pass p= (the modulus); it is only known for zoo modular-addition models")
    return int(modulus)


@checked
def train_mask(name: str = "modadd-113") -> torch.Tensor:
    """The ``(a, b)`` pairs a zoo model was trained on (its seeded split).

    Args:
        name: A zoo modular-addition model.

    Returns:
        Bool[Tensor, "p p"]: True at the training pairs.

    Raises:
        ModelSpecError: An unknown zoo name.
        AnalysisError: The model is not a modular-addition model over ``0..p-1``.
    """
    from arithinterp.models.zoo import split
    from arithinterp.models.zoo import get_entry

    entry = get_entry(name)
    if not entry.task.modulus or entry.task.a_range != (0, entry.task.modulus):
        raise AnalysisError(f"zoo model {name!r} is not a modular-addition model over 0..p-1")
    p = entry.task.modulus
    mask = torch.zeros(p * p, dtype=torch.bool)
    mask[split(entry)[0]] = True  # the operand grid is a-major: problem index = a * p + b
    return mask.reshape(p, p)


@checked
def modular_losses(logits: torch.Tensor, freqs: Sequence[int], mask: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Full, restricted and excluded loss on the training pairs and the rest (Nanda et al. 2023).

    Args:
        logits (Float[Tensor, "p p p"]): Logits over every pair ``(a, b)``.
        freqs: The key frequencies.
        mask (Bool[Tensor, "p p"] | None): The training pairs (default: all; the held-out losses are
            then over all pairs too).

    Returns:
        ``train_loss`` and ``test_loss`` (full loss); ``restricted_loss`` (all pairs) and
        ``restricted_test_loss`` (held out); ``excluded_loss`` (training pairs) and
        ``excluded_test_loss`` (held out).

    Raises:
        AnalysisError: ``logits`` is not ``[p, p, p]``.
    """
    p = _check_logits(logits)
    mask = torch.ones((p, p), dtype=torch.bool) if mask is None else mask
    held_out = ~mask if (~mask).any() else mask
    return dict(
        train_loss=full_loss(logits, mask=mask),
        test_loss=full_loss(logits, mask=held_out),
        restricted_loss=restricted_loss(logits, freqs),
        restricted_test_loss=restricted_loss(logits, freqs, mask=held_out),
        excluded_loss=excluded_loss(logits, freqs, mask=mask),
        excluded_test_loss=excluded_loss(logits, freqs, mask=held_out),
    )


@dataclass(frozen=True)
class ProgressResult(Result):
    """Nanda et al. 2023 progress measures over training snapshots.

    See :func:`modular_losses` for the definitions of the measures.

    Attributes:
        steps: The training steps measured, ascending.
        train_loss (Float[Tensor, "checkpoint"]): Full loss on the training pairs.
        test_loss (Float[Tensor, "checkpoint"]): Full loss on the held-out pairs.
        restricted_loss (Float[Tensor, "checkpoint"]): Restricted loss on all pairs.
        restricted_test_loss (Float[Tensor, "checkpoint"]): Restricted loss on the held-out pairs.
        excluded_loss (Float[Tensor, "checkpoint"]): Excluded loss on the training pairs.
        excluded_test_loss (Float[Tensor, "checkpoint"]): Excluded loss on the held-out pairs.
        key: The key frequencies, fixed for every step.
        meta: Provenance, the zoo model, ``p`` and the number of training pairs.
    """

    steps: list
    train_loss: torch.Tensor
    test_loss: torch.Tensor
    restricted_loss: torch.Tensor
    restricted_test_loss: torch.Tensor
    excluded_loss: torch.Tensor
    excluded_test_loss: torch.Tensor
    key: list
    meta: dict

    MEASURES = ("train_loss", "test_loss", "restricted_loss", "restricted_test_loss", "excluded_loss",
                "excluded_test_loss")

    # what load checks: the axes fields share and the values they may take
    _shapes = {"steps": "checkpoint", "train_loss": "checkpoint", "test_loss": "checkpoint",
               "restricted_loss": "checkpoint", "restricted_test_loss": "checkpoint", "excluded_loss": "checkpoint",
               "excluded_test_loss": "checkpoint"}
    _legal = {"steps": [NON_NEGATIVE, INCREASING]}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(
            [dict(step=s, measure=m, loss=float(getattr(self, m)[i]))
             for i, s in enumerate(self.steps) for m in self.MEASURES]
        )

    def plot(self, **kwargs):
        return draw(self, **kwargs)


@checked
def progress(
    snapshots: Optional[Sequence[int]] = None,
    name: str = "modadd-113",
    *,
    key: Optional[Sequence[int]] = None,
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    include_final: bool = True,
    progress: bool = True,
) -> ProgressResult:
    """Train / test / restricted / excluded loss of zoo model ``name`` at its training snapshots
    (default: all shipped, ``get_entry(name).snapshot_steps()``) and, with ``include_final``,
    the final model. Key frequencies are fixed from the final model's logits
    (:func:`sum_frequency_power` + :func:`key_frequencies`) unless ``key`` is given.
    Nanda et al. 2023.

    Args:
        snapshots: The training steps to measure (default: every shipped snapshot).
        name: A zoo modular-addition model.
        key: The key frequencies; ``None`` picks them from the final model with ``rule``.
        rule: The :func:`key_frequencies` rule.
        factor: Its ``"median"`` factor.
        fraction: Its ``"fraction"`` share.
        include_final: Measure the final model too.
        progress: Show a progress bar.

    Returns:
        The measures per step.

    Raises:
        AnalysisError: ``name`` is not a modular-addition model.
        ConfigError: An unknown ``rule``, a snapshot that is not shipped, or nothing to measure.
    """
    from arithinterp.models import load_model
    from arithinterp.models.zoo import get_entry

    check_choice("rule", rule, KEY_RULES)  # before the model is loaded
    entry = get_entry(name)
    p = entry.task.modulus
    if not p:
        raise AnalysisError(f"zoo model {name!r} is not a modular-addition model")
    shipped = entry.snapshot_steps()
    steps = list(shipped if snapshots is None else snapshots)
    missing = [s for s in steps if s not in shipped]
    if missing:
        raise ConfigError(f"snapshots {missing} are not shipped for {name!r}; accepted: {shipped}")
    template = entry.task.template
    final_logits = modular_logits(load_model(f"zoo:{name}"), p, template=template)
    if key is None:
        key = key_frequencies(sum_frequency_power(final_logits), rule, factor=factor, fraction=fraction)
    key = [int(k) for k in key]
    mask = train_mask(name)
    rows, labels = [], []
    for step in progress_bar(steps, desc="snapshots", disable=not progress):
        snapshot = load_model(f"zoo:{name}@step={step}")
        rows.append(modular_losses(modular_logits(snapshot, p, template=template), key, mask))
        labels.append(int(step))
    if include_final:
        final_step = int(entry.card().get("steps_run", (labels[-1] + 1) if labels else 0))
        if final_step not in labels:
            rows.append(modular_losses(final_logits, key, mask))
            labels.append(final_step)
    if not rows:
        raise ConfigError("no snapshot to measure: pass snapshots= or include_final=True")
    columns = {m: torch.tensor([r[m] for r in rows]) for m in ProgressResult.MEASURES}
    return ProgressResult(steps=labels, **columns, key=key,
                          meta=build_meta(None, zoo=name, p=p, n_train_pairs=int(mask.sum())))
