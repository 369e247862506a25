"""Tokenizing prompts: their token ids, answer tokens, and each operand's token positions.

Positions come from the tokenizer's character offsets, never from guessing, so they are right for
word-level number tokenizers, digit-splitting tokenizers and BPE tokenizers alike. Prompts of
different token lengths are left-padded; answer tokens are right-padded with -1.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator, Optional, Sequence

import torch

from arithinterp.errors import TaskError, TokenizationError
from arithinterp.tasks.operators import INT64_MAX, compute
from arithinterp.tasks.templates import answer_text, text_and_spans


def pad_id(tokenizer: Any) -> int:
    """The token id left padding is written with: the pad token, else the end-of-sequence token, else 0.

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        The padding token id.
    """
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while prompts are encoded.

    Encoding allocates a few small lists and tuples per prompt, none of them in a reference cycle;
    with torch and transformers imported, the full collections that many allocations trigger walk
    millions of long-lived objects and cost more than the encoding itself (about 2× on 10,000 prompts).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _encode_texts(tokenizer: Any, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Token ids and character offsets of each text, without special tokens.

    A fast (Rust-backed) tokenizer is called through its backend's ``encode_batch`` directly, which
    is what the tokenizer's own call does after setting truncation and padding off, minus the
    conversion of every encoding into Python dictionaries (several times the tokenizing itself on
    short prompts). It is used only where it gives the same answer: no truncation or padding set on
    the backend, special tokens treated alike, and the first and last texts encoded identically by
    both routes; any other tokenizer is called as usual.

    Args:
        tokenizer: A Hugging Face tokenizer with character offsets (``return_offsets_mapping``).
        texts: The N texts.

    Returns:
        ``(ids, offsets)``: N lists of token ids and N lists of ``(start, end)`` character spans.
    """
    if not texts:
        return [], []
    backend = _direct_backend(tokenizer, texts)
    if backend is not None:
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings], [e.offsets for e in encodings]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [[tuple(span) for span in row] for row in encoded["offset_mapping"]]


def _direct_backend(tokenizer: Any, texts: list[str]) -> Any:
    """The Rust tokenizer behind ``tokenizer`` when calling it directly is equivalent, else ``None``."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if (backend is None or backend.truncation is not None or backend.padding is not None
            or bool(getattr(backend, "encode_special_tokens", False))
            != bool(getattr(tokenizer, "split_special_tokens", False))):
        return None
    probe = [texts[0], texts[-1]]
    wrapped = tokenizer(probe, add_special_tokens=False, return_offsets_mapping=True)
    direct = backend.encode_batch(probe, add_special_tokens=False)
    same = all(list(wrapped["input_ids"][i]) == list(direct[i].ids)
               and [tuple(span) for span in wrapped["offset_mapping"][i]] == list(direct[i].offsets) for i in range(2))
    return backend if same else None


@_collection_paused()
def encode_prompts(
    tokenizer: Any, ops: Sequence[str], a_list: Sequence[int], b_list: Sequence[int], template: str, prefix: str,
    modulus: Optional[int], prepend_bos: bool, scoring: str, answer_digits: int = 0,
    names: Optional[Sequence[str]] = None,
) -> dict[str, Any]:
    """The fields of a :class:`~arithinterp.tasks.PromptSet` for prompts ``a op b``, one per operand pair.

    Args:
        tokenizer: A Hugging Face tokenizer with character offsets (``return_offsets_mapping``).
        ops: The operator of each prompt.
        a_list: The first operand of each prompt.
        b_list: The second operand of each prompt.
        template: The template every prompt is written with.
        prefix: The few-shot prefix written before every prompt.
        modulus: Reduce answers mod this (``None``: not reduced).
        prepend_bos: Start every prompt with the tokenizer's BOS token.
        scoring: ``"first-token"`` or ``"full-answer"``.
        answer_digits: Zero-pad answers to this many digits (0: plain).
        names: Write operand ``a`` and the answers as names.

    Returns:
        The keyword arguments of ``PromptSet``: N prompts, T tokens after left padding, K answer
        tokens; ``tokens`` [N, T], ``lengths`` [N], ``a`` / ``b`` / ``answer`` [N],
        ``answer_tokens`` [N, K], ``positions[name]`` [N] for ``"a"``, ``"b"``, ``"final"``,
        ``"a[0]"``, ``"b[0]"``, and the texts, settings and ``meta``.

    Raises:
        TaskError: an answer does not fit in 64 bits.
        TokenizationError: a prompt or answer holds text the tokenizer does not know, an answer
            merges with the prompt's last token, or an operand shares a token with other text.
    """
    n = len(a_list)
    texts, spans = (zip(*[text_and_spans(template, prefix, a, b, op, names)
                          for op, a, b in zip(ops, a_list, b_list)]) if n else ((), ()))
    answers = [compute(op, a, b, modulus) for op, a, b in zip(ops, a_list, b_list)]
    too_big = [(a, op, b) for a, op, b, x in zip(a_list, ops, b_list, answers) if abs(x) > INT64_MAX]
    if too_big:
        raise TaskError(f"the answer of {too_big[0][0]} {too_big[0][1]} {too_big[0][2]} does not fit in 64 bits; "
                        "choose smaller operands (answers must lie within ±(2**63 - 1))")
    answer_texts = [answer_text(x, answer_digits, names) for x in answers]
    prompt_ids, prompt_offsets = _encode_texts(tokenizer, list(texts))
    full, _ = _encode_texts(tokenizer, [t + s for t, s in zip(texts, answer_texts)])
    bos = [tokenizer.bos_token_id] if prepend_bos else []
    unk = tokenizer.unk_token_id  # read once: a tokenizer's special-token attributes are slow to look up
    rows, answer_rows, pos = [], [], {"a": [], "b": [], "final": [], "a[0]": [], "b[0]": []}
    max_operand_tokens = 1
    for i in range(n):
        ids, offsets = prompt_ids[i], prompt_offsets[i]
        if unk is not None and unk in ids:
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
        if unk is not None and unk in answer_rows[-1]:
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
    pad = pad_id(tokenizer)
    # padded in Python and converted once: a tensor per row costs more than the tokenizing
    tokens = torch.tensor([[pad] * (length - len(r)) + r for r in rows], dtype=torch.long).reshape(n, length)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    shift = length - lengths
    k = max((len(r) for r in answer_rows), default=1)
    answer_tokens = torch.tensor([r + [-1] * (k - len(r)) for r in answer_rows], dtype=torch.long).reshape(n, k)
    positions = {name: torch.tensor(v, dtype=torch.long) + shift for name, v in pos.items() if len(v) == n}
    max_answer = max((abs(x) for x in answers), default=0)
    return dict(
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
