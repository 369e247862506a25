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
from typing import Literal, Optional, Sequence

import torch

from arithinterp.causal.datasets import InterchangeDataset
from arithinterp.causal.interventions import (
    BoundlessSubspace, FixedSubspace, Intervention, PerPosition, RotatedSubspace, anneal, full_vector, orthonormal,
    random_subspace,
)
from arithinterp.causal.results import DASResult
from arithinterp.causal.scoring import (
    Position, Runs, Site, base_values, batch_size, batches, evaluate, forward, pairs_per_step, reachable,
)
from arithinterp.checks import check_belongs
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.progress import progress_bar
from arithinterp.results import build_meta
from arithinterp.types import (
    ByteSize, HookedModel, NonNegativeInt, PositiveFloat32, PositiveInt, PositiveProbability, Seed, checked,
)

METHODS = ("das", "boundless")
BASELINES = ("full", "probe", "pca", "random")


def _check(dataset: InterchangeDataset) -> None:
    if len(dataset.train) < 2 or len(dataset.test) < 1:
        raise AnalysisError(f"the dataset has {len(dataset.train)} training and {len(dataset.test)} held-out pairs; "
                            "DAS needs at least 2 and 1: use more prompts")


def train(model: HookedModel, dataset: InterchangeDataset, where: Site, intervention: Intervention,
          sources: torch.Tensor, *, steps: int, lr: float, size: int, seed: int, progress: bool,
          boundary_penalty: float = 5e-2, boundary_lr: float = 0.1,
          rows: Optional[torch.Tensor] = None, runs: Optional[Runs] = None) -> list[float]:
    """Adam on the counterfactual cross-entropy over training pairs; returns the loss per step.

    Boundless DAS adds ``boundary_penalty`` × the boundary to the loss and moves the boundary with its
    own learning rate (Adam moves it about ``boundary_lr`` dimensions a step), so it can shrink to
    the smallest subspace that still carries the variable within the steps given. ``rows``: the
    training pairs to draw from (default ``dataset.train``). ``runs``: the fit's resumed runs
    (:class:`~arithinterp.causal.scoring.Runs`; default whole forwards)."""
    params = [p for p in intervention.parameters() if p.requires_grad]
    boundary = [p for n, p in intervention.named_parameters() if n == "boundary"]
    rest = [p for n, p in intervention.named_parameters() if n != "boundary" and p.requires_grad]
    groups = [dict(params=rest, lr=lr)] + ([dict(params=boundary, lr=boundary_lr)] if boundary else [])
    optimiser = torch.optim.Adam(groups)
    rng = random.Random(seed)
    train_rows = (dataset.train if rows is None else rows).tolist()
    if len(train_rows) < 2:
        raise AnalysisError(f"{len(train_rows)} training pairs left to fit on; DAS needs at least 2: use more pairs")
    history = []
    device = next(iter(model.parameters())).device
    intervention.to(device)
    desc = f"DAS {where.site} L{where.layer} @{where.position}"
    for step in progress_bar(range(steps), desc=desc, disable=not progress):
        if isinstance(intervention, BoundlessSubspace):
            intervention.temperature = anneal(step, steps)
        rows = torch.tensor(rng.sample(train_rows, min(size, len(train_rows))))
        loss = torch.zeros((), device=device)
        count = 0
        for batch in batches(dataset, rows, where.position, size):
            logits = forward(model, batch, where, intervention, sources, train=True, runs=runs)
            logits.register_hook(_flush_subnormal)
            ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch.targets.to(device).flatten(),
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


def _flush_subnormal(grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the loss in the logits with its subnormal entries set to zero.

    The softmax of a large vocabulary puts probabilities below the smallest normal float32 on many
    tokens, and arithmetic on subnormal numbers is many times slower on CPUs (the backward product
    through a 262,144-token unembedding, 64 rows of random logits: ten times). Dropping values below
    1.2e-38 changes no sum they enter (each term is below the float32 resolution of the rest)."""
    return grad.masked_fill(grad.abs() < torch.finfo(grad.dtype).tiny, 0.0)


@checked
def das(
    model: HookedModel,
    pairs: InterchangeDataset,
    site: str = "resid_post",
    layer: NonNegativeInt = 0,
    k: PositiveInt = 2,
    *,
    positions: Position = "final",
    method: Literal["das", "boundless"] = "das",
    steps: PositiveInt = 200,
    lr: PositiveFloat32 = 1e-2,
    baselines: Sequence[Literal["full", "probe", "pca", "random"]] = BASELINES,
    reachable_only: bool = False,
    head: Optional[NonNegativeInt] = None,
    per_position: bool = False,
    max_memory: Optional[ByteSize] = None,
    seed: Seed = 0,
    progress: bool = True,
    engine: Literal["auto", "hooks"] = "auto",
) -> DASResult:
    """Distributed alignment search for ``pairs.variable`` at one site, layer and positions.

    Args:
        model: the hooked model.
        pairs: the interchange pairs (:func:`interchange_dataset`).
        site: the site whose vector is interchanged (``"resid_post"``, ``"attn_z"``, ...).
        layer: the block.
        positions: a position, or a list of them swapped together through one subspace.
        k: dimensions interchanged (DAS); for ``method="boundless"`` the boundary is learned and
            ``k`` is only the size of the random-rotation baseline (the learned one is reported).
        steps: Adam steps on batches of training pairs (the batch size comes from
            ``max_memory`` bytes, default the engine's budget).
        method: ``"das"`` (a fixed ``k``) or ``"boundless"`` (Boundless DAS: the boundary is learned).
        lr: Adam's learning rate.
        baselines: which of ``"full"``, ``"probe"``, ``"pca"``, ``"random"`` to score beside it.
        reachable_only: train and score only the pairs the site can reach (``scoring.reachable``:
            the counterfactual answer agrees with the base answer at every token predicted before
            the earliest intervened positions), for DAS, the baselines and the chance level alike;
            the pairs left out are counted in ``meta["unreachable"]``. Default: every pair (a pair
            the site cannot reach counts as wrong).
        head: with ``site="attn_z"``, the head whose output vector ``[d_head]`` is interchanged.
        per_position: with several positions, each gets its own learned ``k``-dimensional subspace
            (and so does each baseline: a probe, PCA and random subspace per positions) instead of
            one shared by all; ``basis`` is then ``[P, d, k]``. Default: one shared subspace.
        max_memory: bytes one training or scoring batch may use (default: the engine's budget).
        seed: seeds the rotation's initialisation, the batches and the baselines.
        progress: show a progress bar.
        engine: ``"auto"``: the base prompts run once and every interchange (training steps,
            scoring, baselines) resumes at the intervened layer and positions, unembedding the
            answer positions alone, where the model's blocks step exactly
            (:mod:`~arithinterp.engine.interchange`; else whole forwards); ``"hooks"``: one whole
            forward per interchange (the reference; the same numbers). ``meta["engine"]`` says which ran.

    Returns:
        The fit, a :class:`DASResult`: held-out IIA with its 95% interval and logit difference for
        DAS and each baseline, the chance level, the learned basis ``[d, k]`` and the loss history.

    Raises:
        AnalysisError: ``k`` wider than the site, ``per_position`` with one positions or Boundless
            DAS, no pairs, or no reachable pair.
        ModelMismatchError: The pairs' prompts belong to another model.
    """
    _check(pairs)
    check_belongs(model, "das", prompts=pairs.base)
    where = Site(site, layer, positions, head)
    d = where.check(model)
    if k > d:
        raise ConfigError(f"k must be an int in 1..{d} (the width of {site}), got {k!r}")
    n_positions = 1 if isinstance(positions, (str, int)) else len(list(positions))
    if per_position and (n_positions < 2 or method != "das"):
        raise ConfigError(f"per_position gives each of several positions its own subspace: it needs method='das' "
                            f"and at least 2 positions, got method={method!r} and {n_positions} position(s)")
    size_eval = batch_size(model, pairs, training=False, max_memory=max_memory)
    size_train = pairs_per_step(model, pairs, max_memory)
    train_rows, test_rows, unreachable = pairs.train, pairs.test, dict(train=0, test=0)
    if reachable_only:
        keep_train, keep_test = reachable(pairs, train_rows, positions), reachable(pairs, test_rows, positions)
        unreachable = dict(train=int((~keep_train).sum()), test=int((~keep_test).sum()))
        train_rows, test_rows = train_rows[keep_train], test_rows[keep_test]
        if len(test_rows) < 1:
            raise AnalysisError(f"no held-out pair is reachable from {positions!r}: every counterfactual answer "
                                "differs at a token predicted before it; intervene earlier")
    if "probe" in baselines and len(torch.unique(pairs.base_value[train_rows])) < 2:  # before training, not after
        raise AnalysisError(f"{pairs.variable!r} takes one value on the training pairs, so the probe baseline has no "
                            "direction to fit; leave 'probe' out of baselines, or choose a variable that varies")
    runs = Runs(model, pairs, where, torch.cat([train_rows, test_rows]), max_memory=max_memory, engine=engine)
    sources = runs.source_values(size_eval)
    if runs.stepped:  # resumed runs are small: score many pairs per batch (the runs split it to fit memory)
        size_eval = max(size_eval, runs.eval_size)
    torch.manual_seed(seed)
    intervention: Intervention = RotatedSubspace(d, k, seed) if method == "das" else BoundlessSubspace(d, seed)
    if per_position:
        intervention = PerPosition([RotatedSubspace(d, k, seed + i) for i in range(n_positions)])
    history = train(model, pairs, where, intervention, sources, steps=steps, lr=lr, size=size_train,
                    seed=seed, progress=progress, rows=train_rows, runs=runs)
    if isinstance(intervention, BoundlessSubspace):
        intervention = intervention.hard()
    scores = {method: evaluate(model, pairs, where, intervention, sources, test_rows, size_eval, runs)}
    scores[method]["k"] = intervention.k
    train_scores = evaluate(model, pairs, where, intervention, sources, train_rows, size_eval, runs)
    scores["none"] = evaluate(model, pairs, where, None, sources, test_rows, size_eval, runs)
    scores["none"]["k"] = 0
    fixed_subspaces = baseline_subspaces(model, pairs, where, k, baselines, size_eval, seed, rows=train_rows,
                                         per_position=per_position, runs=runs)
    for name, fixed in fixed_subspaces.items():
        scores[name] = evaluate(model, pairs, where, fixed, sources, test_rows, size_eval, runs)
        scores[name]["k"] = fixed.k
    basis = intervention.basis().detach().float().cpu()
    meta = build_meta(model, variable=pairs.variable, causal_model=pairs.causal_model.name,
                      shuffled=pairs.shuffled, steps=steps, lr=lr, seed=seed, pairs=pairs.meta,
                      n_train=len(train_rows), n_test=len(test_rows), reachable_only=reachable_only,
                      unreachable=unreachable, head=head, per_position=per_position,
                      engine="stepped" if runs.stepped else "hooks")
    return DASResult(
        variable=pairs.variable, site=site if head is None else f"{site}[{head}]", layer=layer,
        position=str(positions) if isinstance(positions, (str, int)) else "+".join(map(str, positions)), method=method,
        k=intervention.k, iia=scores[method]["iia"], train_iia=train_scores["iia"],
        chance=pairs.chance_over(test_rows) if reachable_only else pairs.chance,
        scores=scores, basis=basis, history=history, meta=meta,
    )


@checked
def converged(history: Sequence[float], window: PositiveProbability = 0.2,
              tolerance: PositiveProbability = 0.05) -> bool:
    """Whether a fit's training loss had stopped falling: over the last ``window`` of its steps its
    mean fell, against the ``window`` before, by at most ``tolerance`` of that mean or by no more
    than the two means' noise (twice the standard error of their difference: each step's loss is
    on a fresh batch of pairs). A fit cut short while its loss still falls has not found the
    subspace it would have, so its IIA is no finding.

    Args:
        history: The training loss per step (``DASResult.history``).
        window: The share of the steps each mean is over.
        tolerance: The largest relative fall that counts as levelled off.

    Returns:
        ``True`` when the loss had levelled off (too short a history to tell: ``False``).
    """
    k = int(len(history) * window)
    if k < 2 or len(history) < 2 * k:
        return False
    late = torch.tensor(history[-k:], dtype=torch.float64)
    before = torch.tensor(history[-2 * k:-k], dtype=torch.float64)
    fall = float(before.mean() - late.mean())
    noise = 2 * float((before.var() / k + late.var() / k).sqrt())
    return fall <= max(tolerance * abs(float(before.mean())), noise)


@checked
def baseline_subspaces(model: HookedModel, dataset: InterchangeDataset, where: Site, k: int,
                       which: Sequence[str], size: int, seed: int = 0, rows: Optional[torch.Tensor] = None,
                       per_position: bool = False, runs: Optional[Runs] = None) -> dict[str, Intervention]:
    """The fixed subspaces at ``where``: full vector, probe span, PCA top-``k``, random ``k``; the probe and
    the PCA are fitted on the training pairs' base activations only (``rows``, default ``dataset.train``;
    read from ``runs``' kept base runs when given, else by forwards of their own).

    Args:
        model: The hooked model.
        dataset: The interchange pairs.
        where: The intervened site, layer and position(s).
        k: The dimension of the PCA and random subspaces.
        which: Which of ``"full"``, ``"probe"``, ``"pca"``, ``"random"`` to build.
        size: Pairs per forward when reading activations.
        seed: Seeds the probe and the random rotation.
        rows (Int[Tensor, "n"] | None): The pairs to fit on (default ``dataset.train``).
        per_position: With several positions, a probe, PCA and random subspace for each position.
        runs: Kept base runs to read the activations from.

    Returns:
        ``{name: Intervention}`` for each subspace built.

    Raises:
        AnalysisError: The variable takes one value on the training pairs (no probe direction).
    """
    rows = dataset.train if rows is None else rows
    d = where.check(model)
    out: dict[str, Intervention] = {}
    if "full" in which:
        out["full"] = full_vector(d)
    if "probe" in which or "pca" in which:
        acts = base_values(model, dataset, where, size, rows) if runs is None else runs.base_values(rows, size)
        labels = dataset.base_value[rows]
        if acts.ndim == 3 and per_position:
            fitted = [_fitted(acts[:, i], labels, k, which, seed) for i in range(acts.shape[1])]
            out.update({name: PerPosition([f[name] for f in fitted]) for name in fitted[0]})
        else:
            if acts.ndim == 3:  # several positions share the subspace: fit on all of them
                labels = labels.repeat_interleave(acts.shape[1])
                acts = acts.flatten(0, 1)
            out.update(_fitted(acts, labels, k, which, seed))
    if "random" in which:
        n = 1 if isinstance(where.position, (str, int)) else len(list(where.position))
        out["random"] = (PerPosition([random_subspace(d, k, seed + 1 + i) for i in range(n)])
                         if per_position and n > 1 else random_subspace(d, k, seed + 1))
    return out


def _fitted(acts: torch.Tensor, labels: torch.Tensor, k: int, which: Sequence[str],
            seed: int) -> dict[str, Intervention]:
    """The probe span and PCA top-``k`` of ``acts [N, d]``."""
    out: dict[str, Intervention] = {}
    if "probe" in which:
        out["probe"] = FixedSubspace(probe_span(acts, labels, seed))
    if "pca" in which:
        centred = acts - acts.mean(0)
        _, _, vt = torch.linalg.svd(centred.double(), full_matrices=False)
        out["pca"] = FixedSubspace(vt[: min(k, vt.shape[0])].T.float().contiguous())
    return out


@checked
def probe_span(acts: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """An orthonormal basis of the directions of a logistic probe.

    Args:
        acts (Float[Tensor, "n d"]): Activations.
        labels (Int[Tensor, "n"]): The variable's value per row.
        seed: Unused: the probe is fitted by full-batch L-BFGS, deterministically.

    Returns:
        Float[Tensor, "d r"]: The basis, ``r`` up to the number of classes.

    Raises:
        AnalysisError: ``labels`` takes one value.
    """
    from arithinterp.probes import LogisticProbe

    if len(torch.unique(labels)) < 2:
        raise AnalysisError("the variable takes one value on the training pairs; a probe for it has no direction")
    probe = LogisticProbe().fit(acts, labels)
    return orthonormal(torch.as_tensor(probe.coef_, dtype=torch.float32))
