"""Running the model on prompts: greedy answers (:class:`Evaluation`) and the true answers' log-probabilities.

Prompts run one token-length group at a time, in batches sized from a memory budget
(:func:`arithinterp.engine.decode.batch_size_for`), so padding never reaches the model; decoding
reuses the key/value cache where the model has one (:mod:`arithinterp.engine.decode`).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from arithinterp.checks import check_belongs
from arithinterp.errors import PromptIndexError, TaskError

if TYPE_CHECKING:
    from arithinterp.tasks.prompt_set import PromptSet
    from arithinterp.types import HookedModel

#: The model answer recorded for generated text that is not a number (or not one of the names).
UNPARSABLE = -(10**9)


@dataclass(frozen=True)
class Evaluation:
    """The model's answers on a prompt set (greedy generation of the answer tokens).

    Attributes:
        correct: bool [N], whether every answer token matches.
        model_answer: long [N], the parsed generated answer, or :data:`UNPARSABLE`.
        answer_text: The generated answer strings.
        generated_tokens: long [N, K], the generated answer tokens.
    """

    correct: torch.Tensor  # bool [N]
    model_answer: torch.Tensor  # long [N]; the parsed generated answer, or a sentinel when unparsable
    answer_text: list[str]  # the generated answer strings
    generated_tokens: torch.Tensor  # long [N, K]

    @property
    def accuracy(self) -> float:
        """The fraction of prompts answered correctly (NaN for none)."""
        return float(self.correct.float().mean()) if len(self.correct) else float("nan")

    def __len__(self) -> int:
        return len(self.correct)

    def __getitem__(self, index) -> "Evaluation":
        """The evaluation of a subset of the prompts (same indexing as ``PromptSet``)."""
        idx = as_index(index, len(self))
        return Evaluation(
            self.correct[idx], self.model_answer[idx], [self.answer_text[i] for i in idx.tolist()],
            self.generated_tokens[idx],
        )

    def __repr__(self) -> str:
        return f"Evaluation(accuracy={self.accuracy:.4f}, n={len(self.correct)})"


def as_index(index, n: int) -> torch.Tensor:
    """Row indices of ``n`` prompts selected by ``index``, refused when out of range (never wrapped past ``-n``).

    Args:
        index: A slice, an int, a list of ints, or a bool [n] / long tensor.
        n: How many prompts there are.

    Returns:
        The selected indices, long [k], each in ``0..n-1``.

    Raises:
        PromptIndexError: an index lies outside ``-n..n-1``.
        TaskError: a boolean index does not have shape ``(n,)``, or ``index`` is not an index (a
            string, a float, a bool on its own).
    """
    if isinstance(index, slice):
        return torch.arange(n)[index]
    kinds = "an int, a slice, a list of ints, or a bool [n] / integer tensor"
    if isinstance(index, (bool, str, bytes, float)):  # never read as a row: True is not row 1, 1.5 not row 1
        raise TaskError(f"prompts cannot be indexed by {index!r} ({type(index).__name__}); accepted: {kinds}")
    if hasattr(index, "__index__") and not hasattr(index, "__len__"):  # numpy / 0-d torch integer scalars
        index = operator.index(index)
    if isinstance(index, int):
        if not -n <= index < n:
            raise PromptIndexError(f"index {index} is out of range for {n} prompts; accepted: {-n}..{n - 1}")
        return torch.tensor([index % n])
    try:
        idx = torch.as_tensor(index)
    except (TypeError, ValueError, RuntimeError):
        raise TaskError(f"prompts cannot be indexed by {index!r}; accepted: {kinds}") from None
    if idx.numel() == 0:  # [] reads as a float tensor; it selects nothing
        return torch.zeros(0, dtype=torch.long)
    if idx.is_floating_point() or idx.is_complex():  # floats are never truncated to rows
        raise TaskError(f"prompts cannot be indexed by floats ({idx.dtype}); accepted: {kinds}")
    if idx.dtype == torch.bool:
        if idx.shape != (n,):
            raise TaskError(f"boolean index must have shape ({n},), got {tuple(idx.shape)}")
        return torch.nonzero(idx).flatten()
    if idx.numel() and (idx.max() >= n or idx.min() < -n):
        raise PromptIndexError(f"index out of range for a prompt set of {n} prompts; accepted: {-n}..{n - 1}")
    return idx.long().flatten() % max(n, 1)


def _batches(
    prompts: PromptSet, model: Any, batch_size: Optional[int], n_read: int, n_new: int, plain: bool = False
) -> list[torch.Tensor]:
    """Same-length groups of prompt indices, each split into batches (sized from a memory
    budget by :func:`arithinterp.engine.decode.batch_size_for` unless ``batch_size`` is given;
    ``plain``: for the plain forward, whose logits cover every position)."""
    from arithinterp.engine.decode import batch_size_for, decode_mode

    batches = []
    for group in prompts.length_groups():
        if not plain:
            decode_mode(model, prompts.unpadded(group[:1]))  # the path decides what a prompt costs
        size = batch_size or batch_size_for(model, int(prompts.lengths[group[0]]), n_read=n_read, n_new=n_new,
                                            plain=plain)
        batches += list(group.split(size))
    return batches


@torch.inference_mode()
def evaluate(prompts: PromptSet, model: HookedModel, batch_size: Optional[int] = None, progress: bool = False,
             writes: Sequence[Any] = ()) -> Evaluation:
    """Greedily generate each answer's tokens and compare with the true answer
    (:meth:`PromptSet.evaluate <arithinterp.tasks.PromptSet.evaluate>`).

    Args:
        prompts: The prompts.
        model: The hooked model the prompts were built for.
        batch_size: Prompts per forward; ``None`` chooses it from a memory budget.
        progress: Show a progress bar.
        writes: :class:`arithinterp.engine.Write` s applied in every forward (positions ``None`` or an int).

    Returns:
        The model's answers and whether each is correct.

    Raises:
        TaskError: an intervention gives per-prompt positions.
        ModelMismatchError: the prompts were built for another model.
    """
    check_belongs(model, "PromptSet.evaluate", prompts=prompts)
    from arithinterp.progress import progress_bar

    from arithinterp.engine.decode import greedy

    bad = [i for i in writes if i.positions is not None and not isinstance(i.positions, int)]
    if bad:
        raise TaskError(
            f"writes applied while evaluating must give positions as None or an int (the same in "
            f"every batch), not per-prompt tensors; got {type(bad[0].positions).__name__} at {bad[0].hook_name()}"
        )
    n_answer = prompts.answer_tokens.shape[1]
    generated = torch.full((len(prompts), n_answer), -1, dtype=torch.long)
    batches = _batches(prompts, model, batch_size, 1, n_answer, plain=bool(writes))
    for idx in progress_bar(batches, desc="evaluate", disable=not progress):
        generated[idx] = greedy(model, prompts.unpadded(idx), n_answer, writes)
    valid = prompts.answer_tokens >= 0
    correct = ((generated == prompts.answer_tokens) | ~valid).all(-1)
    texts, values = [], []
    names = {n.replace(" ", ""): i for i, n in enumerate(prompts.meta.get("names") or ())}
    for row, k in zip(generated.tolist(), prompts.n_answer_tokens.tolist()):
        text = prompts.tokenizer.decode(row[:k]).replace(" ", "")
        texts.append(text)
        if names:  # answers written as names (weekdays, months): the value is the name's index
            values.append(names.get(text, UNPARSABLE))
        else:
            values.append(int(text) if re.fullmatch(r"-?\d+", text) else UNPARSABLE)
    return Evaluation(correct, torch.tensor(values), texts, generated)


@torch.inference_mode()
def answer_logprob(prompts: PromptSet, model: HookedModel, batch_size: Optional[int] = None) -> torch.Tensor:
    """Log-probability of each true answer
    (:meth:`PromptSet.answer_logprob <arithinterp.tasks.PromptSet.answer_logprob>`).

    Args:
        prompts: The prompts; their ``scoring`` says whether the first answer token or every one is scored.
        model: The hooked model the prompts were built for.
        batch_size: Prompts per forward; ``None`` chooses it from a memory budget.

    Returns:
        The log-probabilities, float [N].

    Raises:
        ModelMismatchError: the prompts were built for another model.
    """
    check_belongs(model, "PromptSet.answer_logprob", prompts=prompts)
    from arithinterp.engine.decode import teacher_forced_logprobs

    n_score = prompts.answer_tokens.shape[1] if prompts.scoring == "full-answer" else 1
    total = torch.zeros(len(prompts))
    for idx in _batches(prompts, model, batch_size, n_score, n_score - 1):
        total[idx] = teacher_forced_logprobs(model, prompts.unpadded(idx), prompts.answer_tokens[idx, :n_score]).sum(-1)
    return total
