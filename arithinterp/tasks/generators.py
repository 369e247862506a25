"""Building prompt sets: :func:`arithmetic` (every pair of a grid) and :func:`prompts_for_pairs` (given pairs).

Both take a hooked model (its tokenizer, BOS setting and context length are used) or a Hugging Face
tokenizer, and refuse what would give wrong prompts: an unknown operator, a template that writes
another operator, operands that share tokens with the template, prompts longer than the model's
context. :func:`number_check` lists the numbers a tokenizer writes as one token; :func:`parse_prompt`
reads one problem written out as text.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional, Sequence, Union

from arithinterp.errors import ConfigError, TaskError, TokenizationError, accepted
from arithinterp.tasks.encoding import encode_prompts
from arithinterp.tasks.operators import MAX_PROMPTS, OPERATORS, defined, operand_values
from arithinterp.tasks.prompt_set import SCORING, PromptSet
from arithinterp.tasks.templates import DEFAULT_TEMPLATE, OP_SYMBOLS, check_names, check_template, few_shot_prefix
from arithinterp.types import Modulus, NonNegativeInt, checked


def _tokenizer_of(model_or_tokenizer: Any) -> Any:  # a Hugging Face tokenizer, duck-typed
    tokenizer = getattr(model_or_tokenizer, "tokenizer", None) or model_or_tokenizer
    if not callable(tokenizer) or not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise TaskError(
            "expected a hooked model with a .tokenizer or a Hugging Face tokenizer, "
            f"got {type(model_or_tokenizer).__name__}"
        )
    return tokenizer


def _default_prepend_bos(model_or_tokenizer: Any, tokenizer) -> bool:
    cfg = getattr(model_or_tokenizer, "cfg", None)
    if cfg is not None and hasattr(cfg, "default_prepend_bos"):
        return bool(cfg.default_prepend_bos) and tokenizer.bos_token_id is not None
    return tokenizer.bos_token_id is not None


@checked
def arithmetic(
    model_or_tokenizer: Any,
    op: str = "+",
    a: Union[int, Iterable[int]] = range(10),
    b: Union[int, Iterable[int]] = range(10),
    template: str = DEFAULT_TEMPLATE,
    **options: Any,
) -> PromptSet:
    """Every prompt of ``template`` over the grid ``a × b``.

    Pairs with ``b == 0`` are skipped for ``//`` and ``mod`` (recorded in ``meta["skipped"]``).

    Args:
        model_or_tokenizer: a hooked model (its tokenizer and BOS setting are used) or a tokenizer.
        op: ``"+"``, ``"-"``, ``"*"``, ``"//"`` or ``"mod"`` (``a mod b``).
        a: first operand values (an int or an iterable).
        b: second operand values; every combination with ``a`` is used.
        template: must contain ``{a}`` and ``{b}``, may contain ``{op}`` (the operator's symbol:
            ``+ - * // %``); the answer follows it directly. A template that writes another
            operator than ``op`` is refused (:func:`check_template`).
        **options: as for :func:`prompts_for_pairs` (``modulus``, ``few_shot``, ``scoring``,
            ``answer_digits``, ``prepend_bos``, ``require_single_tokens``, ``seed``).

    Returns:
        ``len(a) * len(b)`` prompts (fewer where pairs are skipped), ``a`` varying slowest.

    Raises:
        ConfigError: a declared parameter is refused (see :func:`prompts_for_pairs`).
        TaskError: an argument is refused (see :func:`prompts_for_pairs`), or the grid holds more than
            :data:`~arithinterp.tasks.operators.MAX_PROMPTS` prompts.
        TokenizationError: the prompts do not tokenize as arithmetic prompts.
    """
    a_vals, b_vals = operand_values("a", a), operand_values("b", b)
    if len(a_vals) * len(b_vals) > MAX_PROMPTS:  # refused before the grid is built in memory
        raise TaskError(f"a × b is {len(a_vals):,} × {len(b_vals):,} = {len(a_vals) * len(b_vals):,} prompts, more "
                        f"than the {MAX_PROMPTS:,} a prompt set holds; use smaller operand ranges")
    grid = [(x, y) for x in a_vals for y in b_vals]
    return prompts_for_pairs(model_or_tokenizer, op, [p[0] for p in grid], [p[1] for p in grid], template, **options)


@checked
def prompts_for_pairs(
    model_or_tokenizer: Any,
    op: str,
    a: Sequence[int],
    b: Sequence[int],
    template: str = DEFAULT_TEMPLATE,
    *,
    modulus: Optional[Modulus] = None,
    few_shot: Union[NonNegativeInt, str] = 0,
    answer_digits: NonNegativeInt = 0,
    prepend_bos: Optional[bool] = None,
    scoring: str = "first-token",
    require_single_tokens: bool = False,
    seed: int = 0,
    names: Optional[Sequence[str]] = None,
) -> PromptSet:
    """Prompts for the explicit operand pairs ``zip(a, b)``.

    Args:
        model_or_tokenizer: a hooked model (its tokenizer, BOS setting and context length are
            used) or a tokenizer.
        op: ``"+"``, ``"-"``, ``"*"``, ``"//"`` or ``"mod"``.
        a: the first operand of each prompt.
        b: the second operand of each prompt (as many as ``a``).
        template: the prompt template (see :func:`arithmetic`).
        modulus: reduce answers mod this (e.g. 113 for modular addition).
        few_shot: number of solved examples to prefix (one per line, seeded), or a prefix string.
        answer_digits: write answers zero-padded to this many digits (0 = plain).
        prepend_bos: start every prompt with BOS; ``None`` follows the model (or the tokenizer).
        scoring: ``"first-token"`` (logit metrics on the answer's first token) or
            ``"full-answer"`` (teacher-forced log-prob of every answer token).
        require_single_tokens: raise if any operand spans several tokens (analyses that read one
            operand position need this).
        seed: the seed of the few-shot examples.
        names: write operand ``a`` and the answer as ``names[value]`` (weekdays, months: see
            :mod:`arithinterp.cyclic`); needs ``modulus=len(names)`` and every ``a`` below it.

    Returns:
        One prompt per pair for which ``op`` is defined (pairs with ``b == 0`` for ``//`` and
        ``mod`` are skipped and counted in ``meta["skipped"]``).

    Raises:
        ConfigError: a declared parameter is refused: ``modulus`` below 2, a negative ``few_shot`` or
            ``answer_digits``, a number that is not an int; an unknown operator or scoring.
        TaskError: a refused template, operand or name, ``a``
            and ``b`` of different lengths, no defined pair, or prompts longer than the model's context.
        TokenizationError: the prompts do not tokenize as arithmetic prompts, or an operand spans
            several tokens with ``require_single_tokens``.
    """
    if op not in OPERATORS:
        raise ConfigError(f"unknown operator {op!r}; accepted: {accepted(OPERATORS)}")
    check_template(template, op)
    if scoring not in SCORING:
        raise ConfigError(f"unknown scoring {scoring!r}; accepted: {accepted(SCORING)}")
    tokenizer = _tokenizer_of(model_or_tokenizer)
    a_vals, b_vals = operand_values("a", a), operand_values("b", b)
    if len(a_vals) != len(b_vals):
        raise TaskError(f"a and b must have the same length, got {len(a_vals)} and {len(b_vals)}")
    pairs = [(x, y) for x, y in zip(a_vals, b_vals) if defined(op, y)]
    skipped = len(a_vals) - len(pairs)
    if not pairs:
        raise TaskError(f"no (a, b) pair is defined for {op!r} (b must be non-zero)")
    if prepend_bos is None:
        prepend_bos = _default_prepend_bos(model_or_tokenizer, tokenizer)
    names = check_names(names, a_vals, modulus)
    prefix = few_shot_prefix(few_shot, op, template, a_vals, b_vals, modulus, seed, answer_digits, names)
    prompts = PromptSet(**encode_prompts(
        tokenizer,
        [op] * len(pairs),
        [p[0] for p in pairs],
        [p[1] for p in pairs],
        template,
        prefix,
        modulus,
        prepend_bos,
        scoring,
        answer_digits,
        names,
    ))
    _check_context(model_or_tokenizer, prompts)
    if skipped:
        prompts.meta["skipped"] = dict(count=skipped, reason=f"b == 0 is undefined for {op!r}")
    if require_single_tokens and not prompts.single_token_operands:
        multi = number_check(tokenizer, sorted(set(a_vals) | set(b_vals)))["multi_token"]
        raise TokenizationError(
            f"operands must be single tokens for this analysis, but {len(multi)} numbers span several "
            f"tokens for this tokenizer (e.g. {multi[:5]}); restrict a and b to single-token numbers "
            "(see tasks.number_check) or use a digit-level analysis"
        )
    return prompts


def _check_context(model_or_tokenizer: Any, prompts: PromptSet) -> None:
    """Refuse prompts (with their fed answer tokens) longer than the model's context, now rather
    than in the first forward pass."""
    n_ctx = getattr(getattr(model_or_tokenizer, "cfg", None), "n_ctx", None)
    if not isinstance(n_ctx, int):
        return
    needed = prompts.tokens.shape[1] + prompts.answer_tokens.shape[1] - 1
    if needed > n_ctx:
        examples = prompts.prefix.count("\n") if prompts.prefix else 0  # only said with a prefix
        few_shot = f", with a few-shot prefix of {examples} solved example(s)," if prompts.prefix else ""
        raise TaskError(
            f"the prompts with their fed answer tokens are up to {needed} tokens long, more than the model's context "
            f"of {n_ctx} tokens (the longest prompt is {prompts.tokens.shape[1]} tokens{few_shot} plus "
            f"{prompts.answer_tokens.shape[1] - 1} fed answer tokens); use fewer few-shot examples, a shorter "
            "template or smaller operands"
        )


@checked
def number_check(model_or_tokenizer: Any, numbers: Iterable[int] = range(1000)) -> dict[str, list[int]]:
    """Which numbers are one token for this tokenizer (written without a leading space).

    Args:
        model_or_tokenizer: a hooked model (its tokenizer is used) or a tokenizer.
        numbers: the numbers to check.

    Returns:
        ``{"single_token": [...], "multi_token": [...]}``, each in the order of ``numbers``.

    Raises:
        TaskError: ``model_or_tokenizer`` has no tokenizer, or ``numbers`` is refused.
    """
    tokenizer = _tokenizer_of(model_or_tokenizer)
    numbers = operand_values("numbers", numbers)
    ids = tokenizer([str(x) for x in numbers], add_special_tokens=False)["input_ids"]
    unk = tokenizer.unk_token_id
    single = [x for x, row in zip(numbers, ids) if len(row) == 1 and row[0] != unk]
    return dict(single_token=single, multi_token=[x for x in numbers if x not in set(single)])


@checked
def parse_prompt(model_or_tokenizer: Any, text: str, *, op: str = "+", template: str = DEFAULT_TEMPLATE,
                 modulus: Optional[Modulus] = None) -> PromptSet:
    """The prompt set of one problem written out as text: its last line read with ``template``
    (``"36+59="``), the lines before it the few-shot prefix; answer digits after the template's end
    (``"36+59=9"``, an answer token fed) are left out of the prompt.

    Args:
        model_or_tokenizer: A hooked model or a tokenizer.
        text: The prompt's text.
        op: The operator.
        template: The template the last line follows.
        modulus: Answers reduced mod this, or None.

    Returns:
        One prompt, with its operands, answer and named positions.

    Raises:
        ConfigError: An unknown operator.
        TaskError: The last line does not follow the template.
    """
    if op not in OPERATORS:
        raise ConfigError(f"unknown operator {op!r}; accepted: {accepted(OPERATORS)}")
    check_template(template, op)
    prefix, _, last = text.rpartition("\n")
    symbol = OP_SYMBOLS.get(op, op)
    pattern = (re.escape(template).replace(re.escape("{a}"), r"(?P<a>\d+)").replace(re.escape("{b}"), r"(?P<b>\d+)")
               .replace(re.escape("{op}"), re.escape(symbol)))
    found = re.fullmatch(pattern + r"\d*", last)
    if found is None:
        raise TaskError(f"{last!r} is not an arithmetic problem of the template {template!r} (e.g. "
                        f"{template.format(a=36, b=59, op=symbol)!r}); give the problem on the prompt's last line")
    return prompts_for_pairs(model_or_tokenizer, op, [int(found["a"])], [int(found["b"])], template,
                             modulus=modulus, few_shot=prefix + "\n" if prefix else 0)
