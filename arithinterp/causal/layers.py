"""DAS at every layer × position, and the "readable vs used" table.

Probes say a variable is linearly *readable*; an interchange that makes the model follow the
causal model says it is *used* there (Geiger et al. 2024). :func:`readable_vs_used` puts both side
by side per variable and layer, with the random-rotation control beside the DAS number.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from arithinterp import sites as site_lib
from arithinterp.causal.datasets import InterchangeDataset, interchange_dataset
from arithinterp.causal.fit import converged, das
from arithinterp.causal.models import CausalModel
from arithinterp.causal.results import DASLayersResult, ReadableUsedResult
from arithinterp.causal.scoring import Site, reachable
from arithinterp.checks import check_belongs, check_fingerprint
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.progress import progress_bar
from arithinterp.results import build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import ByteSize, HookedModel, IntList, PositiveFloat32, PositiveInt, Seed, checked


def _check_cells(model: HookedModel, dataset: InterchangeDataset, site: str, layers: list, positions: list,
                 k: int) -> None:
    """Every layer × position a sweep will fit exists on this model and these prompts, and ``k`` fits the
    site: a misspelt position or a layer past the model fails here, not after the cells before it."""
    check_belongs(model, "das_layers", prompts=dataset.base)
    answers = max(0, int(dataset.base.n_answer_tokens.max()) - 1)
    for prompts in (dataset.base, dataset.source):
        prompts.locate(positions, answers=answers)
    for layer in layers:
        d = Site(site, layer, positions[0], None).check(model)
        if k > d:
            raise ConfigError(f"k must be an int in 1..{d} (the width of {site}), got {k!r}")


def _pairs_digest(pairs: InterchangeDataset) -> str:
    """A short hash of the pairs' tokens and held-out split: a resumed sweep must fit the same pairs."""
    import hashlib

    digest = hashlib.sha256()
    for tensor in (pairs.base.tokens, pairs.source.tokens, torch.as_tensor(pairs.test)):
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _check_resume(model: HookedModel, resume: DASLayersResult, site: str, layers: list, positions: list, k: int,
                  settings: dict) -> None:
    """Refuse a partial result made on another model, grid or setting: its cells would not be this call's."""
    check_fingerprint(model, resume.meta.get("fingerprint"), "DAS fits to resume", "das_layers")
    theirs = dict(site=resume.site, layers=list(resume.layers), positions=list(resume.positions), k=resume.k,
                  **{name: resume.meta.get(name) for name in settings})
    mine = dict(site=site, layers=layers, positions=positions, k=k, **settings)
    differ = [f"{name}={theirs[name]!r} (here {mine[name]!r})" for name in mine if theirs[name] != mine[name]]
    if differ:
        raise AnalysisError(f"resume was made with other settings or pairs: {'; '.join(differ)}; resume a result "
                            "of this same call")


@checked
def das_layers(
    model: HookedModel,
    pairs: InterchangeDataset,
    site: str = "resid_post",
    k: PositiveInt = 2,
    *,
    layers: Optional[IntList] = None,
    positions: Sequence[Union[str, int]] = ("final",),
    steps: PositiveInt = 200,
    lr: PositiveFloat32 = 1e-2,
    reachable_only: bool = False,
    max_memory: Optional[ByteSize] = None,
    seed: Seed = 0,
    resume: Optional[DASLayersResult] = None,
    progress: bool = True,
) -> DASLayersResult:
    """One DAS fit per layer × position, each with its random-rotation control.

    A sweep of many cells can stop early and go on later: Ctrl-C (``KeyboardInterrupt``) after at
    least one fit returns the cells finished so far (the rest NaN; ``meta["done"]`` marks which,
    ``meta["stopped"]`` says ``"interrupted"``), and ``resume=`` that result fits only the rest, with
    the same settings and pairs, to the grid an uninterrupted call gives.

    Args:
        model: The hooked model.
        pairs: The interchange pairs.
        site: The site whose vector is interchanged.
        layers: The layers (default: all).
        positions: The positions, each fitted on its own.
        k: Dimensions interchanged.
        steps: Adam steps per fit.
        lr: Adam's learning rate.
        reachable_only: Each cell trains and scores only the pairs its position can reach (see
            :func:`das`); a position that reaches no held-out pair gets NaN; the held-out pairs
            scored per cell are in ``meta["n_test_per_cell"]`` ``[layer, position]``.
        max_memory: Bytes one batch may use.
        seed: Seeds every fit.
        resume: A partial result of this call (interrupted) whose finished cells are kept.
        progress: Show a progress bar.

    Returns:
        The held-out IIA grid ``[layer, position]`` with its interval and the random rotation's.

    Raises:
        ConfigError: No layer or position, or a layer or position named twice.
        AnalysisError: An invalid cell (checked before the first fit);
            ``resume`` was made with other settings or pairs.
        ModelMismatchError: The pairs's prompts, or ``resume``, belong to another model.
        KeyboardInterrupt: Interrupted before a fit finished (there is nothing to keep).
    """
    import warnings

    check_belongs(model, "das_layers", prompts=pairs.base)
    layers = list(range(site_lib.n_layers(model))) if layers is None else list(layers)
    positions = list(positions)
    if not layers or not positions:
        raise ConfigError("das_layers needs at least one layer and one position")
    for name, items in (("layers", layers), ("positions", positions)):
        if len({repr(v) for v in items}) != len(items):  # a repeated row or column would be fitted twice
            raise ConfigError(f"{name}={items!r} names one more than once; name each once")
    _check_cells(model, pairs, site, layers, positions, k)  # every cell before the first fit
    settings = dict(variable=pairs.variable, steps=steps, lr=lr, seed=seed, n_test=len(pairs.test),
                    reachable_only=reachable_only, pairs_digest=_pairs_digest(pairs))
    shape = (len(layers), len(positions))
    grids = {name: torch.full(shape, float("nan")) for name in ("iia", "low", "high", "random_iia", "logit_diff")}
    n_test = torch.zeros(shape, dtype=torch.long)
    done = torch.zeros(shape, dtype=torch.bool)
    if resume is not None:
        _check_resume(model, resume, site, layers, [str(p) for p in positions], k, settings)
        done = torch.tensor(resume.meta.get("done", [[True] * shape[1]] * shape[0]), dtype=torch.bool)
        n_test = torch.tensor(resume.meta["n_test_per_cell"], dtype=torch.long)
        for name, grid in grids.items():
            grid[done] = getattr(resume, name)[done]
    todo = [(i, j) for i in range(len(layers)) for j in range(len(positions)) if not done[i, j]]
    stopped = None
    bar = progress_bar(total=done.numel(), initial=int(done.sum()), desc="DAS per layer", disable=not progress)
    try:
        for i, j in todo:
            # a position that reaches no held-out pair gets no score (NaN), not a zero
            if not reachable_only or bool(reachable(pairs, pairs.test, positions[j]).any()):
                fit = das(model, pairs, site, layers[i], k, positions=positions[j], steps=steps, lr=lr,
                          baselines=("random",), reachable_only=reachable_only, max_memory=max_memory, seed=seed,
                          progress=False)
                s = fit.scores["das"]
                n_test[i, j] = s["n"]
                grids["iia"][i, j], grids["low"][i, j], grids["high"][i, j] = s["iia"], s["low"], s["high"]
                grids["logit_diff"][i, j] = s["logit_diff"]
                grids["random_iia"][i, j] = fit.scores["random"]["iia"]
            done[i, j] = True  # last: a cell counts once all of it is in
            bar.update(1)
    except KeyboardInterrupt:
        if not done.any():
            raise
        stopped = "interrupted"
        warnings.warn(f"das_layers interrupted after {int(done.sum())} of {done.numel()} cells; pass the result as "
                      "resume= to fit the rest", stacklevel=2)
    finally:
        bar.close()
    labels, _ = pairs.base[:1].locate(positions, answers=max(0, int(pairs.base.n_answer_tokens.max()) - 1))
    tokens = pairs.base.str_tokens(0) + [f"answer[{m}]" for m in range(int(pairs.base.n_answer_tokens.max()))]
    _, index = pairs.base[:1].locate(positions, answers=max(0, int(pairs.base.n_answer_tokens.max()) - 1))
    offset = pairs.base.tokens.shape[1] - int(pairs.base.lengths[0])
    names = [f"{p}: {tokens[int(c) - offset]}" if 0 <= int(c) - offset < len(tokens) else str(p)
             for p, c in zip(labels, index[0].tolist())]
    meta = build_meta(model, **settings, n_test_per_cell=n_test.tolist(), done=done.tolist(), stopped=stopped)
    return DASLayersResult(variable=pairs.variable, site=site, layers=layers, positions=[str(p) for p in positions],
                           k=k, chance=pairs.chance, tokens=names, meta=meta, **grids)


@checked
def readable_vs_used(
    model: HookedModel,
    prompts: PromptSet,
    variables: Sequence[str],
    causal_model: Optional[CausalModel] = None,
    *,
    site: str = "resid_post",
    layers: Optional[IntList] = None,
    positions: Union[str, int] = "final",
    k: PositiveInt = 2,
    steps: PositiveInt = 200,
    n: Optional[PositiveInt] = None,
    lr: PositiveFloat32 = 1e-2,
    max_memory: Optional[ByteSize] = None,
    seed: Seed = 0,
    progress: bool = True,
) -> ReadableUsedResult:
    """Per variable and layer: probe accuracy with folds grouped by operand pair (readable) beside
    held-out DAS IIA and random-rotation IIA (used) at one site and positions.

    Args:
        model: The hooked model.
        prompts: The prompts (correctly answered ones).
        variables: The causal variables.
        causal_model: Their causal model (default: the built-in one for the prompts).
        site: The site read and interchanged.
        layers: The layers (default: all).
        positions: The positions.
        k: Dimensions interchanged.
        steps: Adam steps per :func:`das` fit.
        n: Pairs per variable's dataset (default: one per prompt).
        lr: Adam's learning rate.
        max_memory: Bytes one batch may use.
        seed: Seeds the datasets, probes and fits.
        progress: Show a progress bar.

    Returns:
        Per variable and layer, the probe accuracy beside the DAS and random-rotation IIA.

    Raises:
        AnalysisError: No variables or layers, a variable named twice, or an invalid cell.
    """
    from arithinterp.activations import collect
    from arithinterp.probes import probe_layers

    if not variables:
        raise ConfigError("readable_vs_used needs at least one variable")
    if len(set(variables)) != len(variables):
        raise ConfigError(f"variables names one more than once: {list(variables)}")
    layers = list(range(site_lib.n_layers(model))) if layers is None else list(layers)
    if not layers:
        raise ConfigError("readable_vs_used needs at least one layer")
    # every variable's dataset and every cell are checked before the first fit
    datasets = {variable: interchange_dataset(prompts, variable, causal_model, n=n, seed=seed)
                for variable in variables}
    for dataset in datasets.values():
        _check_cells(model, dataset, site, layers, [positions], k)
    acts = collect(model, prompts, sites=[site], layers=layers, positions=[positions], progress=False)
    rows = []
    for variable in progress_bar(list(variables), desc="readable vs used", disable=not progress):
        dataset = datasets[variable]
        labels = dataset.causal_model.values(prompts.a, prompts.b)[variable]
        readable = None
        if len(torch.unique(labels)) >= 2:
            readable = probe_layers(acts, labels, kind="logistic", site=site, groups="pair", seed=seed,
                                    progress=False).to_frame()
        for layer in layers:
            fit = das(model, dataset, site, layer, k, positions=positions, steps=steps, lr=lr, baselines=("random",),
                      max_memory=max_memory, seed=seed, progress=False)
            row = dict(variable=variable, layer=layer, das_iia=fit.iia, das_low=fit.scores["das"]["low"],
                       das_high=fit.scores["das"]["high"], random_iia=fit.scores["random"]["iia"], chance=fit.chance,
                       converged=converged(fit.history),
                       probe_accuracy=float("nan"), probe_low=float("nan"), probe_high=float("nan"),
                       probe_control=float("nan"))
            if readable is not None:
                cells = {r["source"]: r for r in readable.to_dict("records") if r["layer"] == layer}
                probe, control = cells["probe"], cells.get("shuffled")
                row.update(probe_accuracy=float(probe["score"]), probe_low=float(probe["ci_low"]),
                           probe_high=float(probe["ci_high"]),
                           probe_control=float(control["score"]) if control else float("nan"))
            rows.append(row)
    meta = build_meta(model, steps=steps, lr=lr, seed=seed, variables=list(variables))
    return ReadableUsedResult(site=site, position=str(positions), k=k, rows=rows, meta=meta)
