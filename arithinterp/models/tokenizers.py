"""Number tokenizers for the zoo models.

Two real Hugging Face fast tokenizers (saved as ``tokenizer.json``), both word-level:

* ``number`` — every integer in ``0..max_number`` is one token (like Llama-3 / GPT-J for
  numbers under 1000), e.g. ``"12+34="`` → ``12 + 34 =``;
* ``digit`` — every digit is its own token, e.g. ``"123+456="`` → ``1 2 3 + 4 5 6 =``;
* ``calendar`` — ``number`` plus one token per weekday and month name and the words ``days``
  and ``months``, e.g. ``"Monday + 3 days ="`` → ``Monday + 3 days =``.

Whitespace separates tokens and is otherwise ignored, so ``"12 34 ="`` also works. Anything
not in the vocabulary becomes ``<unk>`` (which the task builder reports as an error).
"""

from __future__ import annotations

import re
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<unk>", "<bos>", "<pad>")
SYMBOLS = ("+", "-", "*", "/", "%", "=", "mod")


def _build(vocab_words: list[str], digit_pattern: str, words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate([*SPECIAL_TOKENS, *vocab_words, *words])}
    # whole words first (longest first, so no word is cut at a shorter one), then single symbols
    word_pattern = "".join(f"{re.escape(w)}|" for w in sorted(words, key=len, reverse=True))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(rf"{digit_pattern}|{word_pattern}mod|[^\d\s]"), behavior="isolated"),
        ]
    )
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<pad>",
        pad_token="<pad>",
    )


def number_tokenizer(max_number: int, words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Word-level tokenizer with one token per integer ``0..max_number`` plus operators, and one
    per word of ``words`` (e.g. weekday and month names)."""
    return _build([str(i) for i in range(max_number + 1)] + list(SYMBOLS), r"\d+", tuple(words))


def calendar_tokenizer(max_number: int) -> PreTrainedTokenizerFast:
    """:func:`number_tokenizer` plus weekday and month names and the words ``days`` and ``months``."""
    from arithinterp.cyclic import MONTHS, WEEKDAYS

    return number_tokenizer(max_number, (*WEEKDAYS, *MONTHS, "days", "months"))


def digit_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer with one token per digit plus operators."""
    return _build([str(i) for i in range(10)] + list(SYMBOLS), r"\d")


def save_and_reload(tokenizer: PreTrainedTokenizerFast, directory: Path) -> PreTrainedTokenizerFast:
    """Save ``tokenizer`` to ``directory`` and load it back from disk.

    ``TransformerBridge.boot_native`` needs a tokenizer loaded from a directory, not one
    built in memory.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return PreTrainedTokenizerFast.from_pretrained(str(directory))
