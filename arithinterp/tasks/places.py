"""Place-value names of digits: ``units``, ``tens``, ``hundreds``, ``thousands``, ... .

One numbering for the whole package. A digit meant by its *value* is named by its place: labels
``a_units``, ``answer_tens``, ``carry_hundreds`` (the carry *into* the hundreds column), the
causal variables of :func:`arithinterp.causal.addition`, the probe target ``model_answer_tens``,
:func:`arithinterp.patching.vary_digit`'s ``place``, the error detector's digit slots. A *position*
counts tokens in the order they are written, from 0: ``answer[0]`` is the first answer token (the
leading digit when each digit is a token), ``a[0]`` the operand's first token.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional

from arithinterp.errors import ConfigError, accepted

if TYPE_CHECKING:
    from arithinterp.tasks.prompt_set import PromptSet

#: Place names, ``PLACES[i]`` for the digit of value ``10 ** i``; an int64 has 19 digits.
PLACES = (
    "units", "tens", "hundreds", "thousands", "ten_thousands", "hundred_thousands", "millions", "ten_millions",
    "hundred_millions", "billions", "ten_billions", "hundred_billions", "trillions", "ten_trillions",
    "hundred_trillions", "quadrillions", "ten_quadrillions", "hundred_quadrillions", "quintillions",
)
_PLACE_FORMS = "units, tens, hundreds, thousands, ten_thousands, ... quintillions"


def place_name(power: int) -> str:
    """The name of the digit of value ``10 ** power``.

    Args:
        power: 0 (units) .. 18 (quintillions).

    Returns:
        The place's name, e.g. ``"tens"`` for 1.

    Raises:
        ConfigError: ``power`` is not an int in 0..18.
    """
    if isinstance(power, bool) or not isinstance(power, int) or not 0 <= power < len(PLACES):
        raise ConfigError(f"a digit's place is a power of ten in 0..{len(PLACES) - 1} (units .. quintillions), "
                          f"got {power!r}")
    return PLACES[power]


def place_power(name: str) -> int:
    """The power of ten a place name stands for (``"hundreds"`` → 2).

    Args:
        name: A place name from :data:`PLACES`.

    Returns:
        0 for ``"units"``, 1 for ``"tens"``, ...

    Raises:
        ConfigError: ``name`` is not a place name.
    """
    if name not in PLACES:
        raise ConfigError(f"unknown place {name!r}; accepted: {_PLACE_FORMS}")
    return PLACES.index(name)


def split_place(name: str, stems: tuple[str, ...]) -> Optional[tuple[str, int]]:
    """``"answer_tens"`` → ``("answer", 1)`` for a stem of ``stems``; ``None`` for any other name."""
    for stem in sorted(stems, key=len, reverse=True):  # "model_answer" before "answer"
        if name.startswith(stem + "_") and name[len(stem) + 1:] in PLACES:
            return stem, PLACES.index(name[len(stem) + 1:])
    return None


_OLD = re.compile(r"(?P<stem>model_answer|answer|sum|a|b|column_sum)_digit_(?P<i>\d+)|"
                  r"(?P<column>column_sum)_(?P<j>\d+)|carry_?(?P<k>\d+)")


def renamed(name: str, *, carry_into: bool) -> Optional[str]:
    """Where ``name`` is a digit named by its index (``answer_digit_0``, ``carry_1``, ``carry2``), a
    sentence naming the place-value name that means it; ``None`` for any other name.

    Args:
        name: The name that was refused.
        carry_into: Whether ``carry_i`` meant the carry *into* digit ``i`` (the causal variables),
            rather than *out of* it (the prompt labels).

    Returns:
        The hint for the error message, or ``None``.
    """
    match = _OLD.fullmatch(name)
    if match is None:
        return None
    if match["k"] is not None:
        power = int(match["k"]) + (0 if carry_into else 1)
        if not 1 <= power < len(PLACES):
            return f"carries are named by the column they go into: carry_tens .. carry_{PLACES[-1]}"
        return (f"carries are named by the column they go into: {f'carry_{PLACES[power]}'!r} "
                f"(the carry out of the {PLACES[power - 1]})")
    stem = match["stem"] or match["column"]
    stem = "answer" if stem == "sum" else stem
    power = int(match["i"] if match["i"] is not None else match["j"])
    if power >= len(PLACES):
        return f"digits are named by their place: {stem}_units .. {stem}_{PLACES[-1]}"
    return f"digits are named by their place: {f'{stem}_{PLACES[power]}'!r}"


def refuse_renamed(name: str, *, what: str, known: list[str], carry_into: bool) -> None:
    """Raise a :class:`ConfigError` naming the new name when ``name`` is a digit named by its index.

    Args:
        name: The refused name.
        what: What kind of name it is (``"label"``, ``"variable"``, ``"target"``).
        known: The names accepted where it was given.
        carry_into: As in :func:`renamed`.

    Raises:
        ConfigError: ``name`` is an index-numbered digit name.
    """
    hint = renamed(name, carry_into=carry_into)
    if hint is not None:
        raise ConfigError(f"unknown {what} {name!r}: {hint}; accepted: {accepted(known)}")


def answer_token_places(prompts: PromptSet) -> Optional[list[str]]:
    """The place of each answer token, when every answer is written with the same number of
    one-digit tokens (``zoo:add-3digit``'s zero-padded answers: thousands, hundreds, tens, units).

    Args:
        prompts: The prompts (K answer tokens).

    Returns:
        ``K`` place names, first written first; ``None`` when answer token ``k`` is not the same
        place in every prompt (answers of different lengths, tokens of several digits).
    """
    k = prompts.answer_tokens.shape[1]
    if len(prompts) == 0 or not 1 < k <= len(PLACES) or bool((prompts.n_answer_tokens != k).any()):
        return None
    if any(len(text) != k or not text.isdigit() for text in set(prompts.answer_texts)):
        return None
    return [PLACES[k - 1 - j] for j in range(k)]
