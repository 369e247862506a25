"""Circuit faithfulness on components (:func:`component_faithfulness` → :class:`ComponentFaithfulnessResult`):
how much of the model's own answer a set of components keeps when everything else is ablated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from arithinterp import metrics as metric_lib
from arithinterp.checks import check_belongs, check_choice
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError
from arithinterp.metrics import ANSWER_METRICS
from arithinterp.patching.component_ablation import ablated_scores
from arithinterp.patching.components import parse_components
from arithinterp.patching.core import COMPONENT_ABLATIONS
from arithinterp.results import PROBABILITY, Result, build_meta
from arithinterp.types import HookedModel, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

@dataclass(frozen=True)
class ComponentFaithfulnessResult(Result):
    """Faithfulness of a circuit of components: ``(m(circuit) − m(empty)) / (m(full) − m(empty))``.

    ``m`` is the mean metric over prompts with everything outside the circuit mean-ablated
    (``circuit``), nothing ablated (``full``) or every head and MLP ablated (``empty``). ``components``
    are the circuit's heads and MLPs; the fields are named as those of
    :class:`arithinterp.circuits.EdgeFaithfulnessResult`.
    """

    components: list
    faithfulness: float
    metric_full: float
    metric_circuit: float
    metric_empty: float
    accuracy_full: float
    accuracy_circuit: float
    accuracy_empty: float
    metric: str
    ablation: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _legal = {"ablation": COMPONENT_ABLATIONS, "accuracy_full": PROBABILITY, "accuracy_circuit": PROBABILITY,
              "accuracy_empty": PROBABILITY}

    def to_frame(self):
        """One row per run (full model, circuit, empty): its score, and the faithfulness.

        Returns:
            A pandas DataFrame.
        """
        import pandas as pd

        return pd.DataFrame(
            dict(
                run=["full model", "circuit only", "everything ablated"],
                metric=[self.metric_full, self.metric_circuit, self.metric_empty],
                accuracy=[self.accuracy_full, self.accuracy_circuit, self.accuracy_empty],
                faithfulness=[self.faithfulness] * 3,
            )
        )

    def plot(self, **kwargs):
        """The scores of the full model, the circuit and the empty circuit (see ``viz.patching``).

        Args:
            **kwargs: Passed to :func:`arithinterp.viz.patching.plot_component_faithfulness`.

        Returns:
            A plotly Figure.
        """
        return draw(self, **kwargs)


FAITHFULNESS_METRICS = ANSWER_METRICS  # a prompt's own answer: no counterfactual to compare with


@checked
def component_faithfulness(model: HookedModel, prompts: PromptSet, components: Sequence[str], metric: str = "logit",
                           *, ablation: str = "mean", seed: int = 0) -> ComponentFaithfulnessResult:
    """Faithfulness of the circuit ``components`` make (nodes: heads and MLPs; Nikankin et al. 2025,
    "Arithmetic Without Algorithms"). The faithfulness of an edge-level circuit is
    :func:`arithinterp.circuits.edge_faithfulness` (over sizes, :func:`arithinterp.circuits.faithfulness_curve`).

    Every attention head and MLP outside ``components`` is mean-ablated (``ablation``: also ``"zero"``,
    ``"resample"``) and the metric on the correct answer's
    first token compared with the full model and with everything ablated:
    ``(m(circuit) − m(empty)) / (m(full) − m(empty))`` — 1 is fully faithful, 0 no better than the
    ablation baseline.

    Args:
        model: The hooked model.
        prompts: The prompts scored (on their answer's first token).
        components: The circuit's components, named as in :func:`~arithinterp.patching.ablate` (``"L2H1"``,
            ``"attn0"`` = every head of layer 0, ``"mlp1"``, optionally ``"@position"`` to keep a
            component at one position only).
        metric: one of :data:`arithinterp.metrics.ANSWER_METRICS`: ``"logit"`` (default,
            *(choice)*), ``"logprob"``, ``"prob"`` or ``"accuracy"``.
        ablation: ``"mean"``, ``"zero"`` or ``"resample"``.
        seed: The resampling's seed.

    Returns:
        The full, circuit-only and empty scores and the faithfulness.

    Raises:
        AnalysisError: the prompt set is empty.
        ConfigError: an unknown metric or ablation, or a component that is not allowed.
    """
    check_belongs(model, "patching.component_faithfulness", prompts=prompts)
    check_choice("metric", metric, FAITHFULNESS_METRICS)
    check_choice("ablation", ablation, COMPONENT_ABLATIONS)
    if len(prompts) == 0:
        raise AnalysisError("the prompt set is empty; nothing to measure")
    parsed = parse_components(model, list(components), ("attn", "mlp", "head"), prompts) if len(components) else []
    prompts = prompts.with_scoring("first-token")

    def score(logits, rows):  # [B, 1, V] -> the metric and whether the answer is the argmax, [B, 2]
        logits, answer = logits[:, -1], prompts.answer_tokens[rows, 0].to(logits.device)
        values = {
            "logit": lambda: metric_lib.logit(logits, answer),
            "logprob": lambda: metric_lib.logprob(logits, answer),
            "prob": lambda: metric_lib.prob(logits, answer),
            "accuracy": lambda: (logits.argmax(-1) == answer).float(),
        }[metric]()
        return torch.stack([values.float(), (logits.argmax(-1) == answer).float()], dim=1)

    means: dict = {}  # the circuit and the empty run ablate the same activations: their means are taken once

    def mean_score(components, keep):
        scores = ablated_scores(model, prompts, components, ablation, seed, keep=keep, score=score, means=means)
        return scores.mean(0).tolist()

    # nothing ablated; everything outside the circuit; everything
    (m_full, a_full), (m_circ, a_circ), (m_empty, a_empty) = (
        mean_score([], False), mean_score(parsed, True), mean_score([], True)
    )
    if abs(m_full - m_empty) < 1e-12:
        raise AnalysisError("the full model and the fully ablated model score the same; faithfulness is undefined")
    return ComponentFaithfulnessResult(
        components=[c.name for c in parsed],
        faithfulness=(m_circ - m_empty) / (m_full - m_empty),
        metric_full=m_full,
        metric_circuit=m_circ,
        metric_empty=m_empty,
        accuracy_full=a_full,
        accuracy_circuit=a_circ,
        accuracy_empty=a_empty,
        metric=metric,
        ablation=ablation,
        meta=build_meta(model, n_prompts=len(prompts), seed=seed),
    )
