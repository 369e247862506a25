"""The prompt containers: :class:`PromptSet` and :class:`PromptPairs`, and :func:`concat`, which joins them.

A ``PromptSet`` holds tokenized prompts with their operands, true answers, answer token ids and
the token positions of each operand and of the final prompt token; its methods index, label and
pair its prompts and run the model on them (:mod:`~arithinterp.tasks.evaluation`). Prompts of
different token lengths are left-padded; every forward runs one length group at a time, so
padding never reaches the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union, overload

import torch

from arithinterp.checks import check_belongs
from arithinterp.errors import ConfigError, SiteError, TaskError, accepted
from arithinterp.tasks.counterfactuals import draw_partners, keep_aligned
from arithinterp.tasks.encoding import encode_prompts
from arithinterp.tasks.evaluation import Evaluation, answer_logprob, as_index, evaluate
from arithinterp.tasks.joining import join_sets
from arithinterp.tasks.places import PLACES, refuse_renamed, split_place
from arithinterp.tasks.positions import locate
from arithinterp.types import PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

SCORING = ("first-token", "full-answer")


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
    scoring: str = "first-token"
    tokenizer: Any = field(default=None, repr=False, compare=False)
    meta: dict = field(default_factory=dict, compare=False)

    # --- basics --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index) -> "PromptSet":
        """A subset: ``index`` is a slice, a list of ints, or a bool / long tensor."""
        idx = as_index(index, len(self))
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

    # --- printing: a short repr and a notebook table (arithinterp.printing), never every prompt ----

    def _printed(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(what, sizes)`` as the repr and the notebook table show them."""
        what: dict[str, Any] = dict(op=self.op, template=self.template, scoring=self.scoring)
        if self.modulus is not None:
            what["modulus"] = self.modulus
        if self.prefix:
            what["prefix"] = self.prefix
        sizes: dict[str, Any] = dict(n_prompts=len(self))
        for name in ("a", "b", "answer"):
            values = getattr(self, name)
            if len(values):
                sizes[name] = f"{int(values.min())}..{int(values.max())}"
        sizes.update(tokens=self.tokens, answer_tokens=self.answer_tokens)
        return what, sizes

    def __repr__(self) -> str:
        from arithinterp.printing import short_repr

        what, sizes = self._printed()
        first = [f"{text}{answer}" for text, answer in zip(self.texts[:3], self.answer_texts[:3])]
        return short_repr("PromptSet", {**sizes, **what, "first": first})

    def _repr_html_(self) -> str:
        """The table a notebook shows: what the set is, its sizes and its first prompts."""
        from arithinterp.printing import FIRST_ROWS, html_table

        what, sizes = self._printed()
        return html_table("PromptSet", {"what": what, "sizes": sizes}, self._head_frame(FIRST_ROWS),
                          "prompts", total=len(self))

    def _head_frame(self, n: int) -> Any:
        """The first ``n`` prompts as a DataFrame: text, operands, answer, token count."""
        import pandas as pd

        return pd.DataFrame(dict(text=list(self.texts[:n]), a=self.a[:n].tolist(), b=self.b[:n].tolist(),
                                 answer=self.answer[:n].tolist(), tokens=self.lengths[:n].tolist()))

    @property
    def uniform_length(self) -> bool:
        """Whether every prompt has the padded length (no left padding)."""
        return bool((self.lengths == self.tokens.shape[1]).all())

    @property
    def n_answer_tokens(self) -> torch.Tensor:
        """How many tokens each answer has: long [N]."""
        return (self.answer_tokens >= 0).sum(-1)

    @property
    def single_token_operands(self) -> bool:
        """Whether every operand is one token."""
        return bool(self.meta.get("operand_tokens", {}).get("max", 1) == 1)

    @checked
    def str_tokens(self, i: int = 0) -> list[str]:
        """Token strings of prompt ``i`` (without left padding).

        Args:
            i: The prompt's index (negative counts from the end).

        Returns:
            The prompt's tokens as the tokenizer writes them.

        Raises:
            PromptIndexError: ``i`` is out of range.
        """
        i = int(as_index(i, len(self))[0])
        row = self.tokens[i, self.tokens.shape[1] - int(self.lengths[i]) :]
        return self.tokenizer.convert_ids_to_tokens(row.tolist())

    def with_scoring(self, scoring: str) -> "PromptSet":
        """The same prompts scored by the ``"first-token"`` or teacher-forced ``"full-answer"``.

        Args:
            scoring: ``"first-token"`` or ``"full-answer"``.

        Returns:
            A copy of the set with ``scoring`` set.

        Raises:
            ConfigError: ``scoring`` is unknown.
        """
        if scoring not in SCORING:
            raise ConfigError(f"unknown scoring {scoring!r}; accepted: {accepted(SCORING)}")
        return replace(self, scoring=scoring)

    @classmethod
    def concat(cls, parts: Sequence["PromptSet"]) -> "PromptSet":
        """Join prompt sets (e.g. built with different few-shot prefixes); see :func:`concat`.

        Args:
            parts: The sets to join, in order.

        Returns:
            The joined set.
        """
        return concat(parts)

    def require_one_prefix(self, purpose: str) -> None:
        """Raise ``TaskError`` when this set joins prompts with different prefixes or templates,
        which ``purpose`` (building new prompts like these) cannot handle.

        Args:
            purpose: What needs one prefix and template, for the message (``"counterfactual()"``).

        Raises:
            TaskError: the set joins prompts with different prefixes or templates.
        """
        if self.prefix is None or self.template is None:
            raise TaskError(
                f"{purpose} needs prompts with one template and few-shot prefix, but this set joins sets "
                f"with different ones (concat); run it on each part and concat the results"
            )

    def length_groups(self) -> list[torch.Tensor]:
        """Indices of prompts grouped by token length (each group runs unpadded).

        Returns:
            One long tensor of prompt indices per token length, shortest first.
        """
        return [torch.nonzero(self.lengths == n).flatten() for n in self.lengths.unique().tolist()]

    def unpadded(self, idx: torch.Tensor) -> torch.Tensor:
        """Tokens of a same-length group without the left padding: [len(idx), length].

        Args:
            idx: Indices of prompts of one token length.

        Returns:
            Their tokens, [len(idx), length].
        """
        length = int(self.lengths[idx[0]])
        return self.tokens[idx, self.tokens.shape[1] - length :]

    def offset(self, idx: torch.Tensor) -> int:
        """How many pad tokens precede a same-length group (to map positions to unpadded ones).

        Args:
            idx: Indices of prompts of one token length.

        Returns:
            The number of pad tokens before each of their prompts.
        """
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

        Returns:
            ``(labels, index)``: a label per spec and ``index`` ``[N, n_positions]`` (long) into
            ``tokens`` followed by the fed answer tokens.

        Raises:
            SiteError: a position that falls in the left padding, before the first token, past
                the prompt (and fed answer), or at an operand token some prompt does not have;
                it is refused, never wrapped or clamped.
        """
        return locate(self, positions, answers=answers)

    # --- labels --------------------------------------------------------------------------------

    def label_names(self) -> list[str]:
        """The labels :meth:`label` gives for this set.

        Returns:
            ``"a"``, ``"b"``, ``"answer"``, then per digit place (:data:`~arithinterp.tasks.places.PLACES`)
            ``answer_units``, ``a_units``, ``b_units``, ``answer_tens``, ... and, for ``+``, the carries
            into each place but the units: ``carry_tens``, ``carry_hundreds``, ...
        """
        digits = self.meta.get("n_digits", 1)
        names = ["a", "b", "answer"]
        for place in PLACES[:digits]:
            names += [f"answer_{place}", f"a_{place}", f"b_{place}"]
        if self.op == "+":
            names += [f"carry_{place}" for place in PLACES[1:digits]]
        return names

    @checked
    def label(self, name: str) -> torch.Tensor:
        """A probe label [N]: operands, answer, their digits by place and the carries.

        ``answer_tens`` is the answer's tens digit; ``carry_tens`` the carry *into* the tens
        column when adding ``a`` and ``b`` (their units digits sum to 10 or more).

        Args:
            name: One of :meth:`label_names` (places past them, up to ``quintillions``, are read too).

        Returns:
            The label of every prompt, long [N].

        Raises:
            ConfigError: ``name`` is not a label of this set, or numbers a digit by its index
                (``answer_digit_0``): the error names the place-value name.
        """
        if name in ("a", "b", "answer"):
            return getattr(self, name).clone()
        digit, carry = split_place(name, ("answer", "a", "b")), split_place(name, ("carry",))
        if digit:
            return (getattr(self, digit[0]).abs() // 10 ** digit[1]) % 10
        if carry and carry[1] > 0 and self.op == "+":
            low = 10 ** carry[1]
            return ((self.a % low + self.b % low) >= low).long()
        refuse_renamed(name, what="label", known=self.label_names(), carry_into=False)
        raise ConfigError(f"unknown label {name!r}; accepted: {accepted(self.label_names())}")

    # --- running the model ---------------------------------------------------------------------

    @checked
    def evaluate(self, model: HookedModel, batch_size: Optional[PositiveInt] = None, progress: bool = False,
                 writes: Sequence[Any] = ()) -> Evaluation:
        """Greedily generate each answer's tokens and compare with the true answer.

        Correct means every answer token matches (for single-token answers: the argmax at the
        final position is the answer token). Decoding reads logits only at the last position and
        reuses the key/value cache where the model has one (:mod:`arithinterp.engine.decode`).

        Args:
            model: The hooked model the prompts were built for.
            batch_size: Prompts per forward; ``None`` chooses it from a memory budget (half the
                model's size).
            progress: Show a progress bar.
            writes: :class:`arithinterp.engine.Write` objects applied in every
                forward, through :func:`arithinterp.engine.run`; their ``positions`` must be
                ``None`` or an int (``-1``: the token being predicted), the same for every batch.

        Returns:
            The model's answers and whether each is correct.

        Raises:
            TaskError: an intervention gives per-prompt positions.
            ConfigError: ``batch_size`` is not a positive int or None.
            ModelMismatchError: the prompts were built for another model.
        """
        return evaluate(self, model, batch_size, progress, writes)

    @checked
    def answer_logprob(self, model: HookedModel, batch_size: Optional[PositiveInt] = None) -> torch.Tensor:
        """Log-probability of each true answer, [N].

        With ``scoring="first-token"`` that of the answer's first token; with
        ``scoring="full-answer"`` the teacher-forced sum over every answer token (the answer's
        earlier tokens are fed in, as if the model had produced them). Only the scored positions
        are unembedded.

        Args:
            model: The hooked model the prompts were built for.
            batch_size: Prompts per forward; ``None`` chooses it from a memory budget.

        Returns:
            The log-probabilities, float [N].

        Raises:
            ConfigError: ``batch_size`` is not a positive int or None.
            ModelMismatchError: the prompts were built for another model.
        """
        return answer_logprob(self, model, batch_size)

    def correct_only(self, model: HookedModel, evaluation: Optional[Evaluation] = None) -> "PromptSet":
        """Keep only the prompts the model answers correctly; ``meta`` records how many were dropped.

        Args:
            model: The hooked model the prompts were built for.
            evaluation: The model's evaluation on these prompts; ``None`` runs :meth:`evaluate`.

        Returns:
            The prompts answered correctly, with ``meta["filtered"]`` (kept, dropped, accuracy).

        Raises:
            TaskError: the model answers none of the prompts correctly.
            ModelMismatchError: the prompts were built for another model.
        """
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

    @checked
    def counterfactual(
        self,
        vary: str = "a",
        seed: int = 0,
        ops: Sequence[str] = ("+", "-", "*"),
        max_tries: PositiveInt = 64,
        distinct_first_token: bool = False,
    ) -> "PromptPairs":
        """Pair every prompt with a corrupted one whose tokens align position for position.

        Where answers span several tokens, a clean and a corrupt answer can start with the same
        token (27 and 29 both start with "2" when digits are tokens), so a first-token metric is
        identically 0 on that pair. Such pairs are counted in ``pairs.meta["same_first_token"]``
        and warned about; ``distinct_first_token=True`` draws only partners whose answer starts
        with another token (or score every answer token with ``with_scoring("full-answer")``).

        Args:
            vary: ``"a"`` / ``"b"`` (change one operand, keep the other, the answer changes),
                ``"both"`` (change both, the answer changes), ``"keep-answer"`` (change both
                operands, keep the answer: the control of Stolfo et al.), ``"operator"`` (same
                operands, another operator from ``ops``, the answer changes). Operands are drawn
                from the values present in this set.
            seed: The seed of the draws.
            ops: The operators ``vary="operator"`` draws from.
            max_tries: Draws per prompt; prompts with no aligned partner after them are dropped
                and counted in ``pairs.meta``.
            distinct_first_token: Keep only partners whose answer starts with another token.

        Returns:
            The pairs, with ``meta`` holding ``dropped``, ``kept`` and ``same_first_token``.

        Raises:
            TaskError: ``vary`` or an operator is unknown, the set joins several templates or
                prefixes, ``vary="operator"`` has no ``{op}`` field, or no pair is left.
        """
        rows, specs = draw_partners(self, vary, seed, ops, max_tries)
        assert self.template is not None and self.prefix is not None  # draw_partners() refuses a set without them
        corrupt = PromptSet(**encode_prompts(
            self.tokenizer, [s[2] for s in specs], [s[0] for s in specs], [s[1] for s in specs], self.template,
            self.prefix, self.modulus, self.prepend_bos, self.scoring, self.meta.get("answer_digits", 0),
            self.meta.get("names"),
        ))
        clean, corrupt, meta = keep_aligned(len(self), self[rows], corrupt, vary, distinct_first_token)
        return PromptPairs(clean, corrupt, vary=vary, seed=seed, meta=meta)


@dataclass(frozen=True)
class PromptPairs:
    """Clean and corrupted prompts with identical token lengths and positions.

    Attributes:
        clean: The clean prompts.
        corrupt: Their corrupted partners, row for row.
        vary: What the partners change (see :meth:`PromptSet.counterfactual`).
        seed: The seed the partners were drawn with.
        meta: ``dropped``, ``kept`` and ``same_first_token`` counts.
    """

    clean: PromptSet
    corrupt: PromptSet
    vary: str = "a"
    seed: int = 0
    meta: dict = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return len(self.clean)

    def __getitem__(self, index) -> "PromptPairs":
        return replace(self, clean=self.clean[index], corrupt=self.corrupt[index])

    def __repr__(self) -> str:
        from arithinterp.printing import short_repr

        first = [f"{clean} | {corrupt}" for clean, corrupt in zip(self.clean.texts[:3], self.corrupt.texts[:3])]
        return short_repr("PromptPairs", dict(n_pairs=len(self), vary=self.vary, seed=self.seed,
                                              template=self.clean.template, tokens=self.clean.tokens, first=first))

    def _repr_html_(self) -> str:
        """The table a notebook shows: what the pairs vary, their sizes and the first pairs."""
        from arithinterp.printing import FIRST_ROWS, html_table

        clean, corrupt = self.clean._head_frame(FIRST_ROWS), self.corrupt._head_frame(FIRST_ROWS)
        frame = clean[["text", "answer"]].add_suffix("_clean").join(corrupt[["text", "answer"]].add_suffix("_corrupt"))
        sizes = dict(n_pairs=len(self), tokens=self.clean.tokens, **{k: v for k, v in self.meta.items()
                                                                     if isinstance(v, int)})
        return html_table("PromptPairs", {"what": dict(vary=self.vary, seed=self.seed, template=self.clean.template),
                                          "sizes": sizes}, frame, "pairs", total=len(self))

    @classmethod
    def concat(cls, parts: Sequence["PromptPairs"]) -> "PromptPairs":
        """Join pairs (e.g. built with different few-shot prefixes); see :func:`concat`.

        Args:
            parts: The pairs to join, in order.

        Returns:
            The joined pairs.
        """
        return concat(parts)

    @property
    def clean_answer_token(self) -> torch.Tensor:
        """The first token of each clean answer: long [N]."""
        return self.clean.answer_tokens[:, 0]

    @property
    def corrupt_answer_token(self) -> torch.Tensor:
        """The first token of each corrupt answer: long [N]."""
        return self.corrupt.answer_tokens[:, 0]


@checked
def resolve_positions(pairs: PromptPairs, positions: Any) -> tuple[list[str], torch.Tensor]:
    """Position labels and their per-pair indices in the padded frame: ``[n_pos, N]``.

    Args:
        pairs: The prompt pairs.
        positions: ``None`` means every position for same-length prompts, else the named
            positions (``"a"``, ``"b"``, ``"final"``); anything else is resolved by
            :meth:`PromptSet.locate`.

    Returns:
        ``(labels, index)``: a label per position and ``index`` long ``[n_pos, N]``.

    Raises:
        SiteError: a position cannot be read, falls outside a prompt, or is named twice (one
            column per position).
    """
    clean = pairs.clean
    if positions is None:
        positions = "all" if clean.uniform_length else [name for name in clean.positions if "[" not in name]
    labels, index = clean.locate(positions)
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise SiteError(f"positions names {repeated[0]!r} more than once ({labels}); give each position once")
    return labels, index.T.contiguous()


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

    Args:
        parts: A list of ``PromptSet`` or a list of ``PromptPairs`` (not a mix).

    Returns:
        The joined set or pairs.

    Raises:
        TaskError: ``parts`` is empty or mixed, pairs vary different things, or the sets differ
            in what they must share.
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
        return PromptPairs(join_sets([p.clean for p in pairs]), join_sets([p.corrupt for p in pairs]),
                           vary=varies[0], seed=pairs[0].seed, meta=meta)
    sets = [p for p in parts if isinstance(p, PromptSet)]
    if len(sets) == len(parts):
        return join_sets(sets)
    kinds = sorted({type(p).__name__ for p in parts})
    raise TaskError(f"concat joins a list of PromptSet or a list of PromptPairs, not a mix of {kinds}")
