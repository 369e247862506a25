"""Activation patching: exact sweeps, attribution patching, direct vs total effect, ablation.

* :func:`activation_patching` — exact activation patching of one site over layers × positions (× heads or
  neurons), with per-pair values, mean, standard error and a bootstrap interval
  (Kantamneni & Tegmark 2025; Nikankin et al. 2025; Stolfo et al. 2023).
* :func:`attribute` — attribution patching, ``grad · (source − base)``, or its integrated-gradients
  variant, for every cell of a site in a few forwards and one backward per batch; returns the same
  :class:`PatchResult` as :func:`activation_patching`. :func:`attribute_sites` does several sites
  from the same passes (an :class:`AttributionResult`). :func:`compare` reports how well it tracks
  the exact sweep.
* :func:`direct_effect` — direct effect of components (their corrupt − clean output added straight
  into the final residual stream) next to their total effect (Kantamneni & Tegmark 2025).
* :func:`ablate` and :func:`component_faithfulness` — zero / mean / resample ablation of heads and
  MLPs, and the faithfulness of a circuit of components (nodes) with everything outside it
  mean-ablated (Nikankin et al. 2025); edge-level circuits are :mod:`arithinterp.circuits`.
* :func:`digit_ablation` — each head ablated at each answer position alone, each answer digit
  scored teacher-forced: which head computes which digit (Quirke & Barez 2024); :func:`digit_pairs`
  teacher-forces pairs so any final-position analysis scores one answer digit, and :func:`vary_digit`
  builds pairs that change one digit column of the operands.

Conventions (those of TransformerLens's ``patching`` module): ``direction="denoise"`` runs the
corrupt prompt and patches in the clean activation; ``"noise"`` runs the clean prompt and patches
in the corrupt one. The *base* run is the one that is patched, the *source* run the one the patch
comes from. Metrics are read at the final prompt position, or with ``scoring="full-answer"`` over
every answer token, teacher-forced (``logit_diff`` = log P(clean answer) − log P(corrupt answer)).

Speed. Exact sweeps stack many patch cells along the batch dimension and run them through the
engine (:mod:`arithinterp.engine`), which resumes the model's own blocks at the patched layer and,
where the blocks take a key/value cache (every Hugging Face decoder family), at the earliest
patched position with earlier keys and values reused from the base run. Each model is checked once
against its own logits; where stepping does not reproduce them the sweep says so and runs whole
forwards, still many cells per forward. The other analyses run through the engine too (reads and
interventions as data, gradients at reads for attribution, :func:`~arithinterp.engine.mean_activation`
the one mean-ablation value). Half-precision models run in their dtype; metrics and results are
float32.
"""

from arithinterp.patching.attribution import (
    ComparisonResult,
    attribute,
    attribute_sites,
    attribution_vs_exact,
    compare,
)
from arithinterp.patching.attribution_result import AttributionResult
from arithinterp.patching.component_ablation import AblationResult, ablate
from arithinterp.patching.components import COMPONENT_FORMS, default_components
from arithinterp.patching.effects import EffectResult, direct_effect
from arithinterp.patching.faithfulness import FAITHFULNESS_METRICS, ComponentFaithfulnessResult, component_faithfulness
from arithinterp.metrics import DIRECTIONS, METRICS
from arithinterp.engine.steppers import ENGINES
from arithinterp.patching.core import (
    COMPONENT_ABLATIONS,
    ATTRIBUTE_SITES,
    ATTRIBUTION_METHODS,
    PATCHING_SITES,
    PatchResult,
    summarize,
)
from arithinterp.patching.digits import FEEDS as DIGIT_FEEDS
from arithinterp.patching.digits import DigitAblationResult, digit_ablation, digit_pairs, vary_digit
from arithinterp.patching.exact import activation_patching

__all__ = [
    "activation_patching",
    "attribute",
    "attribute_sites",
    "compare",
    "attribution_vs_exact",
    "direct_effect",
    "default_components",
    "ablate",
    "component_faithfulness",
    "digit_ablation",
    "digit_pairs",
    "vary_digit",
    "summarize",
    "PatchResult",
    "AttributionResult",
    "ComparisonResult",
    "EffectResult",
    "AblationResult",
    "ComponentFaithfulnessResult",
    "DigitAblationResult",
    "PATCHING_SITES",
    "ATTRIBUTE_SITES",
    "METRICS",
    "DIRECTIONS",
    "ENGINES",
    "ATTRIBUTION_METHODS",
    "COMPONENT_ABLATIONS",
    "COMPONENT_FORMS",
    "FAITHFULNESS_METRICS",
    "DIGIT_FEEDS",
]
