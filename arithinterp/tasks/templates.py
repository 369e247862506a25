"""How a prompt is written: templates and their fields, operand and answer text, few-shot prefixes.

A template holds ``{a}``, ``{b}`` and ``{op}`` (the operator's symbol, :data:`OP_SYMBOLS`); the
answer follows it directly. Operand ``a`` and the answer may be written as names (weekdays,
months: :mod:`arithinterp.cyclic`).
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional, Sequence, Union

from arithinterp.checks import integer
from arithinterp.errors import ConfigError, TaskError
from arithinterp.tasks.operators import OPERATORS, compute, defined

# how ``{op}`` is written in a template, and the symbols that show an operator in template text
OP_SYMBOLS: dict[str, str] = {"+": "+", "-": "-", "*": "*", "//": "//", "mod": "%"}
_SHOWN_BY: dict[str, tuple[str, ...]] = {"+": ("+",), "-": ("-",), "*": ("*",), "//": ("//",), "mod": ("%", "mod")}
TEMPLATE_FIELDS = ("{a}", "{b}", "{op}")
DEFAULT_TEMPLATE = "{a}{op}{b}="
MAX_FEW_SHOT = 1000  # solved examples: some 6,000 tokens, past the context of the models studied here


def check_template(template: Any, op: str) -> str:
    """Validate a prompt template for operator ``op``.

    Fields are ``{a}``, ``{b}`` and ``{op}`` (written as :data:`OP_SYMBOLS`). A template without
    ``{op}`` that shows another operator's symbol but not ``op``'s (``'{a}+{b}='`` for ``'-'``)
    would label its text with the wrong answers, so it is refused.

    Args:
        template: The template to check (anything: a non-string is refused).
        op: The operator the prompts compute.

    Returns:
        ``template``, unchanged.

    Raises:
        TaskError: ``template`` is not a string, has an unknown field, lacks ``{a}`` or ``{b}`` or
            repeats one, or writes another operator than ``op``.
    """
    if not isinstance(template, str):
        raise TaskError(f"template must be a string such as {DEFAULT_TEMPLATE!r}, got {template!r}")
    unknown = [f for f in re.findall(r"\{[^{}]*\}", template) if f not in TEMPLATE_FIELDS]
    if unknown:
        raise TaskError(f"template {template!r} has the unknown field {unknown[0]}; accepted fields: "
                        f"{', '.join(TEMPLATE_FIELDS)}")
    if template.count("{a}") != 1 or template.count("{b}") != 1:  # a repeated operand is not what is scored
        raise TaskError(f"template must contain '{{a}}' and '{{b}}' once each, got {template!r}")
    if "{op}" in template or op not in OPERATORS:
        return template
    text = re.sub(r"\{[ab]\}", " ", template)
    shown = [o for o, symbols in _SHOWN_BY.items() if any(s in text for s in symbols)]
    if shown and op not in shown:
        raise TaskError(
            f"template {template!r} writes the operator {shown[0]!r} but op is {op!r}, so every prompt would "
            f"contradict its answer; use '{{op}}' in the template (e.g. {DEFAULT_TEMPLATE!r}) or write "
            f"{OP_SYMBOLS[op]!r} in it"
        )
    return template


def render(template: str, a: int, b: int, op: str, names: Optional[Sequence[str]] = None) -> str:
    """The text of one prompt: ``template`` with ``{a}``, ``{b}`` and ``{op}`` filled in
    (``a`` written as ``names[a]`` when names are given).

    Args:
        template: A template (see :func:`check_template`).
        a: The first operand.
        b: The second operand.
        op: The operator, written as its :data:`OP_SYMBOLS` symbol.
        names: How operand ``a`` is written (``names[a]``), or ``None`` for its digits.

    Returns:
        The prompt text, without the answer.
    """
    return text_and_spans(template, "", a, b, op, names)[0]


def text_and_spans(template: str, prefix: str, a: int, b: int, op: str = "+",
                   names: Optional[Sequence[str]] = None) -> tuple[str, dict[str, tuple[int, int]]]:
    """The prompt text and the character spans of ``{a}`` and ``{b}`` in it (``a`` written as
    ``names[a]`` when names are given).

    Args:
        template: A template (see :func:`check_template`).
        prefix: Text before the prompt (a few-shot prefix, or ``""``).
        a: The first operand.
        b: The second operand.
        op: The operator, written as its :data:`OP_SYMBOLS` symbol.
        names: How operand ``a`` is written (``names[a]``), or ``None`` for its digits.

    Returns:
        ``(text, spans)``: the prefix and the prompt, and ``spans["a"]`` / ``spans["b"]``, each
        operand's ``(start, end)`` character offsets in that text.
    """
    text, spans = prefix, {}
    for piece in re.split(r"(\{a\}|\{b\}|\{op\})", template):
        if piece == "{op}":
            text += OP_SYMBOLS[op]
        elif piece in ("{a}", "{b}"):
            name = piece[1]
            value = names[a] if names and name == "a" else str(a if name == "a" else b)
            spans[name] = (len(text), len(text) + len(value))
            text += value
        else:
            text += piece
    return text, spans


def answer_text(value: int, answer_digits: int = 0, names: Optional[Sequence[str]] = None) -> str:
    """How an answer is written: plain, zero-padded to ``answer_digits`` digits, or as ``names[value]``.

    Args:
        value: The answer.
        answer_digits: Zero-pad to this many digits (0: plain).
        names: Write the answer as ``names[value]`` instead of digits.

    Returns:
        The answer's text.

    Raises:
        TaskError: ``answer_digits`` is negative, or ``value`` has no name in ``names``.
    """
    if names:
        if not 0 <= value < len(names):
            raise TaskError(f"the answer {value} has no name: names holds {len(names)} (answers 0 to {len(names) - 1})")
        return names[value]
    if answer_digits < 0:
        raise TaskError(f"answer_digits must be 0 (plain) or a positive number of digits, got {answer_digits}")
    return f"{value:0{answer_digits}d}" if answer_digits else str(value)


def few_shot_prefix(
    few_shot: Union[int, str], op: str, template: str, a_vals: Sequence[int], b_vals: Sequence[int],
    modulus: Optional[int], seed: int, answer_digits: int = 0, names: Optional[Sequence[str]] = None,
) -> str:
    """The few-shot prefix written before every prompt: ``few_shot`` solved examples, one per line.

    Args:
        few_shot: How many examples to draw (seeded), or the prefix itself as a string.
        op: The operator of the examples.
        template: The template the examples are written with.
        a_vals: First operands to draw from.
        b_vals: Second operands to draw from (those for which ``op`` is undefined are redrawn).
        modulus: Reduce the examples' answers mod this (``None``: not reduced).
        seed: The seed of the draws.
        answer_digits: Zero-pad the examples' answers to this many digits (0: plain).
        names: Write operand ``a`` and the answers as names (see :func:`answer_text`).

    Returns:
        The prefix (``""`` for no examples).

    Raises:
        TaskError: ``few_shot`` is neither a string nor an int in 0..:data:`MAX_FEW_SHOT`, ``op``
            is not an operator, or there are no operands to draw examples from.
    """
    if isinstance(few_shot, str):
        return few_shot
    few_shot = integer("few_shot", few_shot, minimum=0, error=TaskError,
                       hint=" (number of examples) or a prefix string")
    if few_shot > MAX_FEW_SHOT:  # refused before building prompts longer than any model's context
        raise TaskError(f"few_shot must be at most {MAX_FEW_SHOT} examples, got {few_shot:,}")
    if op not in OPERATORS:
        raise ConfigError(f"unknown operator {op!r}; accepted: {', '.join(map(repr, OPERATORS))}")
    if few_shot and not (a_vals and any(defined(op, b) for b in b_vals)):  # stops at the first usable b
        raise TaskError(f"few-shot examples need a value of a and a value of b that {op!r} is defined for; got "
                        f"{len(a_vals)} values of a and b = {list(b_vals)[:5]}")
    rng = random.Random(seed + 7919)
    lines = []
    for _ in range(few_shot):
        a, b = rng.choice(a_vals), rng.choice(b_vals)
        while not defined(op, b):
            b = rng.choice(b_vals)
        lines.append(render(template, a, b, op, names) + answer_text(compute(op, a, b, modulus), answer_digits, names)
                     + "\n")
    return "".join(lines)


def check_names(names: Any, a_values: Sequence[int], modulus: Optional[int]) -> Optional[list[str]]:
    """Validate ``names`` (how operand ``a`` and the answer are written): distinct non-empty
    strings, one per value of the cycle (``modulus == len(names)``, so every answer — and every
    few-shot example's — has a name), and every ``a`` an index into them.

    Args:
        names: The names, or ``None`` (operands and answers written as digits).
        a_values: The first operands the names must cover.
        modulus: The answers' modulus, which must equal ``len(names)``.

    Returns:
        The names as a list, or ``None`` when ``names`` is ``None``.

    Raises:
        TaskError: the names are not at least two distinct non-empty strings, ``modulus`` is not
            their number, or an ``a`` is not an index into them.
    """
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(n, str) and n.strip() for n in names):
        raise TaskError(f"names must be a sequence of non-empty strings (e.g. weekday names), got {names!r}")
    names = list(names)
    if len(set(names)) != len(names) or len(names) < 2:
        raise TaskError(f"names must be at least two distinct strings, got {names!r}")
    if modulus != len(names):
        raise TaskError(f"answers written as names need modulus={len(names)} (one name per value of the cycle), "
                        f"got modulus={modulus!r}")
    bad = [a for a in a_values if not 0 <= a < len(names)]
    if bad:
        raise TaskError(f"with {len(names)} names, a must lie in 0..{len(names) - 1}, got {bad[0]}")
    return names
