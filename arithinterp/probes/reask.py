"""Re-asking flagged prompts: policies and :func:`repair`.

:func:`repair` re-asks only the prompts an :class:`~arithinterp.probes.detector.ErrorDetector`
flags, with :func:`few_shot_policy` or :func:`vote_policy`, keeps a new answer only when the
detector believes it more than the old one (``accept="confidence"``), and counts errors fixed vs
correct answers broken → :class:`RepairResult` (Sun, Stolfo & Sachan 2025: re-prompt only the
flagged step).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from arithinterp import engine
from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError, TaskError
from arithinterp.probes.detector import ErrorDetector
from arithinterp.probes.probe_base import to_tensor
from arithinterp.results import Result, build_meta
from arithinterp.tasks import UNPARSABLE as _UNPARSABLE  # a generated answer that is not a number
from arithinterp.types import checked

if TYPE_CHECKING:
    from arithinterp.tasks import Evaluation, PromptSet
    from arithinterp.types import HookedModel

ACCEPT_RULES = ("confidence", "always")


# --- re-asking flagged prompts --------------------------------------------------------------------


def _parse_answers(tokenizer: Any, generated: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    """Generated answer tokens → integers (``tasks.UNPARSABLE`` when not a number), as ``evaluate`` does."""
    values = []
    for row, k in zip(generated.tolist(), n_tokens.tolist()):
        text = tokenizer.decode(row[:k]).replace(" ", "")
        values.append(int(text) if re.fullmatch(r"-?\d+", text) else _UNPARSABLE)
    return torch.tensor(values, dtype=torch.long)


def _reprefixed(prompts: Any, prefix: str, n_ctx: Optional[int]) -> Any:
    """The same prompts with ``prefix`` in place of their own prefix (positions shifted)."""
    prompts.require_one_prefix("re-asking with a new few-shot prefix")
    tokenizer = prompts.tokenizer
    bodies = [text[len(prompts.prefix):] for text in prompts.texts]
    ids = tokenizer([prefix + body for body in bodies], add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if prompts.prepend_bos else []
    rows = [bos + row for row in ids]
    if tokenizer.unk_token_id is not None and any(tokenizer.unk_token_id in row for row in rows):
        raise TaskError(f"the few-shot prefix {prefix[:40]!r}... has text this tokenizer does not know")
    length = max(len(row) for row in rows)
    if n_ctx is not None and length + prompts.answer_tokens.shape[1] > n_ctx:
        raise TaskError(f"a {length}-token prompt with a few-shot prefix does not fit the model's context of {n_ctx}")
    old_length = prompts.tokens.shape[1]
    tail = int((old_length - torch.stack(list(prompts.positions.values())).min()))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokens = torch.full((len(rows), length), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, length - len(row):] = torch.tensor(row)
    if not torch.equal(tokens[:, -tail:], prompts.tokens[:, -tail:]):
        raise TaskError("the few-shot prefix changes how the prompts themselves tokenize; end it with a separator")
    return replace(
        prompts, texts=tuple(prefix + body for body in bodies), tokens=tokens,
        lengths=torch.tensor([len(row) for row in rows]), prefix=prefix,
        positions={name: pos + (length - old_length) for name, pos in prompts.positions.items()},
    )


@checked
def few_shot_policy(n_shots: int = 3, seed: int = 1) -> Callable[[Any, Any], torch.Tensor]:
    """A re-ask policy: greedy, with solved examples as a new few-shot prefix.

    Args:
        n_shots: The number of solved examples.
        seed: Seeds the examples' draw from the prompts' operands.

    Returns:
        ``policy(model, prompts) -> Int[Tensor, "prompt"]``, the new answers; it raises
        ``TaskError`` when the prompts mix prefixes or the prefix does not fit the model.
    """
    import random

    from arithinterp.tasks import answer_text, compute
    from arithinterp.tasks.templates import render

    def few_shot(model: HookedModel, prompts: PromptSet) -> torch.Tensor:
        prompts.require_one_prefix("re-asking with a new few-shot prefix")
        template = prompts.template
        assert template is not None  # a set with one prefix has one template
        rng = random.Random(seed)
        a_pool, b_pool = prompts.a.tolist(), prompts.b.tolist()
        digits = prompts.meta.get("answer_digits", 0)
        lines = []
        for _ in range(n_shots):
            a, b = rng.choice(a_pool), rng.choice(b_pool)
            value = compute(prompts.op, a, b, prompts.modulus)
            lines.append(render(template, a, b, prompts.op) + answer_text(value, digits) + "\n")
        shifted = _reprefixed(prompts, "".join(lines), getattr(model.cfg, "n_ctx", None))
        return shifted.evaluate(model).model_answer

    few_shot.__name__ = f"few_shot(n_shots={n_shots}, seed={seed})"
    return few_shot


@checked
def vote_policy(
    n_samples: int = 8, temperature: float = 1.0, seed: int = 0, batch_size: int = 256
) -> Callable[[Any, Any], torch.Tensor]:
    """A re-ask policy: sample several answers and keep the most frequent number (self-consistency).
    A deterministic greedy re-run could not change an answer.

    Args:
        n_samples: Answers sampled per prompt.
        temperature: The sampling temperature, > 0.
        seed: Seeds the sampling.
        batch_size: Sampled rows per forward.

    Returns:
        ``policy(model, prompts) -> Int[Tensor, "prompt"]``, the new answers.

    Raises:
        ConfigError: ``n_samples < 1`` or ``temperature <= 0``.
    """
    if not (n_samples >= 1 and temperature > 0):
        raise ConfigError(f"vote_policy needs n_samples >= 1 and temperature > 0, got {n_samples}, {temperature}")

    @torch.inference_mode()
    def vote(model: HookedModel, prompts: PromptSet) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        k = prompts.answer_tokens.shape[1]
        values = torch.empty(len(prompts), n_samples, dtype=torch.long)
        for idx in [g for group in prompts.length_groups() for g in group.split(max(1, batch_size // n_samples))]:
            tokens = prompts.unpadded(idx).repeat_interleave(n_samples, 0)
            for _ in range(k):
                logits = engine.run(model, tokens).logits  # the final position's alone, float32
                assert logits is not None  # run keeps the final logits unless told not to
                probs = (logits / temperature).softmax(-1).cpu()  # the seeded generator lives on the CPU
                nxt = torch.multinomial(probs, 1, generator=generator).to(tokens.device)
                tokens = torch.cat([tokens, nxt], dim=1)
            generated = tokens[:, -k:].cpu()
            n_answer = prompts.n_answer_tokens[idx].repeat_interleave(n_samples)
            parsed = _parse_answers(prompts.tokenizer, generated, n_answer)
            values[idx] = parsed.view(len(idx), n_samples)
        # most frequent parsable value per prompt (ties: the earliest sample)
        counts = (values[:, :, None] == values[:, None, :]).sum(-1) - 0.5 * (values == _UNPARSABLE)
        return values.gather(1, counts.argmax(1, keepdim=True))[:, 0]

    vote.__name__ = f"vote(n_samples={n_samples}, temperature={temperature}, seed={seed})"
    return vote


@dataclass(frozen=True)
class RepairResult(Result):
    """Re-asking the flagged prompts: answers before and after, and what changed.

    Attributes:
        a (Int[Tensor, "prompt"]): The first operands.
        b (Int[Tensor, "prompt"]): The second operands.
        answer (Int[Tensor, "prompt"]): The true answers.
        flagged (Bool[Tensor, "prompt"]): The prompts the detector flagged.
        answer_before (Int[Tensor, "prompt"]): The model's answers.
        answer_after (Int[Tensor, "prompt"]): The answers after the re-ask.
        correct_before (Bool[Tensor, "prompt"]): Whether ``answer_before`` is right.
        correct_after (Bool[Tensor, "prompt"]): Whether ``answer_after`` is right.
        accepted (Bool[Tensor, "prompt"]): Flagged prompts whose new answer was kept (under ``accept``).
        policy: The re-ask policy's name.
        accept: ``"confidence"`` or ``"always"``.
        meta: Provenance, the detector's layers and method, the budget.
    """

    a: torch.Tensor
    b: torch.Tensor
    answer: torch.Tensor
    flagged: torch.Tensor
    answer_before: torch.Tensor
    answer_after: torch.Tensor
    correct_before: torch.Tensor
    correct_after: torch.Tensor
    accepted: torch.Tensor
    policy: str
    accept: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"a": "prompt", "b": "prompt", "answer": "prompt", "flagged": "prompt", "answer_before": "prompt",
               "answer_after": "prompt", "correct_before": "prompt", "correct_after": "prompt", "accepted": "prompt"}
    _legal = {"accept": ACCEPT_RULES}

    @property
    def fixed(self) -> int:
        """Wrong answers the re-ask made right."""
        return int((self.flagged & ~self.correct_before & self.correct_after).sum())

    @property
    def broken(self) -> int:
        """Right answers the re-ask made wrong."""
        return int((self.flagged & self.correct_before & ~self.correct_after).sum())

    def headline(self) -> dict:
        """Accuracy before and after, and the answers fixed and broken (:meth:`summary`).

        Returns:
            ``accuracy_before``, ``accuracy_after``, ``flagged``, ``fixed`` and ``broken``.
        """
        found = self.summary()
        return {key: found[key] for key in ("accuracy_before", "accuracy_after", "flagged", "fixed", "broken")}

    def summary(self) -> dict:
        """Counts and accuracies.

        Returns:
            ``n``, ``flagged``, ``errors_before``, ``errors_flagged``, ``accepted``, ``fixed``,
            ``broken``, ``net``, ``accuracy_before``, ``accuracy_after``, ``policy`` and ``accept``.
        """
        before, after = self.correct_before.float().mean(), self.correct_after.float().mean()
        return dict(
            n=len(self.flagged), flagged=int(self.flagged.sum()), errors_before=int((~self.correct_before).sum()),
            errors_flagged=int((self.flagged & ~self.correct_before).sum()), accepted=int(self.accepted.sum()),
            fixed=self.fixed, broken=self.broken, net=self.fixed - self.broken,
            accuracy_before=float(before), accuracy_after=float(after), policy=self.policy, accept=self.accept,
        )

    def to_frame(self):
        """One row per prompt."""
        import pandas as pd

        return pd.DataFrame(dict(
            a=self.a.numpy(), b=self.b.numpy(), answer=self.answer.numpy(), flagged=self.flagged.numpy(),
            answer_before=self.answer_before.numpy(), answer_after=self.answer_after.numpy(),
            accepted=self.accepted.numpy(),
            correct_before=self.correct_before.numpy(), correct_after=self.correct_after.numpy(),
        ))

    def plot(self, **kwargs):
        return draw(self, **kwargs)


def _answer_evaluation(prompts: Any, values: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """An ``Evaluation`` of ``prompts`` as if the model had answered ``values`` [N], and which
    of them tokenize into the prompts' answer slots (others cannot be scored by the detector)."""
    from arithinterp.tasks import Evaluation, answer_text

    tokenizer, digits = prompts.tokenizer, prompts.meta.get("answer_digits", 0)
    texts = [answer_text(int(v), digits) if int(v) != _UNPARSABLE else "?" for v in values.tolist()]
    prompt_ids = tokenizer(list(prompts.texts), add_special_tokens=False)["input_ids"]
    full = tokenizer([t + a for t, a in zip(prompts.texts, texts)], add_special_tokens=False)["input_ids"]
    generated = prompts.answer_tokens.clamp_min(0)  # slots past a short answer are never read
    ok = torch.zeros(len(values), dtype=torch.bool)
    for i, (ids, row) in enumerate(zip(prompt_ids, full)):
        answer = row[len(ids):]
        if row[: len(ids)] == ids and len(answer) == int(prompts.n_answer_tokens[i]) and int(values[i]) != _UNPARSABLE:
            generated[i, : len(answer)] = torch.tensor(answer)
            ok[i] = True
    return Evaluation(values == prompts.answer, values.clone(), texts, generated), ok


@checked
def repair(
    model: HookedModel, prompts: PromptSet, detector: ErrorDetector, policy: Optional[Callable] = None,
    evaluation: Optional[Evaluation] = None, accept: str = "confidence", budget: Optional[float] = None,
) -> RepairResult:
    """Re-ask only the prompts ``detector`` flags and count errors fixed vs correct answers broken.

    ``policy(model, flagged_prompts)`` returns the new answers (a LongTensor, or an
    ``Evaluation``). Default: :func:`few_shot_policy` when a few-shot prefix fits the model and
    its tokenizer, else :func:`vote_policy` (the reason is kept in ``meta``). ``accept``:
    ``"confidence"`` keeps a new answer only when ``detector.answer_confidence`` is higher for it
    than for the old one (each read with its own answer fed back); ``"always"`` keeps every
    new answer. Sun, Stolfo & Sachan 2025: re-prompt only the flagged step.

    Args:
        model: The hooked model.
        prompts: The prompts.
        detector: A fitted :class:`ErrorDetector`.
        policy: ``policy(model, flagged_prompts)`` returning the new answers.
        evaluation: The model's answers (default ``prompts.evaluate(model)``).
        accept: ``"confidence"`` or ``"always"``.
        budget: Flag the riskiest fraction of prompts instead of using the threshold.

    Returns:
        Per prompt, the answers before and after and whether each new answer was kept.

    Raises:
        ConfigError: An unknown ``accept`` rule.
        AnalysisError: ``detector`` is not an ErrorDetector, or the policy returns the wrong number
            of answers.
        ModelMismatchError: The prompts or detector belong to another model.
    """
    check_belongs(model, "probes.repair", prompts=prompts, detector=detector)
    if not isinstance(detector, ErrorDetector):
        raise AnalysisError(f"detector must be a fitted ErrorDetector, got {type(detector).__name__}")
    if accept not in ACCEPT_RULES:
        raise ConfigError(f"unknown accept rule {accept!r}; accepted: {', '.join(map(repr, ACCEPT_RULES))}")
    evaluation = evaluation if evaluation is not None else prompts.evaluate(model)
    flagged = detector.flag(model, prompts, evaluation, budget=budget)
    after = evaluation.model_answer.clone()
    taken = torch.zeros(len(prompts), dtype=torch.bool)
    meta = build_meta(model, n_prompts=len(prompts), detector_layers=detector.layers_, detector_method=detector.method_,
                      budget=budget)
    name = getattr(policy, "__name__", type(policy).__name__)
    if flagged.any():
        sub = prompts[flagged]
        if policy is None:
            try:
                policy = few_shot_policy()
                new = policy(model, sub)
            except TaskError as error:
                meta["few_shot_unavailable"] = str(error)
                policy = vote_policy()
                new = policy(model, sub)
            name = policy.__name__
        else:
            new = policy(model, sub)
        new = to_tensor(getattr(new, "model_answer", new), "policy answers").long()
        if new.shape != (len(sub),):
            raise AnalysisError(
                f"the policy must return one answer per flagged prompt ({len(sub)}), got {tuple(new.shape)}")
        keep = new != evaluation.model_answer[flagged]
        if accept == "confidence" and keep.any():
            candidate, scorable = _answer_evaluation(sub, new)
            old = detector.answer_confidence(model, sub, evaluation[flagged])
            confidence = detector.answer_confidence(model, sub, candidate)
            keep &= scorable & (confidence > old)
        after[flagged] = torch.where(keep, new, evaluation.model_answer[flagged])
        taken[flagged] = keep
    correct_after = torch.where(taken, after == prompts.answer, evaluation.correct.bool())
    return RepairResult(
        a=prompts.a, b=prompts.b, answer=prompts.answer, flagged=flagged, answer_before=evaluation.model_answer,
        answer_after=after, correct_before=evaluation.correct.bool(), correct_after=correct_after, accepted=taken,
        policy=str(name if policy is not None else "none (nothing flagged)"), accept=accept, meta=meta,
    )
