"""Heuristic neurons: which MLP neurons implement which simple rule, and what ablating them does.

Follows Nikankin et al. 2025, "Arithmetic Without Algorithms":

1. :func:`importance` ranks the neurons of each layer by attribution patching on ``mlp_post`` at
   the final position (gradient of the logit difference × (corrupt − clean) activation; score =
   mean + std over prompts), by exact activation patching (``"patching"``: the corrupt value
   patched in) or by mean ablation (``"mean-ablation"``: :func:`arithinterp.engine.mean_activation`),
   and keeps the top-k per layer.
2. :func:`maps` reads each neuron's **K map** (activation at the final position over the operand
   grid) and **KV map** (activation × the neuron's logit-lens value for the true answer token).
3. :func:`classify_maps` scores every heuristic of a :class:`HeuristicRegistry` for every
   neuron: the fraction of the neuron's top-k grid cells that satisfy the heuristic, with k the
   number of legal cells that satisfy it. Operand heuristics are scored on K maps, result
   heuristics on KV maps. A neuron implements a heuristic when the score reaches the threshold
   (0.6) *and* beats the neuron's cell-shuffled maps at a false-discovery rate (exact
   hypergeometric p-values, Benjamini–Hochberg over neurons × heuristics, default 0.05); several
   labels are allowed. :func:`classify` runs 1–3 on a model.
4. :func:`ablate_heuristic` and :func:`ablate_for_prompt` ablate heuristic neurons and compare
   accuracy on associated prompts against non-associated prompts / a same-size random control.

The heuristics are data (:class:`Heuristic`: a name, a family, a map kind and a vectorised
predicate over the operand grid), produced per grid by the families of a
:class:`HeuristicRegistry` (by default the built-in :data:`BUILTIN_FAMILIES`) plus any single
heuristics added to that registry. The registry is an object passed to the classification;
nothing is registered process-wide.

Submodules, each importing only the ones before it:

* ``rules`` — operators (:func:`apply_op`), :class:`Heuristic`, :class:`Grid`, :class:`Family`.
* ``families`` — the built-in families (:data:`BUILTIN_FAMILIES`).
* ``registry`` — :class:`HeuristicRegistry`.
* ``heuristics`` — :func:`build_heuristics` → :class:`HeuristicSet`, the heuristics on a grid.
* ``table`` — the classification result, :class:`HeuristicTable`.
* ``map_scores`` — the pure, vectorised scoring of maps (:func:`score_maps`).
* ``shuffle_test`` — the cell-shuffle test (:func:`shuffle_p_values`, :func:`benjamini_hochberg`).
* ``scoring`` — :func:`classify_maps`: scores, test and labels into a table.
* ``final_reads`` — reading ``mlp_post`` at the final position, batch by batch, and the checks the
  neuron analyses share.
* ``neuron_importance`` — :func:`importance` → :class:`NeuronImportance`.
* ``neuron_maps`` — :func:`maps` → :class:`NeuronMaps`, the K and KV maps over the operand grid.
* ``model`` — :func:`classify`: importance, maps and scoring run on a model.
* ``ablation`` — :func:`ablate_heuristic` and :func:`ablate_for_prompt`.
"""

from arithinterp.neurons.ablation import (
    NEURON_ABLATIONS,
    HeuristicAblationResult,
    PromptAblationResult,
    ablate_for_prompt,
    ablate_heuristic,
)
from arithinterp.neurons.families import BUILTIN_FAMILIES, FAMILIES
from arithinterp.neurons.heuristics import HeuristicSet, build_heuristics
from arithinterp.neurons.registry import HeuristicRegistry
from arithinterp.neurons.rules import MAP_KINDS, OPS, Family, Grid, Heuristic, apply_op
from arithinterp.neurons.neuron_importance import IMPORTANCE_METHODS, NeuronImportance, importance
from arithinterp.neurons.neuron_maps import NeuronMaps, maps
from arithinterp.neurons.model import classify
from arithinterp.neurons.map_scores import score_maps
from arithinterp.neurons.scoring import classify_maps
from arithinterp.neurons.shuffle_test import benjamini_hochberg, shuffle_p_values
from arithinterp.neurons.table import HeuristicTable

__all__ = [
    "OPS",
    "MAP_KINDS",
    "Heuristic",
    "Family",
    "FAMILIES",
    "BUILTIN_FAMILIES",
    "HeuristicRegistry",
    "shuffle_p_values",
    "benjamini_hochberg",
    "apply_op",
    "build_heuristics",
    "HeuristicSet",
    "score_maps",
    "classify_maps",
    "classify",
    "importance",
    "maps",
    "ablate_heuristic",
    "ablate_for_prompt",
    "HeuristicTable",
    "NeuronImportance",
    "NeuronMaps",
    "HeuristicAblationResult",
    "PromptAblationResult",
    "Grid",
    "NEURON_ABLATIONS",
    "IMPORTANCE_METHODS",
]
