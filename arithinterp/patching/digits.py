"""Which head computes which answer digit: per-head, per-digit ablation (Quirke & Barez 2024)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from tqdm.auto import tqdm

from arithinterp.checks import check_belongs
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.patching.components import ablated_scores, parse_components, token_scores
from arithinterp.patching.core import COMPONENT_ABLATION_MODES, check_choice
from arithinterp.results import Result, build_meta
from arithinterp.types import HookedModel

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet


@dataclass(frozen=True)
class DigitAblationResult(Result):
    """Accuracy of each answer token with one head ablated at the position that predicts it.

    ``accuracy [n_heads, n_answer_tokens]``: the fraction of prompts whose answer token k is still
    the argmax (teacher-forced) when head ``heads[i]`` is ablated at position ``answer{k}`` alone;
    ``baseline [n_answer_tokens]`` the same with nothing ablated. Causal attention keeps the
    earlier tokens as they were, so ``baseline − accuracy`` is the head's share at that step.
    """

    heads: list
    accuracy: torch.Tensor
    baseline: torch.Tensor
    mode: str
    meta: dict

    @property
    def drop(self) -> torch.Tensor:
        """``baseline − accuracy``, ``[n_heads, n_answer_tokens]``."""
        return self.baseline[None] - self.accuracy

    def to_frame(self):
        """One row per (head, answer token): accuracy with the head ablated, baseline, drop."""
        import pandas as pd

        rows = [
            dict(
                head=head,
                answer_token=k,
                accuracy=float(self.accuracy[i, k]),
                baseline=float(self.baseline[k]),
                drop=float(self.drop[i, k]),
            )
            for i, head in enumerate(self.heads)
            for k in range(self.accuracy.shape[1])
        ]
        frame = pd.DataFrame(rows)
        frame["mode"], frame["n_prompts"] = self.mode, self.meta.get("n_prompts")
        return frame

    def plot(self, **kwargs):
        """Heads × answer tokens heatmap of the accuracy drop (see viz.patching)."""
        from arithinterp.viz.patching import plot_digit_ablation

        return plot_digit_ablation(self, **kwargs)


def digit_ablation(
    model: HookedModel, prompts: PromptSet, heads: Optional[Sequence[str]] = None, mode: str = "mean", seed: int = 0, *,
    progress: bool = True,
) -> DigitAblationResult:
    """Ablate each head at each answer position alone and score that answer token (Quirke & Barez 2024,
    "Understanding Addition in Transformers").

    Quirke & Barez read a digit-addition model's heads as a staircase: each answer digit is
    computed one token before it is emitted, by heads that attend to the matching operand digits.
    This measures it: for every head and every answer token k, the head is ablated (``mode``:
    ``"mean"``, ``"zero"`` or ``"resample"``) at the position that predicts token k, the answer
    is teacher-forced, and token k's accuracy is read.

    Args:
        prompts: a PromptSet with multi-token answers (e.g. ``zoo:add-3digit``'s); its scoring is
            set to ``"full_answer"`` here.
        heads: ``"L{layer}H{head}"`` names (default: every head).
    """
    check_belongs(model, "patching.digit_ablation", prompts=prompts)
    check_choice("mode", mode, COMPONENT_ABLATION_MODES)
    if len(prompts) == 0:
        raise AnalysisError("the prompt set is empty; nothing to ablate")
    n_answer = prompts.answer_tokens.shape[1]
    if n_answer < 2:
        raise AnalysisError(
            "the answers are single tokens; per-digit ablation needs multi-token answers (e.g. zoo:add-3digit)"
        )
    cfg = model.cfg
    names = (
        [f"L{layer}H{head}" for layer in range(cfg.n_layers) for head in range(cfg.n_heads)] if heads is None else heads
    )
    parsed = parse_components(model, names, ("head",))
    if any(c.position is not None for c in parsed):
        raise ConfigError("heads are ablated at each answer position in turn; name them without '@position'")
    prompts = prompts.with_scoring("full_answer")
    score, means = token_scores(prompts), {}  # each layer's mean head output is computed once

    def correct(components) -> torch.Tensor:  # [n_prompts, n_answer] whether each token is the argmax
        return ablated_scores(model, prompts, components, mode, seed, keep=False, score=score, means=means)[..., 0]

    baseline = correct([]).mean(0)
    accuracy = torch.empty(len(parsed), n_answer)
    cells = [(i, k) for i in range(len(parsed)) for k in range(n_answer)]
    for i, k in tqdm(cells, desc="digit ablation", disable=not progress):
        accuracy[i, k] = correct([replace(parsed[i], position=f"answer{k}")])[:, k].mean()
    return DigitAblationResult(
        heads=[c.name for c in parsed], accuracy=accuracy, baseline=baseline, mode=mode,
        meta=build_meta(model, n_prompts=len(prompts), seed=seed),
    )
