"""Running interchange interventions through the engine and scoring them.

The base prompt is fed with its *counterfactual* answer teacher-forced and the source prompt with
its own answer, so an intervention at an answer position sees what greedy decoding would have put
there. A pair counts as correct (interchange-intervention accuracy, IIA) when every answer token's
argmax is the counterfactual answer's token — which, teacher-forced, is the same as the patched
model *generating* the counterfactual answer. The logit-difference version is the logit of the
counterfactual token minus that of the base answer's token at the first answer token where they
differ (positive: the intervention moved the model towards the causal model's prediction).

*Reachable pairs*: an intervention at position ``p`` changes only the logits at ``p`` and after, so
it cannot change an answer token predicted before ``p`` (the thousands digit of a sum is predicted
at ``=``, before ``answer[0]``). :func:`reachable` marks the pairs whose counterfactual answer agrees
with the base answer at every token predicted before the earliest intervened position; on those
the teacher-forced tokens up to ``p`` are the base's own, so nothing of the counterfactual leaks in
before the intervention either. Scoring only reachable pairs is a rule about the site, not the
method: it is applied to DAS, every baseline and the control alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch

from arithinterp import sites as site_lib
from arithinterp.causal.datasets import InterchangeDataset
from arithinterp.causal.interventions import Intervention
from arithinterp.engine import Read, Write, run
from arithinterp.engine.decode import batch_size_for
from arithinterp.engine.interchange import ResumedRuns, resumed_runs
from arithinterp.errors import AnalysisError, SiteError
from arithinterp.types import ByteSize, HookedModel, NonNegativeInt, OpenUnitFloat, byte_size, checked

VECTOR_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "mlp_pre", "mlp_post")
HEAD_SITES = ("attn_z",)  # one vector per position *and head*: name the head


@checked
def wilson(correct: NonNegativeInt, n: NonNegativeInt, level: OpenUnitFloat = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``correct / n``.

    Args:
        correct: The successes.
        n: The trials.
        level: The confidence level.

    Returns:
        ``(low, high)`` within [0, 1]; ``(nan, nan)`` when ``n`` is 0.

    Raises:
        AnalysisError: ``correct`` exceeds ``n``.
    """
    if correct > n:
        raise AnalysisError(f"correct={correct} exceeds n={n}; the successes are some of the trials")
    if n == 0:
        return float("nan"), float("nan")
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + level / 2))
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


Position = Union[str, int, Sequence[Union[str, int]]]


@dataclass(frozen=True)
class Site:
    """Where an interchange happens: a vector site, a layer and a named position, or several positions
    swapped together through the same subspace (``["final", "answer[0]"]``); for ``attn_z`` also the
    ``head`` whose output vector (before ``W_O``) is interchanged.

    Attributes:
        site: A vector site (``"resid_post"``, ``"mlp_out"``, ...) or ``"attn_z"`` with a head.
        layer: The block.
        position: A position name or int, or a list of them swapped together.
        head: The head, for ``attn_z``; ``None`` otherwise.
    """

    site: str
    layer: int
    position: Position
    head: Optional[int] = None

    def check(self, model: HookedModel) -> int:
        """Validate the site against a model.

        Args:
            model: The hooked model.

        Returns:
            The site's width ``d`` (``d_head`` for a head, ``d_mlp`` for the neuron sites, else ``d_model``).

        Raises:
            SiteError: A site without one vector per position, a missing or out-of-range head, a
                head for a site without heads, or a layer out of range.
        """
        if self.site in HEAD_SITES:
            n_heads = int(model.cfg.n_heads)
            if isinstance(self.head, bool) or not isinstance(self.head, int) or not 0 <= self.head < n_heads:
                raise SiteError(f"site {self.site!r} holds one vector per head: pass head as an int in "
                                f"0..{n_heads - 1}, got {self.head!r}")
        elif self.site not in VECTOR_SITES:
            raise SiteError(f"interchange interventions act on one vector per position; site {self.site!r} is not one. "
                            f"Accepted: {', '.join(VECTOR_SITES)}, or {', '.join(HEAD_SITES)} with a head")
        elif self.head is not None:
            raise SiteError(f"head={self.head!r} is only for the per-head sites {', '.join(HEAD_SITES)}, "
                            f"not {self.site!r}")
        site_lib.check_layers(model, self.site, [self.layer])
        if self.site in HEAD_SITES:
            return int(model.cfg.d_head)
        return int(model.cfg.d_mlp if self.site in ("mlp_pre", "mlp_post") else model.cfg.d_model)

    def take(self, read: torch.Tensor) -> torch.Tensor:
        """This site's vectors from a read of its hook.

        Args:
            read (Float[Tensor, "batch ... d"]): The read ``[batch, (position,) (head,) d]``.

        Returns:
            Float[Tensor, "batch ... d"]: ``[batch, (position,) d]``: the head's vectors for ``attn_z``.
        """
        return read if self.head is None else read[..., self.head, :]

    @property
    def units(self) -> Optional[list[int]]:
        return None if self.head is None else [self.head]


@dataclass(frozen=True)
class Batch:
    rows: torch.Tensor  # [B] pair indices
    base_tokens: torch.Tensor  # [B, L + K - 1]
    source_tokens: torch.Tensor
    position: torch.Tensor  # [B] in the fed frame, or [B, P] for several positions
    first_answer: int  # index of the logits that predict answer token 0
    targets: torch.Tensor  # [B, K] counterfactual answer tokens
    base_targets: torch.Tensor  # [B, K] the base's own answer tokens


def _fed(tokens: torch.Tensor, length: int, answers: torch.Tensor) -> torch.Tensor:
    """Prompt tokens of one length (unpadded) followed by all but the last answer token."""
    return torch.cat([tokens[:, tokens.shape[1] - length:], answers[:, :-1]], dim=1)


def batches(dataset: InterchangeDataset, rows: torch.Tensor, position: Position, size: int) -> Iterator[Batch]:
    """``rows`` of ``dataset`` grouped by prompt and answer length, in batches of ``size``."""
    base, source = dataset.base, dataset.source
    k_answer = base.n_answer_tokens
    keys = torch.stack([base.lengths[rows], k_answer[rows]], dim=1)
    for key in torch.unique(keys, dim=0):
        group = rows[(keys == key).all(1)]
        length, k = int(key[0]), int(key[1])
        _, located = base[group].locate(position, answers=k - 1)
        pos = located - (base.tokens.shape[1] - length)
        pos = pos[:, 0] if pos.shape[1] == 1 else pos
        for start in range(0, len(group), size):
            part = group[start: start + size]
            sel = slice(start, start + size)
            yield Batch(
                rows=part,
                base_tokens=_fed(base.tokens[part], length, dataset.answer_tokens[part, :k]),
                source_tokens=_fed(source.tokens[part], length, source.answer_tokens[part, :k]),
                position=pos[sel],
                first_answer=length - 1,
                targets=dataset.answer_tokens[part, :k],
                base_targets=base.answer_tokens[part, :k],
            )


def reachable(dataset: InterchangeDataset, rows: torch.Tensor, position: Position) -> torch.Tensor:
    """``[len(rows)]`` bool: whether an intervention at ``position`` (the earliest, for several) can
    reach every answer token where the pair's counterfactual differs from its base answer."""
    out = torch.zeros(len(dataset), dtype=torch.bool)
    for batch in batches(dataset, rows, position, max(1, len(rows))):
        first_diff = (batch.targets != batch.base_targets).float().argmax(-1)  # balanced: some token differs
        earliest = batch.position if batch.position.ndim == 1 else batch.position.min(-1).values
        out[batch.rows] = earliest <= batch.first_answer + first_diff  # the logits at q predict token q + 1
    return out[rows]


def _budget(max_memory: Optional[ByteSize]) -> Optional[int]:
    """``max_memory`` in bytes; ``None`` stays ``None`` (the engine's default budget)."""
    return None if max_memory is None else byte_size(max_memory)


def batch_size(model: HookedModel, dataset: InterchangeDataset, training: bool, max_memory: Optional[ByteSize]) -> int:
    """Pairs per forward from a memory budget (bytes; default the engine's): a training step keeps the
    activations for the backward pass, about three forwards' worth."""
    seq = int(dataset.base.lengths.max()) + int(dataset.answer_tokens.shape[1])
    size = batch_size_for(model, seq, n_read=int(dataset.answer_tokens.shape[1]), budget_bytes=_budget(max_memory))
    return max(1, size // 3) if training else size


def pairs_per_step(model: HookedModel, dataset: InterchangeDataset, max_memory: Optional[ByteSize]) -> int:
    """Training pairs drawn for each Adam step (at most 256): a third of the pairs whose whole forward,
    logits at every position included, fits ``max_memory``. A setting of the fit, not of how its
    forwards run: resumed runs that unembed the answer positions alone draw the same number, so a
    fit gives the same result on either path."""
    seq = int(dataset.base.lengths.max()) + int(dataset.answer_tokens.shape[1])
    size = batch_size_for(model, seq, n_read=seq, budget_bytes=_budget(max_memory), plain=True)
    return min(max(1, size // 3), 256)


def _width(where: Site) -> tuple[int, ...]:
    if isinstance(where.position, (str, int)):
        return ()
    n = len(list(where.position))
    return () if n == 1 else (n,)


def source_values(model: HookedModel, dataset: InterchangeDataset, where: Site, size: int) -> torch.Tensor:
    """The source prompts' activations ``[N, (P,) d]`` at ``where`` (float32, constant).

    A source prompt drawn for several pairs (with the same fed tokens and positions) runs once; the
    forward stops after ``where.layer`` and builds no logits."""
    out = torch.zeros(len(dataset), *_width(where), where.check(model))
    for batch in batches(dataset, torch.arange(len(dataset)), where.position, len(dataset)):
        keys = torch.cat([batch.source_tokens, batch.position.reshape(len(batch.rows), -1)], dim=1)
        distinct, inverse = torch.unique(keys, dim=0, return_inverse=True)
        first = torch.full((len(distinct),), len(keys), dtype=torch.long).scatter_reduce(
            0, inverse, torch.arange(len(keys)), reduce="amin")  # one row of each distinct source
        values = torch.zeros(len(distinct), *out.shape[1:])
        for start in range(0, len(first), size):
            part = first[start: start + size]
            read = Read(where.site, where.layer, positions=batch.position[part])
            got = run(model, batch.source_tokens[part], reads=[read], logits="none").reads[0]
            values[start: start + size] = where.take(got).float().cpu()
        out[batch.rows] = values[inverse]
    return out


def base_values(model: HookedModel, dataset: InterchangeDataset, where: Site, size: int,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The base prompts' activations ``[len(rows), (P,) d]`` at ``where`` (unpatched)."""
    rows = torch.arange(len(dataset)) if rows is None else rows
    out = torch.zeros(len(dataset), *_width(where), where.check(model))
    for batch in batches(dataset, rows, where.position, size):
        read = Read(where.site, where.layer, positions=batch.position)
        out[batch.rows] = where.take(run(model, batch.base_tokens, reads=[read], logits="none").reads[0]).float().cpu()
    return out[rows]


def forward(model: HookedModel, batch: Batch, where: Site, intervention: Optional[Intervention],
            sources: torch.Tensor, train: bool, runs: Optional["Runs"] = None) -> torch.Tensor:
    """Logits ``[B, K, V]`` at the answer tokens with the interchange applied (``None``: unpatched).

    With ``runs`` (:class:`Runs`) the patched run resumes at the intervened layer from the base run
    kept there; otherwise (or where the model's blocks cannot be stepped) it is one whole forward."""
    device = next(iter(model.parameters())).device
    interventions = []
    if intervention is not None:
        source = sources[batch.rows].to(device)
        interventions.append(Write(where.site, where.layer, positions=batch.position.to(device),
                                          units=where.units, value=intervention,
                                          source=source if where.head is None else source.unsqueeze(-2)))
    k = batch.targets.shape[1]
    if batch.first_answer + k != batch.base_tokens.shape[1]:
        raise AnalysisError(f"the answer logits {batch.first_answer}..{batch.first_answer + k - 1} are not the last "
                            f"{k} positions of {batch.base_tokens.shape[1]} fed tokens")
    resumed = None if runs is None else runs.of(batch)
    if resumed is not None:
        group, rows = resumed
        with torch.enable_grad() if train else torch.inference_mode():
            return group.logits(rows, interventions)
    out = run(model, batch.base_tokens.to(device), interventions, logits=k, train=train)  # the answers' alone
    assert out.logits is not None
    return out.logits


class Runs:
    """The interchanged runs of one fit at ``where``: for each group of pairs of one prompt length
    (and answer length), the base and source prompts' runs kept once
    (:func:`~arithinterp.engine.interchange.resumed_runs`), so that every training step, evaluation
    and baseline resumes at the intervened layer and position and unembeds the answer positions
    alone, and the source values and the probe's base activations are read on the way. A prompt
    drawn for several pairs runs once. Where the model's blocks cannot be stepped exactly (or
    ``engine="hooks"``) every group runs whole forwards instead (:func:`forward` without runs).

    Args:
        rows: the pairs that will be run (train and held-out); the others are never run.
    """

    def __init__(self, model: HookedModel, dataset: InterchangeDataset, where: Site, rows: torch.Tensor, *,
                 max_memory: Optional[ByteSize] = None, engine: str = "auto"):
        self.model, self.dataset, self.where = model, dataset, where
        self.rows = torch.unique(rows)
        # pair -> the row of its base prompt, and of its source prompt, in its group's runs
        self.base_row = torch.full((len(dataset),), -1, dtype=torch.long)
        self.source_row = torch.full((len(dataset),), -1, dtype=torch.long)
        self.groups: dict[tuple[int, int], Optional[ResumedRuns]] = {}
        self.sizes: list[int] = []
        budget = _budget(max_memory)
        for batch in batches(dataset, self.rows, where.position, max(1, len(dataset))):
            T, k, n = int(batch.base_tokens.shape[1]), int(batch.targets.shape[1]), len(batch.rows)
            positions = torch.cat([batch.position, batch.position])
            fed = torch.cat([batch.base_tokens, batch.source_tokens])
            distinct, inverse = torch.unique(torch.cat([fed, positions.reshape(2 * n, -1)], dim=1), dim=0,
                                             return_inverse=True)
            first = torch.full((len(distinct),), 2 * n, dtype=torch.long).scatter_reduce(
                0, inverse, torch.arange(2 * n), reduce="amin")  # one row of each distinct prompt and position
            size = max(1, batch_size_for(model, T, n_read=k, budget_bytes=budget))
            start = min(int(batch.position.min()), T - k)  # the scored positions are recomputed too
            group = resumed_runs(model, fed[first], where.site, where.layer, start, k, read_positions=positions[first],
                                 batch_size=size, engine=engine)
            self.groups[(T, k)] = group
            self.base_row[batch.rows], self.source_row[batch.rows] = inverse[:n], inverse[n:]
            self.sizes.append(size)

    @property
    def stepped(self) -> bool:
        """Whether every group resumes at the intervened layer (else every one runs whole forwards)."""
        return bool(self.groups) and all(group is not None for group in self.groups.values())

    @property
    def eval_size(self) -> int:
        """Pairs per scoring batch (each group's runs split it further to fit the memory budget)."""
        return max(self.sizes, default=1)

    def of(self, batch: Batch) -> Optional[tuple[ResumedRuns, torch.Tensor]]:
        """The group's runs and the batch's base prompts' rows in them, or ``None`` (whole forwards)."""
        group = self.groups.get((int(batch.base_tokens.shape[1]), int(batch.targets.shape[1])))
        if group is None or not self.stepped:
            return None
        rows = self.base_row[batch.rows]
        if bool((rows < 0).any()):
            raise AnalysisError("a pair outside the rows these runs were made for was asked for")
        return group, rows

    def _read(self, rows: torch.Tensor, source: bool) -> torch.Tensor:
        out = torch.zeros(len(self.dataset), *_width(self.where), self.where.check(self.model))
        index = self.source_row if source else self.base_row
        for batch in batches(self.dataset, rows, self.where.position, max(1, len(rows))):
            group = self.groups[(int(batch.base_tokens.shape[1]), int(batch.targets.shape[1]))]
            assert group is not None  # callers check stepped
            out[batch.rows] = self.where.take(group.base_reads(index[batch.rows])).float().cpu()
        return out

    def source_values(self, size: int) -> torch.Tensor:
        """The source prompts' activations ``[N, (P,) d]`` at ``where``, as :func:`source_values` gives
        them (zero for pairs outside ``rows``), read from the kept runs."""
        if not self.stepped:
            return source_values(self.model, self.dataset, self.where, size)
        return self._read(self.rows, source=True)

    def base_values(self, rows: torch.Tensor, size: int) -> torch.Tensor:
        """The base prompts' activations ``[len(rows), (P,) d]`` at ``where`` (unpatched), as
        :func:`base_values` gives them, read from the kept runs."""
        if not self.stepped:
            return base_values(self.model, self.dataset, self.where, size, rows)
        return self._read(rows, source=False)[rows]


def score(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: ``correct [B]`` (every answer token's argmax is the counterfactual's) and the
    logit difference ``[B]`` at the first token where the counterfactual and base answers differ."""
    targets, base_targets = batch.targets.to(logits.device), batch.base_targets.to(logits.device)
    correct = (logits.argmax(-1) == targets).all(-1)
    differs = targets != base_targets
    if not differs.any(-1).all():
        raise AnalysisError("a counterfactual answer equals its base answer; the dataset is not balanced")
    slot = differs.float().argmax(-1)
    rows = torch.arange(len(slot), device=logits.device)
    at = logits[rows, slot].float()  # a half-precision model's difference in float32
    diff = at[rows, targets[rows, slot]] - at[rows, base_targets[rows, slot]]
    return correct.cpu(), diff.cpu()


@torch.inference_mode()
def evaluate(model: HookedModel, dataset: InterchangeDataset, where: Site, intervention: Optional[Intervention],
             sources: torch.Tensor, rows: torch.Tensor, size: int, runs: Optional[Runs] = None) -> dict:
    """IIA with its 95% Wilson interval and the mean logit difference over ``rows`` (``runs``: resumed
    runs, see :func:`forward`)."""
    if len(rows) == 0:
        raise AnalysisError("no pairs to score (the split is empty); use more prompts or another test_fraction")
    correct, diffs = [], []
    for batch in batches(dataset, rows, where.position, size):
        c, d = score(forward(model, batch, where, intervention, sources, train=False, runs=runs), batch)
        correct.append(c)
        diffs.append(d)
    hits = torch.cat(correct)
    low, high = wilson(int(hits.sum()), len(hits))
    diff = torch.cat(diffs)
    return dict(iia=float(hits.float().mean()), low=low, high=high, logit_diff=float(diff.mean()),
                logit_diff_sem=float(diff.std() / math.sqrt(len(diff))) if len(diff) > 1 else 0.0, n=len(hits))
