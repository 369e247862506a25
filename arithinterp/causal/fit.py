"""Fitting interchange interventions: DAS, Boundless DAS and the baselines, scored alike.

:func:`das` learns the rotation by gradient descent on the cross-entropy of the counterfactual
answer through patched runs of the frozen model (Geiger et al. 2024; Wu et al. 2023 for the
boundless variant). The engine applies the interchange; only the rotation's parameters get
gradients (``torch.autograd.grad``), so the model's weights and ``.grad`` are never touched.
:func:`baselines` scores fixed subspaces at the same site on the same held-out pairs: the full
vector, the span of a linear probe for the variable, the top-k principal components, and a
random rotation of the same ``k``.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from arithinterp.causal.datasets import InterchangeDataset
from arithinterp.causal.interventions import (
    BoundlessSubspace, FixedSubspace, Interchange, RotatedSubspace, anneal, full_vector, orthonormal, random_subspace,
)
from arithinterp.causal.results import DASResult
from arithinterp.causal.scoring import (
    Position, Site, base_values, batch_size, batches, evaluate, forward, source_values,
)
from arithinterp.errors import AnalysisError
from arithinterp.results import build_meta
from arithinterp.types import HookedModel

METHODS = ("das", "boundless")
BASELINES = ("full", "probe", "pca", "random")


def _check(dataset: InterchangeDataset, steps: int, lr: float) -> None:
    if not isinstance(dataset, InterchangeDataset):
        raise AnalysisError(f"dataset must be an InterchangeDataset (interchange_dataset(...)), got "
                            f"{type(dataset).__name__}")
    if len(dataset.train) < 2 or len(dataset.test) < 1:
        raise AnalysisError(f"the dataset has {len(dataset.train)} training and {len(dataset.test)} held-out pairs; "
                            "DAS needs at least 2 and 1: use more prompts")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise AnalysisError(f"steps must be a positive int, got {steps!r}")
    if not lr > 0:
        raise AnalysisError(f"lr must be positive, got {lr!r}")


def train(model: HookedModel, dataset: InterchangeDataset, where: Site, intervention: Interchange,
          sources: torch.Tensor, *, steps: int, lr: float, size: int, seed: int, progress: bool,
          boundary_penalty: float = 5e-2, boundary_lr: float = 0.1) -> list[float]:
    """Adam on the counterfactual cross-entropy over training pairs; returns the loss per step.

    Boundless DAS adds ``boundary_penalty`` × the boundary to the loss and moves the boundary with its
    own learning rate (Adam moves it about ``boundary_lr`` dimensions a step), so it can shrink to
    the smallest subspace that still carries the variable within the steps given."""
    params = [p for p in intervention.parameters() if p.requires_grad]
    boundary = [p for n, p in intervention.named_parameters() if n == "boundary"]
    rest = [p for n, p in intervention.named_parameters() if n != "boundary" and p.requires_grad]
    groups = [dict(params=rest, lr=lr)] + ([dict(params=boundary, lr=boundary_lr)] if boundary else [])
    optimiser = torch.optim.Adam(groups)
    rng = random.Random(seed)
    train_rows = dataset.train.tolist()
    history = []
    device = next(iter(model.parameters())).device
    intervention.to(device)
    for step in tqdm(range(steps), desc=f"DAS {where.site} L{where.layer} @{where.position}", disable=not progress):
        if isinstance(intervention, BoundlessSubspace):
            intervention.temperature = anneal(step, steps)
        rows = torch.tensor(rng.sample(train_rows, min(size, len(train_rows))))
        loss = torch.zeros((), device=device)
        count = 0
        for batch in batches(dataset, rows, where.position, size):
            logits = forward(model, batch, where, intervention, sources, train=True)
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.to(device).flatten(),
                                                   reduction="sum")
            loss = loss + ce / batch.targets.shape[1]
            count += len(batch.rows)
        loss = loss / count
        if isinstance(intervention, BoundlessSubspace):  # favour the smallest subspace that works
            loss = loss + boundary_penalty * intervention.boundary.clamp_min(0)
        grads = torch.autograd.grad(loss, params)
        for p, g in zip(params, grads):
            p.grad = g
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        history.append(float(loss.detach()))
    return history


def das(
    model: HookedModel,
    dataset: InterchangeDataset,
    site: str = "resid_post",
    layer: int = 0,
    position: Position = "final",
    k: int = 2,
    *,
    method: str = "das",
    steps: int = 200,
    lr: float = 1e-2,
    baselines: Sequence[str] = BASELINES,
    max_memory: Optional[float] = None,
    seed: int = 0,
    progress: bool = True,
) -> DASResult:
    """Distributed alignment search for ``dataset.variable`` at one site, layer and position.

    Args:
        position: a position, or a list of them swapped together through one subspace.
        k: dimensions interchanged (DAS); for ``method="boundless"`` the boundary is learned and
            ``k`` is only the size of the random-rotation baseline (the learned one is reported).
        steps: Adam steps on batches of training pairs (the batch size comes from
            ``max_memory`` bytes, default the engine's budget).
        lr: Adam's learning rate.
        baselines: which of ``"full"``, ``"probe"``, ``"pca"``, ``"random"`` to score beside it.

    Returns a :class:`DASResult`: held-out IIA with its 95% interval and logit difference for DAS
    and each baseline, the chance level, the learned basis ``[d, k]`` and the loss history.
    """
    _check(dataset, steps, lr)
    if method not in METHODS:
        raise AnalysisError(f"unknown method {method!r}; accepted: {', '.join(METHODS)}")
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise AnalysisError(f"unknown baselines {unknown}; accepted: {', '.join(BASELINES)}")
    where = Site(site, layer, position)
    d = where.check(model)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d:
        raise AnalysisError(f"k must be an int in 1..{d} (the width of {site}), got {k!r}")
    size_eval = batch_size(model, dataset, training=False, max_memory=max_memory)
    size_train = batch_size(model, dataset, training=True, max_memory=max_memory)
    sources = source_values(model, dataset, where, size_eval)
    torch.manual_seed(seed)
    intervention: Interchange = RotatedSubspace(d, k, seed) if method == "das" else BoundlessSubspace(d, seed)
    history = train(model, dataset, where, intervention, sources, steps=steps, lr=lr, size=min(size_train, 256),
                    seed=seed, progress=progress)
    if isinstance(intervention, BoundlessSubspace):
        intervention = intervention.hard()
    scores = {method: evaluate(model, dataset, where, intervention, sources, dataset.test, size_eval)}
    scores[method]["k"] = intervention.k
    train_scores = evaluate(model, dataset, where, intervention, sources, dataset.train, size_eval)
    scores["none"] = evaluate(model, dataset, where, None, sources, dataset.test, size_eval)
    scores["none"]["k"] = 0
    for name, fixed in baseline_subspaces(model, dataset, where, k, baselines, size_eval, seed).items():
        scores[name] = evaluate(model, dataset, where, fixed, sources, dataset.test, size_eval)
        scores[name]["k"] = fixed.k
    basis = intervention.basis().detach().float().cpu()
    meta = build_meta(model, variable=dataset.variable, causal_model=dataset.causal_model.name,
                      shuffled=dataset.shuffled, steps=steps, lr=lr, seed=seed, pairs=dataset.meta,
                      n_train=len(dataset.train), n_test=len(dataset.test))
    return DASResult(
        variable=dataset.variable, site=site, layer=layer,
        position=str(position) if isinstance(position, (str, int)) else "+".join(map(str, position)), method=method,
        k=intervention.k, iia=scores[method]["iia"], train_iia=train_scores["iia"], chance=dataset.chance,
        scores=scores, basis=basis, history=history, meta=meta,
    )


def baseline_subspaces(model: HookedModel, dataset: InterchangeDataset, where: Site, k: int,
                       which: Sequence[str], size: int, seed: int = 0) -> dict[str, FixedSubspace]:
    """The fixed subspaces at ``where``: full vector, probe span, PCA top-``k``, random ``k``; the probe and
    the PCA are fitted on the training pairs' base activations only."""
    d = where.check(model)
    out: dict[str, FixedSubspace] = {}
    if "full" in which:
        out["full"] = full_vector(d)
    if "probe" in which or "pca" in which:
        acts = base_values(model, dataset, where, size, dataset.train)
        labels = dataset.base_value[dataset.train]
        if acts.ndim == 3:  # several positions share the subspace: fit on all of them
            labels = labels.repeat_interleave(acts.shape[1])
            acts = acts.flatten(0, 1)
        if "probe" in which:
            out["probe"] = FixedSubspace(probe_span(acts, labels, seed))
        if "pca" in which:
            centred = acts - acts.mean(0)
            _, _, vt = torch.linalg.svd(centred.double(), full_matrices=False)
            out["pca"] = FixedSubspace(vt[: min(k, vt.shape[0])].T.float().contiguous())
    if "random" in which:
        out["random"] = random_subspace(d, k, seed + 1)
    return out


def probe_span(acts: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """An orthonormal basis ``[d, r]`` of the directions of a logistic probe for ``labels`` fitted on ``acts``."""
    from arithinterp.probes import LogisticProbe

    if len(torch.unique(labels)) < 2:
        raise AnalysisError("the variable takes one value on the training pairs; a probe for it has no direction")
    probe = LogisticProbe().fit(acts, labels)
    return orthonormal(torch.as_tensor(probe.coef_, dtype=torch.float32))
