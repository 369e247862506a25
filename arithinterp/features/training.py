"""Training transcoders on activations read through the engine, and measuring them.

:func:`mlp_activations` reads every layer's MLP input and output at every (unpadded) position of a
prompt set, answer tokens teacher-forced after the prompt where the answer has several tokens.
:func:`train_transcoders` fits one TopK transcoder per layer (Adam on the MSE, decoder rows kept
at unit norm, the AuxK loss of Gao et al. 2024 to revive dead features, the skip initialised by
least squares, ridge-regularised where ``skip_ridge`` > 0) on a seeded split of the prompts and
measures it on the held-out prompts: FVU (over every position, and after each prompt's first,
where Gemma's ``<bos>`` alone can hold most of the variance), L0, dead features, and the replacement
model (:mod:`arithinterp.features.replacement`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Annotated, Any, Optional, Sequence

import torch
from pydantic import Field

from arithinterp import sites as site_lib
from arithinterp.checks import check_belongs
from arithinterp.engine import Read, Write, run
from arithinterp.engine.budget import memory_budget
from arithinterp.engine.decode import batch_size_for
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.features.replacement import compare_replacement, full_tokens
from arithinterp.features.transcoder import Transcoders, topk_unchecked
from arithinterp.progress import progress_bar
from arithinterp.results import build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import (
    Accepts, ByteSize, IntList, NonNegativeFiniteFloat, OpenUnitFloat, PositiveFiniteFloat, PositiveFloat32,
    PositiveInt, Probability, HookedModel, Seed, checked,
)


@checked
def mlp_activations(model: HookedModel, tokens: torch.Tensor, layers: Sequence[int], batch_size: Optional[int] = None,
                    progress: bool = False,
                    writes: Sequence[Write] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's MLP inputs and outputs, read by the engine.

    Args:
        model: The hooked model.
        tokens (Int[Tensor, "prompt pos"]): The prompts.
        layers: The layers.
        batch_size: Prompts per forward (default: what the engine's budget allows).
        progress: Show a progress bar.
        writes: Interventions applied in every forward (e.g. earlier MLPs replaced by their
            transcoders, :meth:`Transcoders.interventions`).

    Returns:
        ``(inputs, outputs)``: per layer, Float[Tensor, "prompt pos d_model"] (float32, on the CPU).
    """
    reads = [Read(site, layer) for layer in layers for site in ("mlp_in", "mlp_out")]
    size = batch_size or batch_size_for(model, int(tokens.shape[1]), n_read=len(reads), plain=True)
    ins: list[list[torch.Tensor]] = [[] for _ in layers]
    outs: list[list[torch.Tensor]] = [[] for _ in layers]
    for start in progress_bar(range(0, len(tokens), size), desc="read MLPs", disable=not progress):
        got = run(model, tokens[start : start + size], writes, reads=reads, logits="none").reads
        for i in range(len(layers)):
            ins[i].append(got[2 * i].float().cpu())
            outs[i].append(got[2 * i + 1].float().cpu())
    return [torch.cat(x) for x in ins], [torch.cat(y) for y in outs]


def _fvu(y: torch.Tensor, y_hat: torch.Tensor) -> float:
    """Fraction of variance unexplained: ``Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` over rows ``[n, d]``."""
    total = ((y - y.mean(0)) ** 2).sum()
    if float(total) == 0.0:
        raise AnalysisError("the MLP output does not vary over the prompts; its FVU is undefined")
    return float(((y - y_hat) ** 2).sum() / total)


def _distinct_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of ``x [n, d]`` in their first order of appearance, and where each first
    appears ``[m]`` (prompts sharing a prefix give equal MLP inputs at its positions)."""
    _, inverse = torch.unique(x, dim=0, return_inverse=True)
    seen = torch.full((int(inverse.max()) + 1,), len(x), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(x)), reduce="amin")
    first = seen.sort().values
    return x[first], first


def _resample(tensors: dict, optimiser: torch.optim.Optimizer, dead: torch.Tensor, x: torch.Tensor,
              error: torch.Tensor, generator: torch.Generator) -> None:
    """Point dead features at badly reconstructed rows (Bricken et al. 2023's resampling): the
    decoder row becomes the row's normalised error, the encoder column its normalised input,
    scaled to the live features' encoder norm; their optimiser state restarts."""
    index = dead.nonzero().squeeze(1)
    weights = (error**2).sum(-1)
    rows = torch.multinomial(weights / weights.sum(), len(index), replacement=True, generator=generator)
    with torch.no_grad():
        alive = ~dead
        norm = tensors["W_enc"][:, alive].norm(dim=0).mean() if bool(alive.any()) else torch.tensor(1.0)
        tensors["W_dec"][index] = error[rows] / error[rows].norm(dim=1, keepdim=True).clamp_min(1e-8)
        centred = x[rows] - x.mean(0)
        tensors["W_enc"][:, index] = (centred / centred.norm(dim=1, keepdim=True).clamp_min(1e-8)).T * norm
        tensors["b_enc"][index] = 0.0
    for name in ("W_enc", "b_enc", "W_dec"):
        state = optimiser.state.get(tensors[name], {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                if name == "W_enc":
                    state[key][:, index] = 0.0
                else:
                    state[key][index] = 0.0


def _fit_layer(x: torch.Tensor, y: torch.Tensor, n_features: int, k: int, steps: int, batch_size: int, lr: float,
               skip: bool, generator: torch.Generator, progress: bool, desc: str, encoder_scale: float = 0.1,
               resample_until: float = 0.0, min_frequency: float = 1e-3, skip_ridge: float = 0.0,
               train_skip: bool = True) -> dict[str, torch.Tensor]:
    """One TopK transcoder fitted to rows ``x [n, d] -> y [n, d]``.

    The skip starts at the least-squares fit of ``y`` on ``x``, with ``skip_ridge`` × the inputs'
    mean variance added to each direction's (ridge regression): inputs that span few directions
    (a few thousand distinct rows of a narrow task) leave the plain fit huge gains along directions
    the rows barely vary in, which inputs the replacement model drifts into then hit. With
    ``train_skip`` False the skip stays there and Adam trains the features alone.

    Against dead features (Gao et al. 2024): the encoder starts as the decoder's transpose with
    the inputs' mean subtracted (the pre-bias, folded into ``b_enc``), and the AuxK loss trains the
    features that have not fired for ~two passes, or fire on fewer than ``min_frequency`` of the
    rows, to reconstruct the main loss's error through their own top ``k_aux`` pre-activations.
    Unlike a ReLU'd AuxK, the raw pre-activations are used, so a feature whose pre-activation has
    gone negative on every row still gets a gradient back towards the data (with a ReLU there, or a
    straight-through ReLU, 19% of add-100's layer-0 features stayed dead; raw: 2%).
    """
    n, d = x.shape
    W_dec = torch.randn(n_features, d, generator=generator)
    W_dec = W_dec / W_dec.norm(dim=1, keepdim=True)
    x_mean = x.mean(0)
    b_dec = y.mean(0).clone()
    if skip and skip_ridge > 0:  # ridge: (C + λ I) W = C_xy, λ relative to the inputs' mean variance
        x_c, y_c = x - x_mean, y - b_dec
        covariance = x_c.T @ x_c / n
        ridge = skip_ridge * float(covariance.diagonal().mean())
        W_skip = torch.linalg.solve(covariance + ridge * torch.eye(d), x_c.T @ y_c / n)
        b_dec = b_dec - x_mean @ W_skip
    elif skip:  # the linear part of the MLP, by least squares: features then fit what is not linear
        x_c = torch.cat([x - x_mean, torch.ones(n, 1)], 1)
        W_skip = torch.linalg.lstsq(x_c, y - b_dec).solution[:d]
        b_dec = b_dec - x_mean @ W_skip  # the skip reads x, not x - mean
    else:
        W_skip = torch.zeros(d, d)
    W_enc = W_dec.T.clone() * encoder_scale
    params = dict(W_enc=W_enc, b_enc=-(x_mean @ W_enc), W_dec=W_dec, b_dec=b_dec, W_skip=W_skip)
    tensors = {name: p.clone().requires_grad_(True) for name, p in params.items()}
    if not skip or not train_skip:
        tensors["W_skip"].requires_grad_(False)
    optimiser = torch.optim.Adam([p for p in tensors.values() if p.requires_grad], lr=lr)
    k_aux = min(n_features, max(2 * k, d // 2))
    since_fired = torch.zeros(n_features)
    frequency = torch.zeros(n_features)  # an EMA of each feature's firing rate, bias-corrected below
    dead_after = max(1, math.ceil(2 * n / batch_size))  # a feature silent over ~two passes counts as dead
    resample_every = max(dead_after + 1, steps // 10)
    for step in progress_bar(range(steps), desc=desc, disable=not progress):
        rows = torch.randint(0, n, (min(batch_size, n),), generator=generator)
        xb, yb = x[rows], y[rows]
        pre = xb @ tensors["W_enc"] + tensors["b_enc"]
        acts = topk_unchecked(pre, k)
        linear = tensors["b_dec"] + xb @ tensors["W_skip"]
        y_hat = acts @ tensors["W_dec"] + linear
        error = yb - y_hat
        scale = ((yb - yb.mean(0)) ** 2).sum(-1).mean().clamp_min(1e-12)
        loss = (error**2).sum(-1).mean() / scale
        fired = acts > 0
        since_fired = torch.where(fired.any(0), torch.zeros_like(since_fired), since_fired + 1)
        frequency = 0.99 * frequency + 0.01 * fired.float().mean(0)
        rare = (frequency / (1 - 0.99 ** (step + 1)) < min_frequency) & (step >= 20)
        dead = (since_fired > dead_after) | rare
        if bool(dead.any()):  # AuxK: the dead features reconstruct the remaining error
            aux_pre = torch.where(dead, pre, torch.full_like(pre, -1e9))
            values, index = aux_pre.topk(min(k_aux, int(dead.sum())), dim=-1)
            aux = torch.zeros_like(pre).scatter(-1, index, values)
            aux_error = error.detach() - aux @ tensors["W_dec"]
            loss = loss + (aux_error**2).sum(-1).mean() / scale / 32
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if bool(dead.any()) and step % resample_every == resample_every - 1 and step < resample_until * steps:
            _resample(tensors, optimiser, dead, xb, error.detach(), generator)
            since_fired[dead] = 0
        with torch.no_grad():
            tensors["W_dec"] /= tensors["W_dec"].norm(dim=1, keepdim=True).clamp_min(1e-8)
        for group in optimiser.param_groups:  # linear decay over the last fifth
            group["lr"] = lr * min(1.0, 5 * (1 - step / steps))
    return {name: p.detach() for name, p in tensors.items()}


Frequency = Annotated[Probability, Field(lt=1), Accepts("a number in [0, 1)")]  # a share of rows, below all


@checked
def train_transcoders(model: HookedModel, prompts: PromptSet, *, layers: Optional[IntList] = None,
                      n_features: PositiveInt = 512, k: PositiveInt = 16, steps: PositiveInt = 2000,
                      batch_size: PositiveInt = 2048, lr: PositiveFloat32 = 2e-3, skip: bool = True,
                      held_out: OpenUnitFloat = 0.1, seed: Seed = 0, encoder_scale: PositiveFiniteFloat = 0.1,
                      resample_until: Probability = 0.0, min_frequency: Frequency = 1e-3,
                      skip_ridge: NonNegativeFiniteFloat = 0.0, train_skip: bool = True, distinct: bool = False,
                      sequential: bool = False, max_memory: Optional[ByteSize] = None,
                      progress: bool = True) -> Transcoders:
    """Train one TopK transcoder per layer on every position of ``prompts`` and measure it.

    The encoder starts as ``encoder_scale`` × the decoder's transpose, centred on the inputs' mean;
    features silent for ~two passes or firing on fewer than ``min_frequency`` of the rows are trained
    by the AuxK loss, and (``resample_until`` > 0) resampled during that first share of the steps.
    ``skip_ridge`` > 0 fits the skip by ridge regression (its strength × the inputs' mean variance),
    ``train_skip`` False keeps it there; ``distinct`` trains on each distinct MLP input once (prompts
    that share a few-shot prefix repeat its rows in every prompt).

    ``sequential`` trains the layers in order, each on the MLP inputs of the model whose earlier
    chosen layers are already replaced by their transcoders, to the real MLP's outputs on those
    inputs: the rows the layer meets in the replacement model. Trained on the real model's inputs
    alone, each transcoder meets inputs shifted by the earlier ones' errors and can go wrong by more
    than its own size, so errors compound with depth (on Gemma 3 270M: replacement agreement 0.04
    trained alone, 0.63 trained in sequence; ``docs/features.md``). It costs one forward per layer,
    each stopping at that layer (about half as many whole forwards as there are layers), instead of one.

    ``held_out`` of the prompts (a seeded random split) are kept aside: FVU, L0, dead features
    and the replacement model's agreement and KL are measured on them only.

    Args:
        model: The hooked model.
        prompts: The prompts; every position of each is a training row.
        layers: The layers (default: all).
        n_features: Features per transcoder.
        k: Features that fire per row (TopK).
        steps: Adam steps per layer.
        batch_size: Rows per step.
        lr: Adam's learning rate.
        skip: Add a linear skip from the MLP input to its output, started at the least-squares fit.
        held_out: The share of prompts kept aside for the metrics.
        seed: Seeds the split, the initialisation and the batches.
        encoder_scale: The encoder's initial scale relative to the decoder's transpose.
        resample_until: The first share of the steps during which dead features are resampled.
        min_frequency: Features firing on fewer rows than this share are trained by the AuxK loss.
        skip_ridge: The skip's ridge strength (× the inputs' mean variance); 0 for least squares.
        train_skip: Train the skip with the features; False keeps it at its fit.
        distinct: Train on each distinct MLP input once.
        sequential: Train each layer on the inputs of the model with the earlier layers replaced.
        max_memory: Bytes one layer's training may use.
        progress: Show progress bars.

    Returns:
        The transcoders, with the held-out metrics (``metrics["layers"]``, ``metrics["replacement"]``).

    Raises:
        ConfigError: A layer named twice.
        AnalysisError: ``k`` above ``n_features``, a training step beyond ``max_memory``, or too few
            prompts to split.
        ModelMismatchError: The prompts were built for another model.
    """

    check_belongs(model, "train_transcoders", prompts=prompts)
    chosen = sorted(site_lib.check_layers(model, "mlp_out", layers))  # stacked in layer order, as load checks
    if len(set(chosen)) != len(chosen):
        raise ConfigError(f"layers {layers} names a layer twice; each layer has one transcoder")
    if k > n_features:
        raise ConfigError(f"k={k} exceeds n_features={n_features}; k is how many features fire per row")
    # one layer trains at a time: its weights, their gradients and Adam's two moments, and a batch's rows
    d = int(model.cfg.d_model)
    need = 4 * (4 * (2 * d * n_features + n_features + d + d * d) + 6 * batch_size * (n_features + d))
    budget = memory_budget(model, max_memory)
    if need > budget:
        raise AnalysisError(f"training one layer's transcoder with n_features={n_features} and batch_size={batch_size} "
                            f"needs about {need / 2**20:.0f} MiB, more than the budget of {budget / 2**20:.0f} MiB "
                            "(max_memory); use fewer features or a smaller batch, or raise max_memory")
    tokens, valid, n_answer = full_tokens(prompts)
    first = valid.float().argmax(1)  # the first unpadded position of each prompt
    after_first = valid & (torch.arange(tokens.shape[1])[None, :] > first[:, None])
    N = len(tokens)
    n_test = max(1, int(round(held_out * N)))
    if N - n_test < 1:
        raise AnalysisError(f"{N} prompts are too few to split into training and held-out ones; pass at least 2")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(N, generator=generator)
    test, train = order[:n_test], order[n_test:]
    start = time.perf_counter()
    ins, outs = mlp_activations(model, tokens, chosen, progress=progress) if not sequential else ([], [])
    fitted: list[dict[str, torch.Tensor]] = []
    train_rows = 0
    flush = torch.set_flush_denormal(True)  # subnormal gradients slow CPU training about threefold
    try:
        for i, layer in enumerate(chosen):
            if sequential:  # this layer's inputs with the earlier layers replaced: the rows it meets in use
                earlier = _stacked(model, chosen[:i], k, fitted).interventions() if fitted else []
                layer_ins, layer_outs = mlp_activations(model, tokens, [layer], progress=progress, writes=earlier)
                ins.append(layer_ins[0])
                outs.append(layer_outs[0])
            x, y = ins[i][train][valid[train]], outs[i][train][valid[train]]
            if distinct:
                x, first = _distinct_rows(x)
                y = y[first]
            train_rows = len(x)
            fitted.append(_fit_layer(x, y, n_features, k, steps, batch_size, lr, skip, generator, progress,
                                     f"transcoder L{layer}", encoder_scale, resample_until, min_frequency,
                                     skip_ridge, train_skip))
    finally:
        if flush:
            torch.set_flush_denormal(False)
    seconds = round(time.perf_counter() - start, 1)
    meta = build_meta(model, seed=seed, n_prompts=N, n_held_out=n_test, steps=steps, batch_size=batch_size, lr=lr,
                      skip=skip, encoder_scale=encoder_scale, resample_until=resample_until,
                      min_frequency=min_frequency, skip_ridge=skip_ridge, train_skip=train_skip, distinct=distinct,
                      sequential=sequential, train_rows=train_rows, train_seconds=seconds)
    draft = _stacked(model, chosen, k, fitted, meta)
    layer_rows = []
    for i, layer in enumerate(chosen):
        x, y = ins[i][test][valid[test]], outs[i][test][valid[test]]
        acts = draft.encode(layer, x)
        fired = (acts > 0).any(0)
        y_hat = draft.decode(layer, acts, x)
        later = after_first[test][valid[test]]  # every position but each prompt's first (<bos>)
        layer_rows.append(dict(fvu=round(_fvu(y, y_hat), 5),
                               fvu_after_first=round(_fvu(y[later], y_hat[later]), 5) if bool(later.any()) else None,
                               l0=round(float((acts > 0).sum(-1).float().mean()), 3),
                               dead_fraction=round(1 - float(fired.float().mean()), 5)))
    agrees, kls = compare_replacement(model, draft, tokens[test], n_answer)
    replacement = dict(agreement=round(float(agrees.float().mean()), 5), kl=round(float(kls.mean()), 5),
                       n_positions=agrees.numel())
    return dataclasses.replace(draft, metrics=dict(layers=layer_rows, replacement=replacement))


def _stacked(model: HookedModel, layers: Sequence[int], k: int, fitted: list[dict[str, torch.Tensor]],
             meta: Optional[dict] = None) -> Transcoders:
    """The transcoders of ``layers``, one fitted dict of tensors each, stacked (``meta``: the model's
    provenance alone when None)."""
    tensors: dict[str, Any] = {name: torch.stack([f[name] for f in fitted]) for name in fitted[0]}
    return Transcoders(layers=list(layers), k=k, metrics={}, meta=build_meta(model) if meta is None else meta,
                       **tensors)
