"""Cyclic concepts: weekday, month and hour arithmetic as :class:`~arithinterp.tasks.PromptSet`.

``"Monday + 3 days ="`` → ``"Thursday"``, ``"March + 5 months ="`` → ``"August"``,
``"21 + 5 hours ="`` → ``"2"``. The concept's value is operand ``a`` (Monday = 0, January = 0,
hours 0..23), the offset is ``b`` and ``answer`` is ``(a + b) mod period``; names are written in
the prompt text and located by the tokenizer's character offsets like numbers, so a name that
spans several tokens works (positions ``"a"`` = its last token, ``"a[0]"`` its first,
``"answer[k]"`` the answer's tokens). Every analysis that takes a ``PromptSet`` runs on these:
probes (labels ``a``, ``b``, ``answer``, and ``wrap`` from :func:`wraps`), Fourier spectra and
helix fits over ``values=prompts.a`` with period 7 / 12 / 24, patching and circuits on
:func:`counterfactual` pairs (``vary="a"`` changes the day, ``vary="b"`` the offset).

Engels et al. (ICLR 2025, "Not All Language Model Features Are One-Dimensionally Linear") find
circular weekday and month features in Mistral and Llama models; ``docs/cyclic.md`` asks the same
of ``zoo:add-cyclic``, trained on addition and weekday / month arithmetic.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from arithinterp.errors import ConfigError, TaskError, accepted
from arithinterp.tasks import PromptPairs, PromptSet, operand_values, prompts_for_pairs
from arithinterp.types import checked

WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")


@dataclass(frozen=True)
class Concept:
    """A cyclic concept.

    Attributes:
        name: ``"weekday"``, ``"month"`` or ``"hour"``.
        period: The number of values (7, 12, 24).
        names: How its values are written, ``period`` entries; ``None`` writes them as numbers.
        template: The default template (``{a}`` the value, ``{b}`` the offset).
    """

    name: str
    period: int
    names: Optional[tuple[str, ...]]
    template: str


CONCEPTS: dict[str, Concept] = {
    "weekday": Concept("weekday", 7, WEEKDAYS, "{a} + {b} days ="),
    "month": Concept("month", 12, MONTHS, "{a} + {b} months ="),
    "hour": Concept("hour", 24, None, "{a} + {b} hours ="),
}


@checked
def concept(name: str) -> Concept:
    """The cyclic concept of a name.

    Args:
        name: ``"weekday"``, ``"month"`` or ``"hour"``.

    Returns:
        The concept, a :class:`Concept`.

    Raises:
        ConfigError: ``name`` is not a known concept.
    """
    if name not in CONCEPTS:
        raise ConfigError(f"unknown cyclic concept {name!r}; accepted: {accepted(CONCEPTS)}")
    return CONCEPTS[name]


@checked
def cyclic(
    model_or_tokenizer: Any,
    kind: str = "weekday",
    values: Optional[Iterable[int]] = None,
    offsets: Union[int, Iterable[int], None] = None,
    template: Optional[str] = None,
    *,
    names: Optional[Sequence[str]] = None,
    **options: Any,
) -> PromptSet:
    """Every prompt ``value + offset`` of a cyclic concept over the grid ``values × offsets``.

    Args:
        model_or_tokenizer: a hooked model or a Hugging Face tokenizer (any: names that span
            several tokens are located like multi-token numbers).
        kind: ``"weekday"`` (period 7), ``"month"`` (12) or ``"hour"`` (24, written as numbers).
        values: the concept's values, ``0 .. period-1`` (default: all of them).
        offsets: non-negative offsets (default ``range(period)``); the answer wraps around.
        template: ``{a}`` is the value, ``{b}`` the offset (default e.g. ``"{a} + {b} days ="``);
            end it with a separator so the answer tokenizes on its own.
        names: how values and answers are written (default the concept's English names; for
            BPE tokenizers that expect a space before a word, e.g. ``[" " + n for n in WEEKDAYS]``
            with a template ending ``"="``). Must have ``period`` entries.
        **options: as for :func:`~arithinterp.tasks.prompts_for_pairs` (``few_shot``,
            ``scoring``, ``prepend_bos``, ``seed``).

    Returns:
        A ``PromptSet`` with ``a`` = value, ``b`` = offset, ``answer`` = ``(a + b) mod period``,
        ``modulus`` = period and ``meta["concept"]`` naming the concept and its period.

    Raises:
        TaskError: An unknown ``kind``, ``names`` of the wrong length, a value out of range, or
            ``op`` / ``modulus`` / ``answer_digits`` among the options.
    """
    spec = concept(kind)
    for bad in ("op", "modulus", "answer_digits"):
        if bad in options:
            raise TaskError(f"cyclic prompts fix {bad!r} (addition mod the period {spec.period}); do not pass it")
    names = spec.names if names is None else tuple(names)
    if names is not None and len(names) != spec.period:
        raise TaskError(f"a {kind} has {spec.period} values, so names needs {spec.period} entries, got {len(names)}")
    value_list = _in_range("values", range(spec.period) if values is None else values, 0, spec.period)
    offset_list = _in_range("offsets", range(spec.period) if offsets is None else offsets, 0, None)
    a = [v for v in value_list for _ in offset_list]
    b = [o for _ in value_list for o in offset_list]
    prompts = prompts_for_pairs(model_or_tokenizer, "+", a, b, spec.template if template is None else template,
                                modulus=spec.period, names=names, **options)
    prompts.meta["concept"] = dict(name=kind, period=spec.period)
    return prompts


@checked
def weekdays(model_or_tokenizer: Any, days: Optional[Iterable[int]] = None,
             offsets: Union[int, Iterable[int], None] = None, template: Optional[str] = None,
             **options: Any) -> PromptSet:
    """Weekday arithmetic, ``"Monday + 3 days ="`` → ``"Thursday"`` (Monday = 0); see :func:`cyclic`.

    Args:
        model_or_tokenizer: A hooked model or a Hugging Face tokenizer.
        days: The days, ``0..6`` (default: all of them).
        offsets: Non-negative offsets (default ``range(7)``).
        template: The template (default ``"{a} + {b} days ="``).
        **options: As for :func:`cyclic` (``names``, ``few_shot``, ``scoring``, ``prepend_bos``, ``seed``).

    Returns:
        The prompt set.
    """
    return cyclic(model_or_tokenizer, "weekday", days, offsets, template, **options)


@checked
def months(model_or_tokenizer: Any, months: Optional[Iterable[int]] = None,
           offsets: Union[int, Iterable[int], None] = None, template: Optional[str] = None,
           **options: Any) -> PromptSet:
    """Month arithmetic, ``"March + 5 months ="`` → ``"August"`` (January = 0); see :func:`cyclic`.

    Args:
        model_or_tokenizer: A hooked model or a Hugging Face tokenizer.
        months: The months, ``0..11`` (default: all of them).
        offsets: Non-negative offsets (default ``range(12)``).
        template: The template (default ``"{a} + {b} months ="``).
        **options: As for :func:`cyclic`.

    Returns:
        The prompt set.
    """
    return cyclic(model_or_tokenizer, "month", months, offsets, template, **options)


@checked
def hours(model_or_tokenizer: Any, hours: Optional[Iterable[int]] = None,
          offsets: Union[int, Iterable[int], None] = None, template: Optional[str] = None,
          **options: Any) -> PromptSet:
    """Clock arithmetic mod 24, ``"21 + 5 hours ="`` → ``"2"``; see :func:`cyclic`.

    Args:
        model_or_tokenizer: A hooked model or a Hugging Face tokenizer.
        hours: The hours, ``0..23`` (default: all of them).
        offsets: Non-negative offsets (default ``range(24)``).
        template: The template (default ``"{a} + {b} hours ="``).
        **options: As for :func:`cyclic`; ``names=`` writes hours otherwise, e.g.
            ``[f"{h}h" for h in range(24)]``.

    Returns:
        The prompt set.
    """
    return cyclic(model_or_tokenizer, "hour", hours, offsets, template, **options)


@checked
def counterfactual(prompts: PromptSet, vary: str = "a", seed: int = 0,
                   distinct_first_token: bool = False) -> PromptPairs:
    """Pair every prompt with another prompt *of the same set* that changes the value (``vary="a"``:
    another day, same offset) or the offset (``vary="b"``: same day, another offset) and the answer.

    Unlike :meth:`PromptSet.counterfactual`, which draws one partner and drops it when its tokens
    do not line up, the partner is drawn (seeded) among every prompt of the set whose tokens align
    position for position — names of different token counts ("May" and "September" under a BPE
    tokenizer) pair with names of their own count. Prompts with no aligned partner are dropped and
    counted in ``pairs.meta``.

    Args:
        prompts: A cyclic prompt set (from :func:`cyclic`).
        vary: ``"a"`` (another value, same offset) or ``"b"`` (same value, another offset).
        seed: Seeds the choice of partners.
        distinct_first_token: Only partners whose answer starts with another token (names that share
            a leading piece, such as a space token, make first-token metrics 0; alternatively score
            every answer token with ``prompts.with_scoring("full-answer")``).

    Returns:
        The pairs; ``meta`` counts the dropped and kept prompts and the pairs whose answers share a
        first token.

    Raises:
        ConfigError: ``vary`` is not ``"a"`` or ``"b"``.
        TaskError: the set is not cyclic or has fewer than two
            prompts, or no prompt has an aligned partner.
    """
    if vary not in ("a", "b"):
        raise ConfigError(f"vary must be 'a' (change the value, e.g. the day) or 'b' (change the offset), got {vary!r}")
    period_of(prompts)  # a cyclic prompt set
    if len(prompts) < 2:
        raise TaskError(f"counterfactual pairs need at least two prompts, got {len(prompts)}")
    kept = prompts.b if vary == "a" else prompts.a  # what the partner keeps
    ok = (kept[:, None] == kept[None, :]) & (prompts.answer[:, None] != prompts.answer[None, :])
    ok &= (prompts.lengths[:, None] == prompts.lengths[None, :])
    ok &= prompts.n_answer_tokens[:, None] == prompts.n_answer_tokens[None, :]
    for position in prompts.positions.values():
        ok &= position[:, None] == position[None, :]
    if distinct_first_token:
        first = prompts.answer_tokens[:, 0]
        ok &= first[:, None] != first[None, :]
    generator = torch.Generator().manual_seed(int(seed))
    # a seeded uniform choice among each row's candidates: the largest random key wins
    keys = torch.rand(ok.shape, generator=generator).masked_fill(~ok, -1.0)
    partner = keys.argmax(1)
    has = ok.any(1)
    clean_rows = torch.nonzero(has).flatten()
    if len(clean_rows) == 0:
        need = " and a different first answer token" if distinct_first_token else ""
        raise TaskError(f"no prompt has a partner with aligned tokens{need} for vary={vary!r}; build the prompts "
                        "over more values and offsets")
    clean, corrupt = prompts[clean_rows], prompts[partner[clean_rows]]
    same = int((clean.answer_tokens[:, 0] == corrupt.answer_tokens[:, 0]).sum())
    if same and prompts.scoring == "first-token":
        warnings.warn(
            f"{same} of {len(clean)} pairs have clean and corrupt answers that start with the same first token, "
            "so a first-token logit difference is 0 on them; pass distinct_first_token=True, or score every "
            "answer token with prompts.with_scoring('full-answer')",
            stacklevel=2,
        )
    meta = dict(dropped=len(prompts) - len(clean), kept=len(clean), same_first_token=same)
    return PromptPairs(clean, corrupt, vary=vary, seed=seed, meta=meta)


@checked
def period_of(prompts: PromptSet) -> int:
    """The period of a cyclic prompt set: the axis length for Fourier and helix fits.

    Args:
        prompts: A prompt set from :func:`cyclic`.

    Returns:
        The period (7, 12, 24).

    Raises:
        TaskError: The prompts carry no cyclic concept.
    """
    info = prompts.meta.get("concept")
    if not info:
        raise TaskError("these prompts carry no cyclic concept; build them with arithinterp.cyclic.cyclic()")
    return int(info["period"])


@checked
def wraps(prompts: PromptSet) -> torch.Tensor:
    """How often each prompt wraps around the cycle: the cyclic analogue of a carry
    (``"Saturday + 3 days"`` wraps once), a probe label.

    Args:
        prompts: A prompt set from :func:`cyclic`.

    Returns:
        Int[Tensor, "prompt"]: ``(a + b) // period``.

    Raises:
        TaskError: The prompts carry no cyclic concept.
    """
    return (prompts.a + prompts.b) // period_of(prompts)


def _in_range(name: str, values: Union[int, Iterable[int]], low: int, high: Optional[int]) -> list[int]:
    out = operand_values(name, values)
    bad = [v for v in out if v < low or (high is not None and v >= high)]
    if bad:
        limit = f"{low}..{high - 1}" if high is not None else f">= {low}"
        raise TaskError(f"{name} must lie in {limit}, got {bad[0]}")
    return out
