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
* ``sweep`` — :func:`das_sweep` (layers × positions) → :class:`DASSweep`;
  :func:`readable_vs_used` → :class:`ReadableUsed`.
* ``subspace_files`` — a fit's subspace as a pyvene ``LowRankRotatedSpaceIntervention`` save
  (:func:`write_pyvene`, one intervention per position for a per-position fit, the site mapping
  beside it) and back (:func:`read_pyvene`); :func:`score_subspace` scores a given subspace.
"""

from arithinterp.causal.datasets import InterchangeDataset, interchange_dataset
from arithinterp.causal.fit import BASELINES, METHODS, baseline_subspaces, das, probe_span
from arithinterp.causal.interventions import (
    BoundlessSubspace, FixedSubspace, Interchange, PerPosition, RotatedSubspace, full_vector, orthonormal,
    principal_angle_cosines, random_subspace,
)
from arithinterp.causal.models import (
    CausalModel, Variable, addition, for_prompts, modular_addition, single_token_addition, variables_of,
)
from arithinterp.causal.results import DASResult, DASSweep, ReadableUsed
from arithinterp.causal.scoring import Site, wilson
from arithinterp.causal.subspace_files import read_pyvene, score_subspace, write_pyvene
from arithinterp.causal.sweep import das_sweep, readable_vs_used

__all__ = [
    "BASELINES", "METHODS", "BoundlessSubspace", "CausalModel", "DASResult", "DASSweep", "FixedSubspace",
    "Interchange", "InterchangeDataset", "PerPosition", "ReadableUsed", "RotatedSubspace", "Site", "Variable",
    "addition", "baseline_subspaces", "das", "das_sweep", "for_prompts", "full_vector", "interchange_dataset",
    "modular_addition", "orthonormal", "principal_angle_cosines", "probe_span", "random_subspace",
    "read_pyvene", "readable_vs_used", "score_subspace", "single_token_addition", "variables_of", "wilson",
    "write_pyvene",
]
