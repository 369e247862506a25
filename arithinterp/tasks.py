"""Arithmetic prompts: :func:`arithmetic` → :class:`PromptSet` → :class:`PromptPairs`.

A ``PromptSet`` holds tokenized prompts with their operands, true answers, answer token ids and
the token positions of each operand and of the final prompt token. Positions come from the
tokenizer's character offsets, never from guessing, so they are right for word-level number
tokenizers, digit-splitting tokenizers and BPE tokenizers alike.

Prompts of different token lengths are left-padded; every forward runs one length group at a
time, so padding never reaches the model.
"""

from __future__ import annotations

import operator
import random
import re
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union, overload

import torch

from arithinterp.checks import check_belongs, integer
from arithinterp.errors import PromptIndexError, SiteError, TaskError, TokenizationError, accepted
from arithinterp.types import NonNegativeInt, checked

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "//": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
}
# how ``{op}`` is written in a template, and the symbols that show an operator in template text
OP_SYMBOLS: dict[str, str] = {"+": "+", "-": "-", "*": "*", "//": "//", "mod": "%"}
_SHOWN_BY: dict[str, tuple[str, ...]] = {"+": ("+",), "-": ("-",), "*": ("*",), "//": ("//",), "mod": ("%", "mod")}
TEMPLATE_FIELDS = ("{a}", "{b}", "{op}")
DEFAULT_TEMPLATE = "{a}{op}{b}="
# operands and answers are stored as int64
_INT64 = 2**63 - 1
SCORING = ("first_token", "full_answer")
VARY = ("a", "b", "both", "keep_answer", "operator")


def compute(op: str, a: int, b: int, modulus: Optional[int] = None) -> int:
    """The true answer of ``a op b`` (reduced mod ``modulus`` when given)."""
    value = OPERATORS[op](a, b)
    return value % modulus if modulus else value


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


@dataclass(frozen=True)
class Evaluation:
    """The model's answers on a prompt set (greedy generation of the answer tokens)."""

    correct: torch.Tensor  # bool [N]
    model_answer: torch.Tensor  # long [N]; the parsed generated answer, or a sentinel when unparsable
    answer_text: list[str]  # the generated answer strings
    generated_tokens: torch.Tensor  # long [N, K]

    @property
    def accuracy(self) -> float:
        return float(self.correct.float().mean()) if len(self.correct) else float("nan")

    def __len__(self) -> int:
        return len(self.correct)

    def __getitem__(self, index) -> "Evaluation":
        """The evaluation of a subset of the prompts (same indexing as ``PromptSet``)."""
        idx = _as_index(index, len(self))
        return Evaluation(
            self.correct[idx], self.model_answer[idx], [self.answer_text[i] for i in idx.tolist()],
            self.generated_tokens[idx],
        )

    def __repr__(self) -> str:
        return f"Evaluation(accuracy={self.accuracy:.4f}, n={len(self.correct)})"


UNPARSABLE = -(10**9)


@dataclass(frozen=True)
class PromptSet:
    """Tokenized arithmetic prompts with operands, answers, positions and labels.

    Shapes (N prompts, T tokens after left padding, K answer tokens):
    ``tokens`` [N, T], ``lengths`` [N], ``a`` / ``b`` / ``answer`` [N], ``answer_tokens`` [N, K]
    (right-padded with -1), ``positions[name]`` [N] for ``"a"``, ``"b"``, ``"final"`` (``"a"`` and
    ``"b"`` are the *last* token of each operand, ``"a[0]"`` and ``"b[0]"`` its first), all in the
    left-padded frame. :meth:`locate` resolves every position spec (``"a[-2]"``, ``"answer[0]"``,
    ``"final-2"``, an int) against them.
    """

    texts: tuple[str, ...]
    tokens: torch.Tensor
    lengths: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    answer: torch.Tensor
    answer_tokens: torch.Tensor
    answer_texts: tuple[str, ...]
    positions: dict[str, torch.Tensor]
    op: str
    template: Optional[str]  # None when joined (``concat``) from sets with different templates
    modulus: Optional[int] = None
    prefix: Optional[str] = ""  # None when joined from sets with different few-shot prefixes
    prepend_bos: bool = True
    scoring: str = "first_token"
    tokenizer: Any = field(default=None, repr=False, compare=False)
    meta: dict = field(default_factory=dict, compare=False)

    # --- basics --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index) -> "PromptSet":
        """A subset: ``index`` is a slice, a list of ints, or a bool / long tensor."""
        idx = _as_index(index, len(self))
        return replace(
            self,
            texts=tuple(self.texts[i] for i in idx.tolist()),
            tokens=self.tokens[idx],
            lengths=self.lengths[idx],
            a=self.a[idx],
            b=self.b[idx],
            answer=self.answer[idx],
            answer_tokens=self.answer_tokens[idx],
            answer_texts=tuple(self.answer_texts[i] for i in idx.tolist()),
            positions={k: v[idx] for k, v in self.positions.items()},
            meta=dict(self.meta),
        )

    @property
    def uniform_length(self) -> bool:
        return bool((self.lengths == self.tokens.shape[1]).all())

    @property
    def n_answer_tokens(self) -> torch.Tensor:
        return (self.answer_tokens >= 0).sum(-1)

    @property
    def single_token_operands(self) -> bool:
        return bool(self.meta.get("operand_tokens", {}).get("max", 1) == 1)

    def str_tokens(self, i: int = 0) -> list[str]:
        """Token strings of prompt ``i`` (without left padding)."""
        row = self.tokens[i, self.tokens.shape[1] - int(self.lengths[i]) :]
        return self.tokenizer.convert_ids_to_tokens(row.tolist())

    def with_scoring(self, scoring: str) -> "PromptSet":
        """The same prompts scored by the ``"first_token"`` or teacher-forced ``"full_answer"``."""
        if scoring not in SCORING:
            raise TaskError(f"unknown scoring {scoring!r}; accepted: {accepted(SCORING)}")
        return replace(self, scoring=scoring)

    @classmethod
    def concat(cls, parts: Sequence["PromptSet"]) -> "PromptSet":
        """Join prompt sets (e.g. built with different few-shot prefixes); see :func:`concat`."""
        return concat(parts)

    def require_one_prefix(self, purpose: str) -> None:
        """Raise ``TaskError`` when this set joins prompts with different prefixes or templates,
        which ``purpose`` (building new prompts like these) cannot handle."""
        if self.prefix is None or self.template is None:
            raise TaskError(
                f"{purpose} needs prompts with one template and few-shot prefix, but this set joins sets "
                f"with different ones (concat); run it on each part and concat the results"
            )

    def length_groups(self) -> list[torch.Tensor]:
        """Indices of prompts grouped by token length (each group runs unpadded)."""
        return [torch.nonzero(self.lengths == n).flatten() for n in self.lengths.unique().tolist()]

    def unpadded(self, idx: torch.Tensor) -> torch.Tensor:
        """Tokens of a same-length group without the left padding: [len(idx), length]."""
        length = int(self.lengths[idx[0]])
        return self.tokens[idx, self.tokens.shape[1] - length :]

    def offset(self, idx: torch.Tensor) -> int:
        """How many pad tokens precede a same-length group (to map positions to unpadded ones)."""
        return self.tokens.shape[1] - int(self.lengths[idx[0]])

    # --- positions -----------------------------------------------------------------------------

    def locate(self, positions: Any, *, answers: int = 0) -> tuple[list[str], torch.Tensor]:
        """Resolve position specs to token indices in the left-padded frame.

        Args:
            positions: one spec or a list of them. A spec is a name — ``"final"`` (alias
                ``"last"``), ``"a"`` / ``"b"`` (the operand's *last* token: where the whole number
                has been read, as Kantamneni & Tegmark 2025 read it), ``"a[k]"`` / ``"b[k]"``
                (token ``k`` of the operand, ``k < 0`` counting from its end), ``"answer[k]"``
                (answer token ``k``, teacher-forced after the prompt) or any other key of
                ``positions`` — optionally shifted by a token offset (``"final-2"``,
                ``"a[0]-1"``); an int index into the padded frame (only when every prompt has
                the same token length; negative counts from the end); or ``"all"`` (every
                position, same-length prompts only).
            answers: how many answer tokens the caller feeds after each prompt (``"answer[k]"``
                and positions past ``"final"`` need ``k < answers``).

        Returns ``(labels, index)``: a label per spec and ``index`` ``[N, n_positions]`` (long)
        into ``tokens`` followed by the fed answer tokens. A position that falls in the left
        padding, before the first token, past the prompt (and fed answer), or at an operand
        token some prompt does not have is refused with a :class:`~arithinterp.errors.SiteError`,
        never wrapped or clamped.
        """
        width = self.tokens.shape[1]
        positions = list(positions) if isinstance(positions, (list, tuple)) else [positions]
        if not positions:
            raise SiteError(f"positions is empty; accepted: {_POSITION_FORMS}")
        one_length = len(set(self.lengths.tolist())) <= 1
        if "all" in positions:
            if len(positions) > 1:
                raise SiteError("positions='all' cannot be combined with other positions")
            if not one_length:
                raise SiteError(
                    "positions='all' needs prompts of one token length; these have lengths "
                    f"{sorted(set(self.lengths.tolist()))}: pick named positions ({_POSITION_FORMS}) instead"
                )
            length = int(self.lengths[0]) if len(self) else width
            positions = list(range(width - length, width))  # the prompts' own tokens, not the padding
        # each prompt's tokens in the padded frame: [start, stop), with its fed answer tokens
        start = width - self.lengths
        stop = width + torch.clamp(self.n_answer_tokens, max=answers)
        labels, columns = [], []
        for spec in positions:
            label, column = self._locate_one(spec, width, one_length)
            bad = (column < start) | (column >= stop)
            if bad.any():
                i = int(torch.nonzero(bad)[0])
                where = "the prompt and its fed answer" if answers else "the prompt"
                past = bool(column[i] >= stop[i]) and not answers
                hint = "; positions past 'final' need the answer tokens fed (collect feeds them)" if past else ""
                raise SiteError(
                    f"position {spec!r} falls outside {where} for {int(bad.sum())} of {len(self)} prompts "
                    f"(e.g. prompt {i} {self.texts[i]!r}: index {int(column[i])}, its tokens are "
                    f"{int(start[i])}..{int(stop[i]) - 1} of the padded frame){hint}"
                )
            labels.append(label)
            columns.append(column)
        return labels, torch.stack(columns, dim=1).long()

    def _locate_one(self, spec: Any, width: int, one_length: bool) -> tuple[str, torch.Tensor]:
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
                    f"(lengths here: {sorted(set(self.lengths.tolist()))}); use a named position or one "
                    f"relative to a name, e.g. 'final-2' or 'a[0]' ({_POSITION_FORMS})"
                )
            if not -width <= spec < width:
                raise SiteError(f"position {spec} is out of range for prompts of {width} tokens; "
                                f"accepted: 0..{width - 1} (or {-width}..-1 counted from the end), "
                                f"or a named position ({_POSITION_FORMS})")
            return str(spec), torch.full((len(self),), spec % width, dtype=torch.long)
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
            column = self.positions["final"] + 1 + k
        elif operand is not None:
            column = self._operand_token(operand, int(index), spec)
        elif name in self.positions:
            column = self.positions[name]
        else:
            others = [k for k in self.positions if k not in ("a", "b", "final", "a[0]", "b[0]")]
            raise SiteError(f"unknown position {spec!r}; accepted: {_POSITION_FORMS}"
                            + (f", or {accepted(others)}" if others else ""))
        return label, column + (int(shift) if shift else 0)

    def _operand_token(self, operand: str, k: int, spec: str) -> torch.Tensor:
        """Index [N] of token ``k`` of an operand (``k < 0`` from its last token)."""
        last = self.positions[operand]
        first = self.positions.get(f"{operand}[0]", last)
        count = last - first + 1
        column = first + k if k >= 0 else last + 1 + k
        missing = (k >= count) if k >= 0 else (-k > count)
        if missing.any():
            i = int(torch.nonzero(missing)[0])
            raise SiteError(
                f"position {spec!r}: {operand}={int(getattr(self, operand)[i])} in prompt {i} ({self.texts[i]!r}) has "
                f"{int(count[i])} token(s); operands here span {sorted(set(count.tolist()))} tokens. Use "
                f"'{operand}' (last token), '{operand}[0]' (first) or operands of one token count"
            )
        return column

    # --- labels --------------------------------------------------------------------------------

    def label_names(self) -> list[str]:
        digits = self.meta.get("n_digits", 1)
        names = ["a", "b", "answer"]
        for i in range(digits):
            names += [f"answer_digit_{i}", f"a_digit_{i}", f"b_digit_{i}"]
            if self.op == "+":
                names.append(f"carry_{i}")
        return names

    def label(self, name: str) -> torch.Tensor:
        """A probe label [N]: operands, answer, digits (0 = units) and carries per digit position.

        ``carry_i`` is the carry out of digit position ``i`` when adding ``a`` and ``b``.
        """
        if name in ("a", "b", "answer"):
            return getattr(self, name).clone()
        match = re.fullmatch(r"(answer|a|b)_digit_(\d+)", name)
        if match:
            value = getattr(self, match.group(1)).abs()
            return (value // 10 ** int(match.group(2))) % 10
        match = re.fullmatch(r"carry_(\d+)", name)
        if match and self.op == "+":
            i = int(match.group(1))
            low = 10 ** (i + 1)
            return ((self.a % low + self.b % low) >= low).long()
        raise TaskError(f"unknown label {name!r}; accepted: {accepted(self.label_names())}")

    # --- running the model ---------------------------------------------------------------------

    def _batches(
        self, model: Any, batch_size: Optional[int], n_read: int, n_new: int, plain: bool = False
    ) -> list[torch.Tensor]:
        """Same-length groups of prompt indices, each split into batches (sized from a memory
        budget by :func:`arithinterp.engine.decode.batch_size_for` unless ``batch_size`` is given;
        ``plain``: for the plain forward, whose logits cover every position)."""
        from arithinterp.engine.decode import batch_size_for, decode_mode

        if batch_size is not None:
            batch_size = integer("batch_size", batch_size, minimum=1, error=TaskError,
                                 hint=" or None (chosen from memory)")
        batches = []
        for group in self.length_groups():
            if not plain:
                decode_mode(model, self.unpadded(group[:1]))  # the path decides what a prompt costs
            size = batch_size or batch_size_for(model, int(self.lengths[group[0]]), n_read=n_read, n_new=n_new,
                                                plain=plain)
            batches += list(group.split(size))
        return batches

    @torch.inference_mode()
    def evaluate(self, model: HookedModel, batch_size: Optional[int] = None, progress: bool = False,
                 interventions: Sequence[Any] = ()) -> Evaluation:
        """Greedily generate each answer's tokens and compare with the true answer.

        Correct means every answer token matches (for single-token answers: the argmax at the
        final position is the answer token). Decoding reads logits only at the last position and
        reuses the key/value cache where the model has one (:mod:`arithinterp.engine.decode`);
        ``batch_size`` defaults to one chosen from a memory budget (half the model's size).
        ``interventions`` (:class:`arithinterp.engine.Intervention`) are applied in every forward,
        through :func:`arithinterp.engine.run`; their ``positions`` must be ``None`` or an int
        (``-1``: the token being predicted), the same for every batch.
        """
        check_belongs(model, "PromptSet.evaluate", prompts=self)
        from tqdm.auto import tqdm

        from arithinterp.engine.decode import greedy

        bad = [i for i in interventions if i.positions is not None and not isinstance(i.positions, int)]
        if bad:
            raise TaskError(
                f"interventions applied while evaluating must give positions as None or an int (the same in "
                f"every batch), not per-prompt tensors; got {type(bad[0].positions).__name__} at {bad[0].hook_name()}"
            )
        n_answer = self.answer_tokens.shape[1]
        generated = torch.full((len(self), n_answer), -1, dtype=torch.long)
        batches = self._batches(model, batch_size, 1, n_answer, plain=bool(interventions))
        for idx in tqdm(batches, desc="evaluate", disable=not progress):
            generated[idx] = greedy(model, self.unpadded(idx), n_answer, interventions)
        valid = self.answer_tokens >= 0
        correct = ((generated == self.answer_tokens) | ~valid).all(-1)
        texts, values = [], []
        names = {n.replace(" ", ""): i for i, n in enumerate(self.meta.get("names") or ())}
        for row, k in zip(generated.tolist(), self.n_answer_tokens.tolist()):
            text = self.tokenizer.decode(row[:k]).replace(" ", "")
            texts.append(text)
            if names:  # answers written as names (weekdays, months): the value is the name's index
                values.append(names.get(text, UNPARSABLE))
            else:
                values.append(int(text) if re.fullmatch(r"-?\d+", text) else UNPARSABLE)
        return Evaluation(correct, torch.tensor(values), texts, generated)

    @torch.inference_mode()
    def answer_logprob(self, model: HookedModel, batch_size: Optional[int] = None) -> torch.Tensor:
        """Log-probability of each true answer, [N].

        With ``scoring="first_token"`` that of the answer's first token; with
        ``scoring="full_answer"`` the teacher-forced sum over every answer token (the answer's
        earlier tokens are fed in, as if the model had produced them). Only the scored positions
        are unembedded.
        """
        check_belongs(model, "PromptSet.answer_logprob", prompts=self)
        from arithinterp.engine.decode import teacher_forced_logprobs

        n_score = self.answer_tokens.shape[1] if self.scoring == "full_answer" else 1
        total = torch.zeros(len(self))
        for idx in self._batches(model, batch_size, n_score, n_score - 1):
            total[idx] = teacher_forced_logprobs(model, self.unpadded(idx), self.answer_tokens[idx, :n_score]).sum(-1)
        return total

    def correct_only(self, model: HookedModel, evaluation: Optional[Evaluation] = None) -> "PromptSet":
        """Keep only the prompts the model answers correctly; ``meta`` records how many were dropped."""
        check_belongs(model, "PromptSet.correct_only", prompts=self)
        evaluation = evaluation or self.evaluate(model)
        kept = self[evaluation.correct]
        kept.meta["filtered"] = dict(
            reason="kept prompts the model answers correctly",
            kept=len(kept),
            dropped=len(self) - len(kept),
            accuracy=evaluation.accuracy,
        )
        if len(kept) == 0:
            raise TaskError("the model answers none of these prompts correctly; nothing is left to analyse")
        return kept

    # --- counterfactuals -----------------------------------------------------------------------

    def counterfactual(
        self,
        vary: str = "a",
        seed: int = 0,
        ops: Sequence[str] = ("+", "-", "*"),
        max_tries: int = 64,
        distinct_first_token: bool = False,
    ) -> "PromptPairs":
        """Pair every prompt with a corrupted one whose tokens align position for position.

        vary: ``"a"`` / ``"b"`` (change one operand, keep the other, the answer changes),
        ``"both"`` (change both, the answer changes), ``"keep_answer"`` (change both operands,
        keep the answer: the control of Stolfo et al.), ``"operator"`` (same operands, another
        operator from ``ops``, the answer changes). Operands are drawn from the values present
        in this set. Prompts with no aligned partner after ``max_tries`` draws are dropped and
        counted in ``pairs.meta``.

        Where answers span several tokens, a clean and a corrupt answer can start with the same
        token (27 and 29 both start with "2" when digits are tokens), so a first-token metric is
        identically 0 on that pair. Such pairs are counted in ``pairs.meta["same_first_token"]``
        and warned about; ``distinct_first_token=True`` draws only partners whose answer starts
        with another token (or score every answer token with ``with_scoring("full_answer")``).
        """
        self.require_one_prefix("counterfactual()")
        assert self.template is not None  # require_one_prefix() refuses a set without one
        if vary not in VARY:
            raise TaskError(f"unknown vary={vary!r}; accepted: {accepted(VARY)}")
        bad_ops = [op for op in ops if op not in OPERATORS] if not isinstance(ops, str) else [ops]
        if bad_ops:
            raise TaskError(f"unknown operator {bad_ops[0]!r} in ops; accepted: {accepted(OPERATORS)}")
        if vary == "operator" and "{op}" not in self.template:
            # without an {op} field the corrupt prompts would be the clean text with other labels
            raise TaskError(
                f"vary='operator' needs the operator in the prompt text, but template {self.template!r} has no "
                "'{op}' field; build the prompts with a template such as '{a}{op}{b}='"
            )
        if len(self) == 0:
            raise TaskError("cannot build counterfactuals from an empty prompt set")
        rng = random.Random(seed)
        a_pool, b_pool = sorted(set(self.a.tolist())), sorted(set(self.b.tolist()))
        other_ops = [op for op in ops if op != self.op]
        if vary == "operator":
            if not other_ops:
                raise TaskError(f"vary='operator' needs another operator in ops; got {list(ops)}")
        unk, digits, known = getattr(self.tokenizer, "unk_token_id", None), self.meta.get("answer_digits", 0), {}

        def spellable(value: int) -> bool:
            if unk is None:
                return True
            if value not in known:
                ids = self.tokenizer(answer_text(value, digits), add_special_tokens=False)["input_ids"]
                known[value] = unk not in ids
            return known[value]

        clean_rows, corrupt_specs = [], []
        for i, (a, b, answer) in enumerate(zip(self.a.tolist(), self.b.tolist(), self.answer.tolist())):
            for _ in range(max_tries):
                new_a, new_b, new_op = a, b, self.op
                if vary in ("a", "both", "keep_answer"):
                    new_a = rng.choice(a_pool)
                if vary in ("b", "both", "keep_answer"):
                    new_b = rng.choice(b_pool)
                if vary == "operator":
                    new_op = rng.choice(other_ops)
                if (new_a, new_b, new_op) == (a, b, self.op) or not _defined(new_op, new_b):
                    continue
                new_answer = compute(new_op, new_a, new_b, self.modulus)
                if (new_answer == answer) != (vary == "keep_answer"):
                    continue
                if not spellable(new_answer):  # e.g. a product past a number tokenizer's vocabulary
                    continue
                clean_rows.append(i)
                corrupt_specs.append((new_a, new_b, new_op))
                break
        corrupt = _build(
            self.tokenizer,
            [s[2] for s in corrupt_specs],
            [s[0] for s in corrupt_specs],
            [s[1] for s in corrupt_specs],
            self.template,
            self.prefix,
            self.modulus,
            self.prepend_bos,
            self.scoring,
            self.meta.get("answer_digits", 0),
            self.meta.get("names"),
        )
        clean = self[clean_rows]
        aligned = _aligned(clean, corrupt)
        if distinct_first_token and vary != "keep_answer":
            aligned &= clean.answer_tokens[:, 0] != corrupt.answer_tokens[:, 0]
        clean, corrupt = clean[aligned], corrupt[aligned]
        dropped = len(self) - len(clean)
        if len(clean) == 0:
            need = " and a different first answer token" if distinct_first_token else ""
            raise TaskError(
                f"no counterfactual partner with aligned tokens{need} could be found for vary={vary!r}; "
                "widen the operand ranges or use a tokenizer where the numbers are single tokens"
            )
        same = int((clean.answer_tokens[:, 0] == corrupt.answer_tokens[:, 0]).sum()) if vary != "keep_answer" else 0
        if same:
            warnings.warn(
                f"{same} of {len(clean)} pairs have clean and corrupt answers that start with the same first token, "
                "so a first-token logit difference is 0 on them; pass distinct_first_token=True, or score every "
                "answer token with prompts.with_scoring('full_answer')",
                stacklevel=2,
            )
        meta = dict(dropped=dropped, kept=len(clean), same_first_token=same)
        return PromptPairs(clean, corrupt, vary=vary, seed=seed, meta=meta)


@dataclass(frozen=True)
class PromptPairs:
    """Clean and corrupted prompts with identical token lengths and positions."""

    clean: PromptSet
    corrupt: PromptSet
    vary: str = "a"
    seed: int = 0
    meta: dict = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return len(self.clean)

    def __getitem__(self, index) -> "PromptPairs":
        return replace(self, clean=self.clean[index], corrupt=self.corrupt[index])

    @classmethod
    def concat(cls, parts: Sequence["PromptPairs"]) -> "PromptPairs":
        """Join pairs (e.g. built with different few-shot prefixes); see :func:`concat`."""
        return concat(parts)

    @property
    def clean_answer_token(self) -> torch.Tensor:
        return self.clean.answer_tokens[:, 0]

    @property
    def corrupt_answer_token(self) -> torch.Tensor:
        return self.corrupt.answer_tokens[:, 0]


@checked
def resolve_positions(pairs: PromptPairs, positions: Any) -> tuple[list[str], torch.Tensor]:
    """Position labels and their per-pair indices in the padded frame: ``[n_pos, N]``.

    ``None`` means every position for same-length prompts, else the named positions (``"a"``,
    ``"b"``, ``"final"``); anything else is resolved by :meth:`PromptSet.locate`.
    """
    clean = pairs.clean
    if positions is None:
        positions = "all" if clean.uniform_length else [name for name in clean.positions if "[" not in name]
    labels, index = clean.locate(positions)
    return labels, index.T.contiguous()


# --- joining -------------------------------------------------------------------------------------


@overload
def concat(parts: Sequence[PromptSet]) -> PromptSet: ...
@overload
def concat(parts: Sequence[PromptPairs]) -> PromptPairs: ...
@overload
def concat(parts: Sequence[Union[PromptSet, PromptPairs]]) -> Union[PromptSet, PromptPairs]: ...
@checked
def concat(parts: Sequence[Union[PromptSet, PromptPairs]]) -> Union[PromptSet, PromptPairs]:
    """Join prompt sets, or prompt pairs, into one, in order.

    The parts may differ in few-shot prefix, template and token length: the joined tokens are
    left-padded to the longest part and every position moves with its tokens, so each position
    still points at its operand (and clean and corrupt prompts of pairs stay aligned). The parts
    must share the tokenizer, operator, modulus, scoring, BOS setting and position names.
    ``meta["parts"]`` records each part's size, prefix and template; a joined set with several
    prefixes or templates has ``prefix`` / ``template`` ``None``.
    """
    parts = list(parts)
    if not parts:
        raise TaskError("concat needs at least one PromptSet or PromptPairs")
    pairs = [p for p in parts if isinstance(p, PromptPairs)]
    if len(pairs) == len(parts):
        varies = sorted({p.vary for p in pairs})
        if len(varies) > 1:
            raise TaskError(f"concat joins pairs that vary the same thing; got vary={varies}")
        meta = dict(dropped=sum(p.meta.get("dropped", 0) for p in pairs), kept=sum(len(p) for p in pairs),
                    same_first_token=sum(p.meta.get("same_first_token", 0) for p in pairs),
                    parts=[dict(n=len(p), seed=p.seed) for p in pairs])
        return PromptPairs(_concat_sets([p.clean for p in pairs]), _concat_sets([p.corrupt for p in pairs]),
                           vary=varies[0], seed=pairs[0].seed, meta=meta)
    sets = [p for p in parts if isinstance(p, PromptSet)]
    if len(sets) == len(parts):
        return _concat_sets(sets)
    kinds = sorted({type(p).__name__ for p in parts})
    raise TaskError(f"concat joins a list of PromptSet or a list of PromptPairs, not a mix of {kinds}")


def _concat_sets(parts: list[PromptSet]) -> PromptSet:
    first = parts[0]
    for part in parts[1:]:
        for name in ("op", "modulus", "scoring", "prepend_bos"):
            if getattr(part, name) != getattr(first, name):
                what = "operator" if name == "op" else name
                raise TaskError(f"concat joins sets with the same {what}; "
                                f"got {getattr(first, name)!r} and {getattr(part, name)!r}")
        if part.meta.get("answer_digits", 0) != first.meta.get("answer_digits", 0):
            raise TaskError("concat joins sets whose answers are written alike; answer_digits differ")
        if part.meta.get("names") != first.meta.get("names"):
            raise TaskError("concat joins sets whose operands and answers are written alike; their names differ")
        if set(part.positions) != set(first.positions):
            raise TaskError(f"concat joins sets with the same positions; "
                            f"got {sorted(first.positions)} and {sorted(part.positions)}")
        if part.tokenizer is not first.tokenizer and part.tokenizer.get_vocab() != first.tokenizer.get_vocab():
            raise TaskError("concat joins sets built with the same tokenizer; "
                            "these tokenizers have different vocabularies")
    length = max(p.tokens.shape[1] for p in parts)
    k = max(p.answer_tokens.shape[1] for p in parts)
    pad = _pad_id(first.tokenizer)
    padding = [torch.full((len(p), length - p.tokens.shape[1]), pad, dtype=torch.long) for p in parts]
    tokens = torch.cat([torch.cat([left, p.tokens], 1) for left, p in zip(padding, parts)])
    answer_tokens = torch.cat([torch.cat([p.answer_tokens, torch.full((len(p), k - p.answer_tokens.shape[1]), -1,
                                                                      dtype=torch.long)], 1) for p in parts])
    positions = {name: torch.cat([p.positions[name] + (length - p.tokens.shape[1]) for p in parts])
                 for name in first.positions}
    one = lambda values: values[0] if len(set(values)) == 1 else None  # noqa: E731
    n_answer = torch.cat([p.n_answer_tokens for p in parts])
    meta = dict(
        answer_digits=first.meta.get("answer_digits", 0),
        operand_tokens=dict(max=max(p.meta.get("operand_tokens", {}).get("max", 1) for p in parts)),
        answer_tokens=dict(max=k, min=int(n_answer.min()) if len(n_answer) else 0),
        n_digits=max(p.meta.get("n_digits", 1) for p in parts),
        parts=[dict(n=len(p), prefix=p.prefix, template=p.template) for p in parts],
    )
    if first.meta.get("names"):
        meta["names"] = first.meta["names"]
    return replace(
        first,
        texts=sum((p.texts for p in parts), ()),
        tokens=tokens,
        lengths=torch.cat([p.lengths for p in parts]),
        a=torch.cat([p.a for p in parts]),
        b=torch.cat([p.b for p in parts]),
        answer=torch.cat([p.answer for p in parts]),
        answer_tokens=answer_tokens,
        answer_texts=sum((p.answer_texts for p in parts), ()),
        positions=positions,
        template=one([p.template for p in parts]),
        prefix=one([p.prefix for p in parts]),
        meta=meta,
    )


# --- building ------------------------------------------------------------------------------------


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


_POSITION_RE = re.compile(
    r"(?P<name>(?P<operand>a|b|answer)\[(?P<index>-?\d+)\]|[A-Za-z_][\w]*)(?P<shift>[+-]\d+)?"
)
_POSITION_FORMS = (
    "'final' ('last'), 'a', 'b' (last token of the operand), 'a[k]', 'b[k]' (token k, negative from the end), "
    "'answer[k]', a name shifted by tokens ('final-2', 'a[0]-1'), 'all', or an int (same-length prompts only)"
)


def _defined(op: str, b: int) -> bool:
    return not (op in ("//", "mod") and b == 0)


def position_labels(positions: Any) -> list[str]:
    """The labels of position specs as :meth:`PromptSet.locate` names them: one spec (a string is
    one spec, never its letters) or a list of them, spaces dropped, ``"last"`` written ``"final"``
    (its alias), integers as their digits. For graphs and other per-position results keyed by label."""
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


def _as_index(index, n: int) -> torch.Tensor:
    if isinstance(index, slice):
        return torch.arange(n)[index]
    if isinstance(index, int):
        if not -n <= index < n:
            raise PromptIndexError(f"index {index} is out of range for {n} prompts; accepted: {-n}..{n - 1}")
        return torch.tensor([index % n])
    idx = torch.as_tensor(index)
    if idx.dtype == torch.bool:
        if idx.shape != (n,):
            raise TaskError(f"boolean index must have shape ({n},), got {tuple(idx.shape)}")
        return torch.nonzero(idx).flatten()
    if idx.numel() and (idx.max() >= n or idx.min() < -n):
        raise PromptIndexError(f"index out of range for a prompt set of {n} prompts; accepted: {-n}..{n - 1}")
    return idx.long().flatten() % max(n, 1)


def _aligned(clean: PromptSet, corrupt: PromptSet) -> torch.Tensor:
    """Pairs whose token lengths, operand positions and answer-token counts agree."""
    same = (clean.lengths == corrupt.lengths) & (clean.n_answer_tokens == corrupt.n_answer_tokens)
    same &= clean.tokens.shape[1] == corrupt.tokens.shape[1]
    for name in clean.positions:
        same &= clean.positions[name] == corrupt.positions[name]
    return same


def operand_values(name: str, values: Union[int, Iterable[int]]) -> list[int]:
    """``values`` (an int or an iterable of ints) as a list of ints, refused with a ``TaskError``
    naming ``name`` when they are strings, non-integers, empty or beyond 64 bits."""
    return _values(name, values)


def _values(name: str, values: Union[int, Iterable[int]]) -> list[int]:
    """Operand values as a list of ints: strings and non-integers are refused, never converted."""
    if isinstance(values, (str, bytes)):
        raise TaskError(f"{name} must be an int or an iterable of ints, got the string {values!r}; "
                        f"write e.g. {name}=[123] or {name}=range(100)")
    if isinstance(values, bool):  # an int, but never an operand
        raise TaskError(f"{name} must be an int or an iterable of ints, got {values!r}")
    if isinstance(values, int):
        values = [values]
    try:
        items = list(values)
    except TypeError as error:
        raise TaskError(f"{name} must be an int or an iterable of ints, got {values!r}") from error
    out = []
    for v in items:
        try:
            if isinstance(v, (bool, str, bytes)):
                raise TypeError
            value = operator.index(v)  # ints and integer numpy / torch scalars, never floats
        except TypeError as error:
            raise TaskError(f"{name} must hold integers, got {v!r} ({type(v).__name__}); "
                            "round or convert the values yourself") from error
        if abs(value) > _INT64:
            raise TaskError(f"{name}={value} does not fit in 64 bits; operands must lie within ±(2**63 - 1)")
        out.append(value)
    if not out:
        raise TaskError(f"{name} is empty; give at least one operand value")
    return out


def check_template(template: Any, op: str) -> str:
    """Validate a prompt template for operator ``op``.

    Fields are ``{a}``, ``{b}`` and ``{op}`` (written as :data:`OP_SYMBOLS`). A template without
    ``{op}`` that shows another operator's symbol but not ``op``'s (``'{a}+{b}='`` for ``'-'``)
    would label its text with the wrong answers, so it is refused.
    """
    if not isinstance(template, str):
        raise TaskError(f"template must be a string such as {DEFAULT_TEMPLATE!r}, got {template!r}")
    unknown = [f for f in re.findall(r"\{[^{}]*\}", template) if f not in TEMPLATE_FIELDS]
    if unknown:
        raise TaskError(f"template {template!r} has the unknown field {unknown[0]}; accepted fields: "
                        f"{', '.join(TEMPLATE_FIELDS)}")
    if "{a}" not in template or "{b}" not in template:
        raise TaskError(f"template must contain '{{a}}' and '{{b}}', got {template!r}")
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
    (``a`` written as ``names[a]`` when names are given)."""
    return _char_spans(template, "", a, b, op, names)[0]


def few_shot_prefix(
    few_shot: Union[int, str], op: str, template: str, a_vals, b_vals, modulus, seed, answer_digits=0, names=None
) -> str:
    if isinstance(few_shot, str):
        return few_shot
    few_shot = integer("few_shot", few_shot, minimum=0, error=TaskError,
                       hint=" (number of examples) or a prefix string")
    rng = random.Random(seed + 7919)
    lines = []
    for _ in range(few_shot):
        a, b = rng.choice(a_vals), rng.choice(b_vals)
        while not _defined(op, b):
            b = rng.choice(b_vals)
        lines.append(render(template, a, b, op, names) + answer_text(compute(op, a, b, modulus), answer_digits, names)
                     + "\n")
    return "".join(lines)


def _char_spans(template: str, prefix: str, a: int, b: int, op: str = "+",
                names: Optional[Sequence[str]] = None) -> tuple[str, dict[str, tuple[int, int]]]:
    """The prompt text and the character spans of ``{a}`` and ``{b}`` in it (``a`` written as
    ``names[a]`` when names are given)."""
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
    """How an answer is written: plain, zero-padded to ``answer_digits`` digits, or as ``names[value]``."""
    if names:
        return names[value]
    return f"{value:0{answer_digits}d}" if answer_digits else str(value)


def _build(
    tokenizer, ops, a_list, b_list, template, prefix, modulus, prepend_bos, scoring, answer_digits=0, names=None
) -> PromptSet:
    n = len(a_list)
    texts, spans = (zip(*[_char_spans(template, prefix, a, b, op, names) for op, a, b in zip(ops, a_list, b_list)])
                    if n else ((), ()))
    answers = [compute(op, a, b, modulus) for op, a, b in zip(ops, a_list, b_list)]
    too_big = [(a, op, b) for a, op, b, x in zip(a_list, ops, b_list, answers) if abs(x) > _INT64]
    if too_big:
        raise TaskError(f"the answer of {too_big[0][0]} {too_big[0][1]} {too_big[0][2]} does not fit in 64 bits; "
                        "choose smaller operands (answers must lie within ±(2**63 - 1))")
    answer_texts = [answer_text(x, answer_digits, names) for x in answers]
    encoded = (tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True) if n
               else {"input_ids": [], "offset_mapping": []})
    full = tokenizer([t + s for t, s in zip(texts, answer_texts)], add_special_tokens=False)["input_ids"] if n else []
    bos = [tokenizer.bos_token_id] if prepend_bos else []
    rows, answer_rows, pos = [], [], {"a": [], "b": [], "final": [], "a[0]": [], "b[0]": []}
    max_operand_tokens = 1
    for i in range(n):
        ids, offsets = encoded["input_ids"][i], encoded["offset_mapping"][i]
        if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
            raise TokenizationError(
                f"prompt {texts[i]!r} contains text the tokenizer does not know (it maps to "
                f"{tokenizer.unk_token!r}); choose operands and a template within its vocabulary"
            )
        if full[i][: len(ids)] != ids:
            raise TokenizationError(
                f"the answer {answer_texts[i]!r} merges with the end of prompt {texts[i]!r} into one "
                "token; end the template with a separator (e.g. '=' or ' =') so answers tokenize on their own"
            )
        answer_rows.append(full[i][len(ids):])
        if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in answer_rows[-1]:
            raise TokenizationError(
                f"the answer {answer_texts[i]!r} of prompt {texts[i]!r} contains text the tokenizer does not know "
                f"(it maps to {tokenizer.unk_token!r}); choose operands whose answers are within its vocabulary "
                "(tasks.number_check lists the numbers it can spell)"
            )
        for name, (start, end) in spans[i].items():
            covering = [j for j, (s, e) in enumerate(offsets) if s < end and e > start]
            if not covering:
                raise TokenizationError(f"operand {name} of {texts[i]!r} has no token of its own")
            # BPE tokens may carry the separating space (GPT-2's " 42"), never other text
            extra = texts[i][offsets[covering[0]][0] : start] + texts[i][end : offsets[covering[-1]][1]]
            if extra.strip():
                raise TokenizationError(
                    f"operand {name}={texts[i][start:end]!r} in {texts[i]!r} shares a token with "
                    "neighbouring text; put a separator (space or symbol) around it in the template"
                )
            max_operand_tokens = max(max_operand_tokens, len(covering))
            # the operand's last token: where the whole number has been read
            pos[name].append(covering[-1] + len(bos))
            pos[f"{name}[0]"].append(covering[0] + len(bos))
        rows.append(bos + ids)
        pos["final"].append(len(bos) + len(ids) - 1)
    length = max((len(r) for r in rows), default=0)
    pad = _pad_id(tokenizer)
    tokens = torch.full((n, length), pad, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, length - len(row) :] = torch.tensor(row)
    shift = length - lengths
    k = max((len(r) for r in answer_rows), default=1)
    answer_tokens = torch.full((n, k), -1, dtype=torch.long)
    for i, row in enumerate(answer_rows):
        answer_tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    positions = {name: torch.tensor(v, dtype=torch.long) + shift for name, v in pos.items() if len(v) == n}
    max_answer = max((abs(x) for x in answers), default=0)
    return PromptSet(
        texts=tuple(texts),
        tokens=tokens,
        lengths=lengths,
        a=torch.tensor(a_list, dtype=torch.long),
        b=torch.tensor(b_list, dtype=torch.long),
        answer=torch.tensor(answers, dtype=torch.long),
        answer_tokens=answer_tokens,
        answer_texts=tuple(answer_texts),
        positions=positions,
        op=ops[0] if len(set(ops)) == 1 else "mixed",
        template=template,
        modulus=modulus,
        prefix=prefix,
        prepend_bos=prepend_bos,
        scoring=scoring,
        tokenizer=tokenizer,
        meta=dict(
            answer_digits=answer_digits,
            operand_tokens=dict(max=max_operand_tokens),
            answer_tokens=dict(max=k, min=min((len(r) for r in answer_rows), default=0)),
            n_digits=len(str(max(max_answer, max(a_list, default=0), max(b_list, default=0)))),
            **(dict(names=list(names)) if names else {}),
        ),
    )


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

    Pairs with ``b == 0`` are skipped for ``//`` and ``mod`` (recorded in ``meta["skipped"]``).
    """
    a_vals, b_vals = _values("a", a), _values("b", b)
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
    modulus: Optional[int] = None,
    few_shot: Union[NonNegativeInt, str] = 0,
    answer_digits: int = 0,
    prepend_bos: Optional[bool] = None,
    scoring: str = "first_token",
    require_single_tokens: bool = False,
    seed: int = 0,
    names: Optional[Sequence[str]] = None,
) -> PromptSet:
    """Prompts for the explicit operand pairs ``zip(a, b)``.

    Args:
        modulus: reduce answers mod this (e.g. 113 for modular addition).
        few_shot: number of solved examples to prefix (one per line, seeded), or a prefix string.
        answer_digits: write answers zero-padded to this many digits (0 = plain).
        scoring: ``"first_token"`` (logit metrics on the answer's first token) or
            ``"full_answer"`` (teacher-forced log-prob of every answer token).
        require_single_tokens: raise if any operand spans several tokens (analyses that read one
            operand position need this).
        names: write operand ``a`` and the answer as ``names[value]`` (weekdays, months: see
            :mod:`arithinterp.cyclic`); needs ``modulus=len(names)`` and every ``a`` below it.
    """
    if op not in OPERATORS:
        raise TaskError(f"unknown operator {op!r}; accepted: {accepted(OPERATORS)}")
    check_template(template, op)
    if scoring not in SCORING:
        raise TaskError(f"unknown scoring {scoring!r}; accepted: {accepted(SCORING)}")
    if modulus is not None:
        modulus = integer("modulus", modulus, minimum=2, error=TaskError, hint=" or None")
    answer_digits = integer("answer_digits", answer_digits, minimum=0, error=TaskError)
    tokenizer = _tokenizer_of(model_or_tokenizer)
    a_vals, b_vals = _values("a", a), _values("b", b)
    if len(a_vals) != len(b_vals):
        raise TaskError(f"a and b must have the same length, got {len(a_vals)} and {len(b_vals)}")
    pairs = [(x, y) for x, y in zip(a_vals, b_vals) if _defined(op, y)]
    skipped = len(a_vals) - len(pairs)
    if not pairs:
        raise TaskError(f"no (a, b) pair is defined for {op!r} (b must be non-zero)")
    if prepend_bos is None:
        prepend_bos = _default_prepend_bos(model_or_tokenizer, tokenizer)
    names = check_names(names, a_vals, modulus)
    prefix = few_shot_prefix(few_shot, op, template, a_vals, b_vals, modulus, seed, answer_digits, names)
    prompts = _build(
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
    )
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


def check_names(names: Any, a_values: Sequence[int], modulus: Optional[int]) -> Optional[list[str]]:
    """Validate ``names`` (how operand ``a`` and the answer are written): distinct non-empty
    strings, one per value of the cycle (``modulus == len(names)``, so every answer — and every
    few-shot example's — has a name), and every ``a`` an index into them."""
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

    Returns ``{"single_token": [...], "multi_token": [...]}``.
    """
    tokenizer = _tokenizer_of(model_or_tokenizer)
    numbers = _values("numbers", numbers)
    ids = tokenizer([str(x) for x in numbers], add_special_tokens=False)["input_ids"]
    unk = tokenizer.unk_token_id
    single = [x for x, row in zip(numbers, ids) if len(row) == 1 and row[0] != unk]
    return dict(single_token=single, multi_token=[x for x in numbers if x not in set(single)])
