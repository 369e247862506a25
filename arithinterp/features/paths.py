"""The case study's two paths (Lindsey et al. 2025, "On the Biology of a Large Language Model", addition):
a **last-digit** path (features labelled by a residue the last digit decides: ``a``/``b``/result
mod 10, 5 or 2, a result pattern fixing only its last digit, the lookup table "a ≡ i and b ≡ j
(mod 10)") and a **magnitude** path (operand and result ranges, result patterns leaving the last
digit free).

:func:`feature_paths` sorts labelled features into the two; :func:`path_ablation` zeroes one path's
features in the real model (through :func:`~arithinterp.features.feature_interventions`) and
measures what is left of the demeaned answer logit, beside zeroing as many random features of the
same layers, with bootstrap intervals over prompts (:func:`arithinterp.intervals.ratio_to_reference`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional, Sequence

import pandas as pd
import torch

from arithinterp.checks import check_belongs, check_tokens
from arithinterp.drawing import draw
from arithinterp.engine import run
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.features.interventions import feature_interventions
from arithinterp.features.labels import LOOKUP_FAMILY
from arithinterp.features.transcoder import Transcoders
from arithinterp.intervals import ratio_to_reference
from arithinterp.neurons import HeuristicTable
from arithinterp.results import DISTINCT, NON_NEGATIVE, PROBABILITY, Result, build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import HookedModel, IndexList, IntList, NonNegativeInt, OpenUnitFloat, PositiveInt, Seed, checked

LAST_DIGIT, MAGNITUDE = "last digit", "magnitude"
PATHS = (LAST_DIGIT, MAGNITUDE)
# residues the last digit alone decides (n divides 10)
_LAST_DIGIT_MODULI = (2, 5, 10)


@checked
def path_of(name: str, family: str) -> Optional[str]:
    """The path a heuristic label belongs to.

    Args:
        name: The heuristic's name (``"a mod 10 = 3"``, ``"result in [20, 30)"``).
        family: Its family.

    Returns:
        :data:`LAST_DIGIT`, :data:`MAGNITUDE`, or ``None`` (exact values, other residues, identical operands).
    """
    if family == LOOKUP_FAMILY:
        return LAST_DIGIT
    if family in ("operand mod", "result mod"):
        match = re.search(r"mod (\d+) =", name)
        return LAST_DIGIT if match and int(match.group(1)) in _LAST_DIGIT_MODULI else None
    if family in ("operand range", "result range"):
        return MAGNITUDE
    if family == "digit pattern":  # "result ~ ..5": the last character fixed and nothing else → last digit
        pattern = name.split("~", 1)[-1].strip()
        if pattern.endswith(".") and pattern.strip("."):
            return MAGNITUDE
        if pattern[:-1].strip(".") == "":
            return LAST_DIGIT
    return None


@checked
def feature_paths(tables: Sequence[HeuristicTable]) -> dict[str, dict[int, list[int]]]:
    """``{path: {layer: [features]}}`` from :func:`~arithinterp.features.label_features` tables (one
    per layer). A feature goes to a path when all of its labels that belong to a path belong to
    that one; features with labels of both paths (or of neither) are left out.

    Args:
        tables: Labelled tables, one per layer.

    Returns:
        ``{path: {layer: [features]}}`` for every path of :data:`PATHS`.
    """
    out: dict[str, dict[int, list[int]]] = {p: {} for p in PATHS}
    for table in tables:
        labels = table.labels
        for row in range(len(table.neuron)):
            found = {path_of(table.names[h], table.families[h]) for h in labels[row].nonzero().flatten().tolist()}
            found.discard(None)
            if len(found) == 1:
                path = found.pop()
                assert path is not None
                out[path].setdefault(int(table.layer[row]), []).append(int(table.neuron[row]))
    return out


@dataclasses.dataclass(frozen=True)
class PathAblationResult(Result):
    """The answer logit with each arm's features zeroed (arm 0: nothing zeroed).

    Attributes:
        arms: The arms' names.
        logits (Float[Tensor, "arm prompt"]): The demeaned answer logits.
        correct (Bool[Tensor, "arm prompt"]): Top-1 correctness.
        n_features (Int[Tensor, "arm"]): Features zeroed per arm.
        share (Float[Tensor, "arm"]): Mean logit as a fraction of arm 0's (NaN when arm 0's mean is
            not distinct from 0).
        share_low (Float[Tensor, "arm"]): Its paired bootstrap interval's low end, over prompts.
        share_high (Float[Tensor, "arm"]): Its high end.
        meta: Provenance and the settings.
    """

    arms: list
    logits: torch.Tensor
    correct: torch.Tensor
    n_features: torch.Tensor
    share: torch.Tensor
    share_low: torch.Tensor
    share_high: torch.Tensor
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"arms": "arm", "logits": "arm prompt", "correct": "arm prompt", "n_features": "arm", "share": "arm",
               "share_low": "arm", "share_high": "arm"}
    _legal = {"arms": DISTINCT, "correct": PROBABILITY, "n_features": NON_NEGATIVE}

    def to_frame(self) -> pd.DataFrame:
        """One row per arm: features zeroed, mean logit, its share of the unablated one (with the
        interval) and top-1 accuracy."""
        return pd.DataFrame(dict(
            arm=self.arms, n_features=self.n_features.tolist(), mean_logit=self.logits.mean(1).tolist(),
            share=self.share.tolist(), share_low=self.share_low.tolist(), share_high=self.share_high.tolist(),
            accuracy=self.correct.float().mean(1).tolist()))

    def plot(self, **kwargs: Any):
        return draw(self, **kwargs)


def _count(features: Mapping[int, Sequence[int]]) -> int:
    return sum(len(v) for v in features.values())


def _interventions(transcoders: Transcoders, features: Mapping[int, Sequence[int]],
                   positions: Optional[list[int]]) -> list:
    out = []
    for layer, chosen in sorted(features.items()):
        if chosen:
            out += feature_interventions(transcoders, layer, chosen, scale=0.0, positions=positions)
    return out


@checked
def path_ablation(model: HookedModel, prompts: PromptSet, transcoders: Transcoders,
                  paths: dict[str, dict[NonNegativeInt, IndexList]], *, n_random: PositiveInt = 5,
                  positions: Optional[IntList] = (-1,), confidence: OpenUnitFloat = 0.95,
                  n_boot: PositiveInt = 1000, seed: Seed = 0, batch_size: PositiveInt = 256) -> PathAblationResult:
    """Zero each path's features (``paths``: ``{name: {layer: [features]}}``, e.g. from
    :func:`feature_paths`) at ``positions`` (default the final one; None: every position) of each
    prompt and read the demeaned logit of its answer's first token at the final position. Arms:
    none zeroed; each path; every path at once; and for each path ``n_random`` draws of as many
    features per layer from the features of that layer outside it (seeded), their logits averaged
    per prompt.

    Args:
        model: The hooked model.
        prompts: The prompts, at least 2 (each length runs unpadded).
        transcoders: The transcoders.
        paths: ``{name: {layer: [features]}}``, e.g. from :func:`feature_paths`.
        n_random: Random draws per path.
        positions: The positions to zero at, counted in each prompt (negative: from its end; default
            the final one; None: every position).
        confidence: The intervals' confidence level.
        n_boot: Bootstrap resamples.
        seed: Seeds the random draws and the bootstrap.
        batch_size: Prompts per forward.

    Returns:
        The logits, correctness and shares of every arm.

    Raises:
        ConfigError: Fewer than 2 prompts, an empty path, or positions outside the prompts.
        AnalysisError: A path with fewer features outside it than in it (no random control).
        ModelMismatchError: Prompts or transcoders made for another model.
    """
    check_belongs(model, "features.path_ablation", prompts=prompts)
    if len(prompts) < 2:
        raise ConfigError(f"path_ablation needs at least 2 prompts, got {len(prompts)}")
    groups = [(prompts.unpadded(group), group) for group in prompts.length_groups()]
    return _path_ablation(model, transcoders, groups, prompts.answer_tokens[:, 0].long(), int(prompts.lengths.min()),
                          paths, n_random=n_random, positions=positions, confidence=confidence, n_boot=n_boot,
                          seed=seed, batch_size=batch_size)


@checked
def path_ablation_tokens(model: HookedModel, transcoders: Transcoders, tokens: torch.Tensor, answers: torch.Tensor,
                         paths: dict[str, dict[NonNegativeInt, IndexList]], *, n_random: PositiveInt = 5,
                         positions: Optional[IntList] = (-1,), confidence: OpenUnitFloat = 0.95,
                         n_boot: PositiveInt = 1000, seed: Seed = 0,
                         batch_size: PositiveInt = 256) -> PathAblationResult:
    """:func:`path_ablation` of token ids and answer tokens of one's own choosing: the tensor path under
    it (prompts that are not a task's, an answer token that is not the sum's).

    Args:
        model: The hooked model.
        transcoders: The transcoders.
        tokens (Int[Tensor, "prompt pos"]): The prompts, at least 2, of one length.
        answers (Int[Tensor, "prompt"]): The token whose demeaned logit is read, per prompt.
        paths: As for :func:`path_ablation`.
        n_random: As for :func:`path_ablation`.
        positions: As for :func:`path_ablation`.
        confidence: As for :func:`path_ablation`.
        n_boot: As for :func:`path_ablation`.
        seed: As for :func:`path_ablation`.
        batch_size: As for :func:`path_ablation`.

    Returns:
        The logits, correctness and shares of every arm.

    Raises:
        ConfigError: Answers that are not token ids, mismatched shapes, fewer than 2 prompts, an
            empty path, or positions outside the prompts.
        ModelMismatchError: Transcoders made for another model.
    """
    check_tokens(model, tokens)
    if answers.dtype == torch.bool or answers.is_floating_point() or answers.is_complex():
        raise ConfigError(f"answers must be integer token ids, got dtype {answers.dtype}")
    if tokens.ndim != 2 or answers.shape != (tokens.shape[0],) or tokens.shape[0] < 2:
        raise ConfigError(f"tokens must be [N ≥ 2, T] and answers [N]; got {tuple(tokens.shape)} and "
                          f"{tuple(answers.shape)}")
    V = int(model.W_U.shape[-1])
    if bool(((answers < 0) | (answers >= V)).any()):
        raise ConfigError(f"answers must be token ids in 0..{V - 1}")
    return _path_ablation(model, transcoders, [(tokens, torch.arange(len(tokens)))], answers.long(),
                          int(tokens.shape[1]), paths, n_random=n_random, positions=positions, confidence=confidence,
                          n_boot=n_boot, seed=seed, batch_size=batch_size)


def _path_ablation(model: HookedModel, transcoders: Transcoders, groups: list, answers: torch.Tensor, T: int,
                   paths: dict, *, n_random: int, positions: Optional[Sequence[int]], confidence: float, n_boot: int,
                   seed: int, batch_size: int) -> PathAblationResult:
    """The arms of :func:`path_ablation` over ``groups`` of ``(tokens [n, t], rows [n])`` (the rows
    of ``answers`` each group's prompts are), ``T`` the shortest prompt's length."""
    transcoders.check_model(model)
    order = torch.cat([rows for _, rows in groups])  # the prompts by group; results go back to their order
    back = torch.argsort(order)
    if not paths or any(_count(f) == 0 for f in paths.values()):
        raise ConfigError(f"paths must map each name to a non-empty {{layer: [features]}}; got sizes "
                            f"{ {k: _count(v) for k, v in paths.items()} }")
    paths = {name: {layer: transcoders.features_of(chosen, f"path {name!r} at layer {layer}")
                    for layer, chosen in features.items() if transcoders.index(layer) >= 0}
             for name, features in paths.items()}
    if positions is not None and (not len(positions) or any(not -T <= p < T for p in positions)):
        raise ConfigError(f"positions must be None or a non-empty list of ints in {-T}..{T - 1}, got {positions!r}")
    where = None if positions is None else [int(p) for p in positions]
    generator = torch.Generator().manual_seed(seed)

    def measure(features: Mapping[int, Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        interventions = _interventions(transcoders, features, where)
        logits, correct = [], []
        for tokens, group in groups:
            for start in range(0, len(group), batch_size):
                out = run(model, tokens[start:start + batch_size], interventions, logits="final").logits
                assert out is not None
                rows, answer = torch.arange(len(out)), answers[group[start:start + batch_size]].to(out.device)
                logits.append((out - out.mean(-1, keepdim=True))[rows, answer].double().cpu())
                correct.append((out.argmax(-1) == answer).cpu())
        return torch.cat(logits)[back], torch.cat(correct)[back]

    arms, counts, results = ["none"], [0], [measure({})]
    for name, features in paths.items():
        arms.append(f"zero {name}")
        counts.append(_count(features))
        results.append(measure(features))
    if len(paths) > 1:
        every: dict[int, list[int]] = {}
        for features in paths.values():
            for layer, chosen in features.items():
                every[layer] = sorted(set(every.get(layer, [])) | set(chosen))
        arms.append("zero all paths")
        counts.append(_count(every))
        results.append(measure(every))
    for name, features in paths.items():
        draws = []
        for _ in range(n_random):
            random: dict[int, list[int]] = {}
            for layer, chosen in features.items():
                outside = torch.tensor([f for f in range(transcoders.n_features) if f not in set(chosen)])
                if len(outside) < len(chosen):
                    raise AnalysisError(f"layer {layer} has {len(outside)} features outside path {name!r}, fewer "
                                        f"than its {len(chosen)}: no random control of the same size")
                random[layer] = outside[torch.randperm(len(outside), generator=generator)[:len(chosen)]].tolist()
            draws.append(measure(random))
        arms.append(f"random, as many as {name}")
        counts.append(_count(features))
        results.append((torch.stack([d[0] for d in draws]).mean(0), torch.stack([d[1].float() for d in draws]).mean(0)))
    logits = torch.stack([r[0] for r in results])
    correct = torch.stack([r[1].float() for r in results])
    shares = ratio_to_reference(logits, 0, confidence=confidence, n_boot=n_boot, seed=seed)
    meta = build_meta(model, paths={k: {str(layer): v for layer, v in f.items()} for k, f in paths.items()},
                      positions=where, n_random=n_random, confidence=confidence, n_boot=n_boot, seed=seed,
                      reference_distinct=shares["reference_distinct"])
    return PathAblationResult(arms=arms, logits=logits.float(), correct=correct, n_features=torch.tensor(counts),
                              share=shares["fraction"].float(), share_low=shares["fraction_low"].float(),
                              share_high=shares["fraction_high"].float(), meta=meta)
