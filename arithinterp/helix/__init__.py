"""Helix fits of number representations and their causal test (Kantamneni & Tegmark 2025).

A number ``x`` is represented on a *generalised helix* when activations are (close to) a linear
map of

    ``[cos(2πx/T), sin(2πx/T) for T in periods] + [x / max_x] + [1]``

Submodules, one concept each, each importing only the ones before it:

* :mod:`~arithinterp.helix.design` — :func:`basis`, that basis for any periods (integers or not,
  e.g. ``113/14``), with the baselines ``"circle"`` (no linear term), ``"poly"``
  (``x, x², …``) and ``"linear"``; several variables (``a, b, a+b``) concatenate their bases
  around one constant. :func:`helix_basis`, and the pure-tensor pieces of a fit: least squares,
  R², :func:`split_by_value`, PCA.
* :mod:`~arithinterp.helix.fitting` — :func:`fit`, the recipe of Kantamneni & Tegmark 2025: PCA to ``n_pca``
  components, least squares from the basis to PCA coordinates (no intercept: the basis has the
  constant), mapped back (``C = coef @ components + mean``); held-out R² over *values* not
  prompts → :class:`HelixFit`. :func:`fit_layers` — fit quality per layer (helix vs baselines)
  → :class:`FitLayersResult`.
* :mod:`~arithinterp.helix.causal` — :func:`patch_test`, the causal test: patch the fitted helix
  at the corrupted value into the clean run and compare with the layer patch, a PCA
  reconstruction of equal dimension and a helix fitted to shuffled values
  (:func:`shuffled_control`) → :class:`HelixPatchResult`; its forward passes are ``causal.capture`` and
  ``causal.patched_logit``.
* :mod:`~arithinterp.helix.period_search` — :func:`search_periods`, the best period subset of
  each size, by causal effect or held-out R² → :class:`PeriodSearchResult`.
* :mod:`~arithinterp.helix.neuron_model` — :func:`fit_neurons` / :func:`neuron_fits`, the neuron
  preactivation model of Kantamneni & Tegmark 2025 fitted by gradient descent on the MSE, quality as NRMSE →
  :class:`NeuronFitResult`.

Every public name is available here, e.g. ``helix.fit(...)``, ``helix.patch_test(...)``.
"""

from arithinterp.helix.causal import HelixPatchResult, patch_test, shuffled_control
from arithinterp.helix.design import DEFAULT_PERIODS, BASIS_KINDS, basis, helix_basis, split_by_value
from arithinterp.helix.fitting import FitLayersResult, HelixFit, Values, fit, fit_layers
from arithinterp.helix.neuron_model import (
    NEURON_METHODS,
    NEURON_VARIABLES,
    NeuronFitResult,
    fit_neurons,
    neuron_fits,
)
from arithinterp.helix.period_search import PeriodSearchResult, search_periods

__all__ = [
    # design
    "basis",
    "helix_basis",
    "split_by_value",
    "BASIS_KINDS",
    "DEFAULT_PERIODS",
    # fitting
    "Values",
    "HelixFit",
    "fit",
    "FitLayersResult",
    "fit_layers",
    # causal
    "HelixPatchResult",
    "shuffled_control",
    "patch_test",
    # period_search
    "PeriodSearchResult",
    "search_periods",
    # neuron_model
    "NEURON_METHODS",
    "NEURON_VARIABLES",
    "NeuronFitResult",
    "fit_neurons",
    "neuron_fits",
]
