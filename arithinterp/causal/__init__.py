"""Causal variables: distributed alignment search over causal models of arithmetic.

Probes say a variable is linearly readable; patching says where an operand matters. Distributed
alignment search (DAS; Geiger et al. 2024, Boundless DAS: Wu et al. 2023) says where the model
*represents and uses* a variable of an algorithm: it learns a low-dimensional subspace whose
interchange between two prompts makes the model answer what the causal model predicts.

* ``models`` — causal models as data (:class:`CausalModel`, :class:`Variable`): :func:`addition`,
  :func:`single_token_addition`, :func:`modular_addition`, or your own.
* ``datasets`` — :func:`interchange_dataset`: balanced base/source pairs with counterfactual
  answers, held out by operand pair, with a shuffled-variable control.
* ``interventions`` — DAS (:class:`RotatedSubspace`), Boundless DAS (:class:`BoundlessSubspace`),
  fixed baselines (full vector, probe span, PCA, random rotation) and one subspace per position
  (:class:`PerPosition`).
* ``scoring`` — interchange runs through the engine; IIA and its logit-difference version.
* ``fit`` — :func:`das` (one site) → :class:`DASResult`.
* ``layers`` — :func:`das_layers` (every layer × position) → :class:`DASLayersResult`;
  :func:`readable_vs_used` → :class:`ReadableUsedResult`.
* ``subspace_files`` — a fit's subspace as a pyvene ``LowRankRotatedSpaceIntervention`` save
  (:func:`write_pyvene`, one intervention per position for a per-position fit, the site mapping
  beside it) and back (:func:`read_pyvene`); :func:`score_subspace` scores a given subspace.
"""

from arithinterp.causal.datasets import InterchangeDataset, interchange_dataset
from arithinterp.causal.fit import BASELINES, METHODS, converged, das, probe_span
from arithinterp.causal.interventions import (
    BoundlessSubspace, FixedSubspace, Intervention, PerPosition, RotatedSubspace, full_vector, orthonormal,
    principal_angle_cosines, random_subspace,
)
from arithinterp.causal.models import (
    CausalModel, Variable, addition, for_prompts, modular_addition, single_token_addition, variables_of,
)
from arithinterp.causal.layers import das_layers, readable_vs_used
from arithinterp.causal.results import DASLayersResult, DASResult, ReadableUsedResult
from arithinterp.causal.scoring import Site, wilson
from arithinterp.causal.subspace_files import read_pyvene, score_subspace, write_pyvene

__all__ = [
    "BASELINES", "METHODS", "BoundlessSubspace", "CausalModel", "DASLayersResult", "DASResult", "FixedSubspace",
    "InterchangeDataset", "Intervention", "PerPosition", "ReadableUsedResult", "RotatedSubspace", "Site", "Variable",
    "addition", "converged", "das", "das_layers", "for_prompts", "full_vector", "interchange_dataset",
    "modular_addition", "orthonormal", "principal_angle_cosines", "probe_span", "random_subspace",
    "read_pyvene", "readable_vs_used", "score_subspace", "single_token_addition", "variables_of", "wilson",
    "write_pyvene",
]
