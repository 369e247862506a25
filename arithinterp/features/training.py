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
from typing import Annotated, Any, Optional, Sequence, Union

import torch
from pydantic import Field

from arithinterp import sites as site_lib
from arithinterp.checks import check_belongs
from arithinterp.engine import Read, Write, run
from arithinterp.engine.budget import memory_budget
from arithinterp.engine.decode import batch_size_for
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.features.replacement import replacement_metrics
from arithinterp.features.rows import answer_sequences, read_layers
from arithinterp.features.transcoder import Transcoders
from arithinterp.progress import progress_bar
from arithinterp.results import build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import (
    Accepts, ByteSize, IntList, NonNegativeFiniteFloat, NonNegativeInt, OpenUnitFloat, PositiveFiniteFloat,
    PositiveFloat32, PositiveInt, Probability, HookedModel, Seed, checked,
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
        W_enc, b_enc, W_dec = tensors["W_enc"], tensors["b_enc"], tensors["W_dec"]
        pre = xb @ W_enc + b_enc
        values, index = torch.relu(pre).topk(k, dim=-1)  # TopK: [B, k]
        # decoded from the k chosen rows alone (a dense product with the mostly-zero activations, and
        # its backward, cost F / k times as much)
        y_hat = torch.nn.functional.embedding_bag(index, W_dec, per_sample_weights=values, mode="sum")
        y_hat = y_hat + tensors["b_dec"]
        if skip:  # a product with zeros costs as much as the encoder's
            y_hat = y_hat + xb @ tensors["W_skip"]
        error = yb - y_hat
        scale = ((yb - yb.mean(0)) ** 2).sum(-1).mean().clamp_min(1e-12)
        loss = (error**2).sum(-1).mean() / scale
        fired = torch.zeros(n_features, dtype=torch.bool)
        fired[index[values.detach() > 0]] = True
        since_fired = torch.where(fired, torch.zeros_like(since_fired), since_fired + 1)
        frequency = 0.99 * frequency + 0.01 * torch.bincount(index[values.detach() > 0].reshape(-1),
                                                             minlength=n_features) / len(xb)
        rare = (frequency / (1 - 0.99 ** (step + 1)) < min_frequency) & (step >= 20)
        dead = (since_fired > dead_after) | rare
        if bool(dead.any()):  # AuxK: the dead features reconstruct the remaining error
            where = dead.nonzero().squeeze(1)
            aux_pre = xb @ W_enc[:, where] + b_enc[where]  # the dead features' alone
            top, at = aux_pre.topk(min(k_aux, len(where)), dim=-1)
            aux = torch.zeros_like(aux_pre).scatter(-1, at, top)
            aux_error = error.detach() - aux @ W_dec[where]
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
                      held_out: Union[OpenUnitFloat, PromptSet] = 0.1, seed: Seed = 0,
                      encoder_scale: PositiveFiniteFloat = 0.1,
                      resample_until: Probability = 0.0, min_frequency: Frequency = 1e-3,
                      skip_ridge: NonNegativeFiniteFloat = 0.0, train_skip: bool = True, distinct: bool = False,
                      sequential: bool = False, end_to_end_steps: NonNegativeInt = 0,
                      end_to_end_lr: PositiveFloat32 = 1e-4, anchor: NonNegativeFiniteFloat = 1.0,
                      max_memory: Optional[ByteSize] = None, progress: bool = True) -> Transcoders:
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
        end_to_end_steps: Steps of the end-to-end fine-tune after the layers are fitted (0: none): every
            transcoder trained together on KL(model ‖ replacement model) at the answer positions
            (Braun et al. 2024), plus ``anchor`` × each weight's distance from its layer-wise fit.
        end_to_end_lr: The fine-tune's learning rate.
        anchor: The weight of that distance, which keeps the features what the layer-wise fit made them.
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
    generator = torch.Generator().manual_seed(seed)
    if isinstance(held_out, PromptSet):  # given: every prompt trains, the metrics are on these
        check_belongs(model, "train_transcoders", held_out=held_out)
        train, test = prompts, held_out
    else:  # a seeded share of the prompts
        n_test = max(1, int(round(held_out * len(prompts))))
        if len(prompts) - n_test < 1:
            raise AnalysisError(f"{len(prompts)} prompts are too few to split into training and held-out ones; "
                                "pass at least 2")
        order = torch.randperm(len(prompts), generator=generator)
        train, test = prompts[order[n_test:].sort().values], prompts[order[:n_test].sort().values]
    groups = answer_sequences(train)
    start = time.perf_counter()
    fitted: list[dict[str, torch.Tensor]] = []
    train_rows = 0
    bar = progress_bar(total=len(chosen), desc="transcoders", disable=not progress)

    def on_layer(layer: int, xs: list, ys: list) -> Optional[list]:
        nonlocal train_rows
        x, y = torch.cat([x.reshape(-1, d) for x in xs]), torch.cat([y.reshape(-1, d) for y in ys])
        if distinct:
            x, first = _distinct_rows(x)
            y = y[first]
        train_rows = len(x)
        fitted.append(_fit_layer(x, y, n_features, k, steps, batch_size, lr, skip, generator, False,
                                 f"transcoder L{layer}", encoder_scale, resample_until, min_frequency, skip_ridge,
                                 train_skip))
        bar.update(1)
        if not sequential:
            return None
        one = _stacked(model, [layer], k, fitted[-1:])
        return [one(layer, x) for x in xs]  # what the replacement model's layer writes: the next layers' inputs

    flush = torch.set_flush_denormal(True)  # subnormal gradients slow CPU training about threefold
    try:
        read_layers(model, groups, chosen, on_layer)
        transcoders = _stacked(model, chosen, k, fitted)
        if end_to_end_steps:
            transcoders = _end_to_end(model, transcoders, groups, end_to_end_steps, end_to_end_lr,
                                      batch_size=8, anchor=anchor, generator=generator, progress=progress)
    finally:
        bar.close()
        if flush:
            torch.set_flush_denormal(False)
    seconds = round(time.perf_counter() - start, 1)
    meta = build_meta(model, seed=seed, n_prompts=len(train), n_held_out=len(test), steps=steps,
                      batch_size=batch_size, lr=lr, skip=skip, encoder_scale=encoder_scale,
                      resample_until=resample_until, min_frequency=min_frequency, skip_ridge=skip_ridge,
                      train_skip=train_skip, distinct=distinct, sequential=sequential, train_rows=train_rows,
                      end_to_end_steps=end_to_end_steps, train_seconds=seconds)
    transcoders = dataclasses.replace(transcoders, meta=meta)
    layer_rows = _layer_metrics(model, transcoders, answer_sequences(test), sequential)
    measured = replacement_metrics(model, test, transcoders, progress=False)
    return dataclasses.replace(transcoders, metrics=dict(layers=layer_rows, replacement=measured.as_dict()))


def _layer_metrics(model: HookedModel, transcoders: Transcoders, groups: list, sequential: bool) -> list[dict]:
    """Each layer's held-out metrics (:func:`_held_out_metrics`) on the sequences ``groups``: on the
    inputs of the replacement model whose earlier layers are replaced (``sequential``) or of the
    model itself."""
    rows: list[dict] = []

    def on_layer(layer: int, xs: list, ys: list) -> Optional[list]:
        rows.append(_held_out_metrics(transcoders, layer, xs, ys))
        return [transcoders(layer, x) for x in xs] if sequential else None

    read_layers(model, groups, list(transcoders.layers), on_layer)
    return rows


def _end_to_end(model: HookedModel, transcoders: Transcoders, groups: list, steps: int, lr: float, batch_size: int,
                anchor: float, generator: torch.Generator, progress: bool) -> Transcoders:
    """Fine-tune every layer's transcoder together so the replacement model's answers follow the
    model's: KL(real ‖ replacement) at the positions that predict answer tokens, summed over those
    positions, plus ``anchor`` × the squared distance of each weight from its layer-wise fit
    (relative to that fit's size), which keeps the features what the layer-wise fit made them (as
    end-to-end sparse dictionaries are trained on a model's output, Braun et al. 2024).

    Args:
        model: The hooked model.
        transcoders: The layer-wise fits.
        groups: The training sequences (:func:`~arithinterp.features.rows.answer_sequences`).
        steps: Adam steps.
        lr: Adam's learning rate.
        batch_size: Prompts per step (from one group).
        anchor: The weight of the distance from the layer-wise fit.
        generator: Seeds the batches.
        progress: Show a progress bar.

    Returns:
        The fine-tuned transcoders (metrics left to the caller).
    """
    names = ("W_enc", "b_enc", "W_dec", "b_dec")
    start = {name: getattr(transcoders, name).detach().clone() for name in names}
    params = {name: tensor.clone().requires_grad_(True) for name, tensor in start.items()}
    scale = {name: float((tensor**2).sum()) or 1.0 for name, tensor in start.items()}
    optimiser = torch.optim.Adam(list(params.values()), lr=lr)
    sizes = torch.tensor([len(group.prompts) for group in groups], dtype=torch.float)
    for _ in progress_bar(range(steps), desc="transcoders end to end", disable=not progress):
        group = groups[int(torch.multinomial(sizes, 1, generator=generator))]
        pick = torch.randperm(len(group.prompts), generator=generator)[:batch_size]
        tokens, answer = group.tokens[pick], group.answer_mask()[pick]
        n_last = int(answer.sum(1).max())
        with torch.no_grad():
            real = run(model, tokens, logits=n_last).logits
        assert real is not None
        current = dataclasses.replace(transcoders, **params)
        replaced = run(model, tokens, current.interventions(), logits=n_last, train=True).logits
        assert replaced is not None
        where = answer[:, -n_last:]  # the last n_last positions that predict an answer token
        p_log = real.float().log_softmax(-1)[where]
        q_log = replaced.float().log_softmax(-1)[where]
        kl = (p_log.exp() * (p_log - q_log)).sum(-1).mean()
        drift = sum(((params[name] - start[name]) ** 2).sum() / scale[name] for name in names)
        loss = kl + anchor * drift
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        with torch.no_grad():  # unit decoder rows, as the layer-wise fit keeps them
            params["W_dec"] /= params["W_dec"].norm(dim=-1, keepdim=True).clamp_min(1e-8)
    return dataclasses.replace(transcoders, **{name: p.detach() for name, p in params.items()})


def _held_out_metrics(transcoder: Transcoders, layer: int, xs: list, ys: list) -> dict:
    """FVU (over every position, and after each sequence's first, where a model's ``<bos>`` alone can
    hold most of the variance), L0 and the share of dead features of one layer's transcoder on the
    held-out sequences' MLP inputs ``xs`` and outputs ``ys`` (``[n, pos, d]`` per group)."""
    x = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])
    y = torch.cat([y.reshape(-1, y.shape[-1]) for y in ys])
    later = torch.cat([(torch.arange(x.shape[1]) > 0).expand(x.shape[:2]).reshape(-1) for x in xs])
    acts = transcoder.encode(layer, x)
    y_hat = transcoder.decode(layer, acts, x)
    return dict(fvu=round(_fvu(y, y_hat), 5),
                fvu_after_first=round(_fvu(y[later], y_hat[later]), 5) if bool(later.any()) else None,
                l0=round(float((acts > 0).sum(-1).float().mean()), 3),
                dead_fraction=round(1 - float((acts > 0).any(0).float().mean()), 5))


def _stacked(model: HookedModel, layers: Sequence[int], k: int, fitted: list[dict[str, torch.Tensor]],
             meta: Optional[dict] = None) -> Transcoders:
    """The transcoders of ``layers``, one fitted dict of tensors each, stacked (``meta``: the model's
    provenance alone when None)."""
    tensors: dict[str, Any] = {name: torch.stack([f[name] for f in fitted]) for name in fitted[0]}
    return Transcoders(layers=list(layers), k=k, metrics={}, meta=build_meta(model) if meta is None else meta,
                       **tensors)
