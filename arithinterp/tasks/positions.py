"""Position specs: the names, shifts and indices an analysis reads or patches at, resolved to tokens.

A spec is ``"final"`` (alias ``"last"``), ``"a"`` / ``"b"`` (the operand's last token),
``"a[k]"`` / ``"b[k]"`` (token ``k`` of the operand), ``"answer[k]"`` (answer token ``k``;
tokens count in written order from 0, and :func:`predicting_position` names the one that
predicts an answer token), any of them shifted by
tokens (``"final-2"``), an int (same-length prompts only) or ``"all"``. Nothing is wrapped or
clamped: a spec that falls outside a prompt is refused with a :class:`~arithinterp.errors.SiteError`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from arithinterp.errors import SiteError, accepted

if TYPE_CHECKING:
    from arithinterp.tasks.prompt_set import PromptSet

_POSITION_RE = re.compile(
    r"(?P<name>(?P<operand>a|b|answer)\[(?P<index>-?\d+)\]|[A-Za-z_][\w]*)(?P<shift>[+-]\d+)?"
)
_POSITION_FORMS = (
    "'final' ('last'), 'a', 'b' (last token of the operand), 'a[k]', 'b[k]' (token k, negative from the end), "
    "'answer[k]', a name shifted by tokens ('final-2', 'a[0]-1'), 'all', or an int (same-length prompts only)"
)


def locate(prompts: PromptSet, positions: Any, *, answers: int = 0) -> tuple[list[str], torch.Tensor]:
    """Resolve position specs to token indices in the left-padded frame of ``prompts``
    (:meth:`PromptSet.locate <arithinterp.tasks.PromptSet.locate>` documents the specs).

    Args:
        prompts: The prompts the positions are in.
        positions: One spec or a list of them.
        answers: How many answer tokens the caller feeds after each prompt.

    Returns:
        ``(labels, index)``: a label per spec and ``index`` ``[N, n_positions]`` (long) into
        ``prompts.tokens`` followed by the fed answer tokens.

    Raises:
        SiteError: a spec cannot be read, or falls outside some prompt (and its fed answer).
    """
    width = prompts.tokens.shape[1]
    positions = list(positions) if isinstance(positions, (list, tuple)) else [positions]
    if not positions:
        raise SiteError(f"positions is empty; accepted: {_POSITION_FORMS}")
    one_length = len(set(prompts.lengths.tolist())) <= 1
    if "all" in positions:
        if len(positions) > 1:
            raise SiteError("positions='all' cannot be combined with other positions")
        if not one_length:
            raise SiteError(
                "positions='all' needs prompts of one token length; these have lengths "
                f"{sorted(set(prompts.lengths.tolist()))}: pick named positions ({_POSITION_FORMS}) instead"
            )
        length = int(prompts.lengths[0]) if len(prompts) else width
        positions = list(range(width - length, width))  # the prompts' own tokens, not the padding
    # each prompt's tokens in the padded frame: [start, stop), with its fed answer tokens
    start = width - prompts.lengths
    stop = width + torch.clamp(prompts.n_answer_tokens, max=answers)
    labels, columns = [], []
    for spec in positions:
        label, column = _locate_one(prompts, spec, width, one_length)
        bad = (column < start) | (column >= stop)
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            where = "the prompt and its fed answer" if answers else "the prompt"
            past = bool(column[i] >= stop[i]) and not answers
            hint = "; positions past 'final' need the answer tokens fed (collect feeds them)" if past else ""
            raise SiteError(
                f"position {spec!r} falls outside {where} for {int(bad.sum())} of {len(prompts)} prompts "
                f"(e.g. prompt {i} {prompts.texts[i]!r}: index {int(column[i])}, its tokens are "
                f"{int(start[i])}..{int(stop[i]) - 1} of the padded frame){hint}"
            )
        labels.append(label)
        columns.append(column)
    return labels, torch.stack(columns, dim=1).long()


def _locate_one(prompts: PromptSet, spec: Any, width: int, one_length: bool) -> tuple[str, torch.Tensor]:
    """One spec → its label and per-prompt index [N] (range checks are the caller's)."""
    if not isinstance(spec, (bool, str)) and hasattr(spec, "__index__"):
        spec = int(spec.__index__())  # numpy / torch integers
    if isinstance(spec, str) and re.fullmatch(r"-?\d+", spec.strip()):
        spec = int(spec)  # "3" from a command line or a component name such as "attn0@3"
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise SiteError(f"a position must be a name or an int, got {spec!r}; accepted: {_POSITION_FORMS}")
    if isinstance(spec, int):
        if not one_length:
            raise SiteError(
                f"integer position {spec} reads a different token in prompts of different lengths "
                f"(lengths here: {sorted(set(prompts.lengths.tolist()))}); use a named position or one "
                f"relative to a name, e.g. 'final-2' or 'a[0]' ({_POSITION_FORMS})"
            )
        if not -width <= spec < width:
            raise SiteError(f"position {spec} is out of range for prompts of {width} tokens; "
                            f"accepted: 0..{width - 1} (or {-width}..-1 counted from the end), "
                            f"or a named position ({_POSITION_FORMS})")
        return str(spec), torch.full((len(prompts),), spec % width, dtype=torch.long)
    match = _POSITION_RE.fullmatch(spec.replace(" ", ""))
    if match is None:
        raise SiteError(f"cannot read position {spec!r}; accepted: {_POSITION_FORMS}")
    name, operand, index, shift = match.group("name", "operand", "index", "shift")
    label = "final" + (shift or "") if name == "last" else spec.replace(" ", "")
    if name == "last":
        name = "final"
    if operand == "answer":
        k = int(index)
        if k < 0:
            raise SiteError(f"answer[{k}]: answer tokens are counted from 0 (answer[0] is the first answer token)")
        column = prompts.positions["final"] + 1 + k
    elif operand is not None:
        column = _operand_token(prompts, operand, int(index), spec)
    elif name in prompts.positions:
        column = prompts.positions[name]
    else:
        others = [k for k in prompts.positions if k not in ("a", "b", "final", "a[0]", "b[0]")]
        raise SiteError(f"unknown position {spec!r}; accepted: {_POSITION_FORMS}"
                        + (f", or {accepted(others)}" if others else ""))
    return label, column + (int(shift) if shift else 0)


def _operand_token(prompts: PromptSet, operand: str, k: int, spec: str) -> torch.Tensor:
    """Index [N] of token ``k`` of an operand (``k < 0`` from its last token)."""
    last = prompts.positions[operand]
    first = prompts.positions.get(f"{operand}[0]", last)
    count = last - first + 1
    column = first + k if k >= 0 else last + 1 + k
    missing = (k >= count) if k >= 0 else (-k > count)
    if missing.any():
        i = int(torch.nonzero(missing)[0])
        raise SiteError(
            f"position {spec!r}: {operand}={int(getattr(prompts, operand)[i])} in prompt {i} ({prompts.texts[i]!r}) "
            f"has {int(count[i])} token(s); operands here span {sorted(set(count.tolist()))} tokens. Use "
            f"'{operand}' (last token), '{operand}[0]' (first) or operands of one token count"
        )
    return column


def predicting_position(k: int) -> str:
    """The position whose output predicts answer token ``k`` (written order, from 0): the token
    before it, ``"final"`` for the first and ``"answer[k-1]"`` after.

    Args:
        k: The answer token, 0 = the first written.

    Returns:
        The position spec.

    Raises:
        SiteError: ``k`` is negative.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise SiteError(f"answer tokens are counted from 0 (answer[0] is the first written), got {k!r}")
    return "final" if k == 0 else f"answer[{k - 1}]"


def position_labels(positions: Any) -> list[str]:
    """The labels of position specs as :meth:`PromptSet.locate` names them: one spec (a string is
    one spec, never its letters) or a list of them, spaces dropped, ``"last"`` written ``"final"``
    (its alias), integers as their digits. For graphs and other per-position results keyed by label.

    Args:
        positions: One spec or a list of them.

    Returns:
        One label per spec, in order.

    Raises:
        SiteError: a spec is neither a name nor an int.
    """
    specs = list(positions) if isinstance(positions, (list, tuple)) else [positions]
    labels = []
    for spec in specs:
        if not isinstance(spec, (bool, str)) and hasattr(spec, "__index__"):
            spec = int(spec.__index__())
        if isinstance(spec, bool) or not isinstance(spec, (int, str)):
            raise SiteError(f"a position must be a name or an int, got {spec!r}; accepted: {_POSITION_FORMS}")
        label = str(spec).replace(" ", "")
        labels.append(re.sub(r"^last(?=$|[+-])", "final", label))
    return labels
