"""Running the model: neuron importance, K / KV maps over the operand grid, and classification of
a model's important neurons."""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from arithinterp.checks import check_belongs, integer
from arithinterp import engine
from arithinterp.engine.budget import (
    backward_bytes_per_prompt,
    chunk_for,
    forward_bytes_per_prompt,
    forward_logits_bytes_per_prompt,
    memory_budget,
    release_freed_memory,
)
from arithinterp.engine.patches import UNCHANGED
from arithinterp.engine.ablations import DEFAULT_STACK_BYTES
from arithinterp.engine.steppers import ENGINES
from arithinterp import sites as site_lib
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.neurons.scoring import check_threshold, classify_maps, classify_stream
from arithinterp.neurons.table import HeuristicTable
from arithinterp.results import NON_NEGATIVE, Result, build_meta
from arithinterp.types import ByteSize, HookedModel, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs, PromptSet

IMPORTANCE_METHODS = ("attribution", "patching", "mean_ablation")
# old name -> the method it always was ("ablation" patched in the corrupt value; it never ablated)
_DEPRECATED_METHODS = {"ablation": "patching"}


# --- results -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NeuronImportance(Result):
    """Per-neuron importance for the answer, per layer (Nikankin et al. 2025).

    ``scores`` is ``[len(layers), d_mlp]``: mean + std over prompts of the per-prompt effect
    magnitude. ``top`` is ``[len(layers), top_k]``: the top-k neurons of each layer, best first.
    """

    layers: list
    scores: torch.Tensor
    top: torch.Tensor
    method: str
    meta: dict = dataclasses.field(default_factory=dict)

    # what load checks: the axes fields share and the values they may take
    _shapes = {"layers": "layer", "scores": "layer neuron", "top": "layer top"}
    _legal = {"layers": NON_NEGATIVE, "top": NON_NEGATIVE}

    def neurons(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(layer, neuron)`` LongTensors of every selected neuron, layer by layer."""
        k = self.top.shape[1]
        return torch.tensor(self.layers).repeat_interleave(k), self.top.flatten()

    def top_scores(self) -> torch.Tensor:
        return self.scores.gather(1, self.top)

    def to_frame(self) -> pd.DataFrame:
        L, D = self.scores.shape
        rank = torch.empty_like(self.scores, dtype=torch.long)
        rank.scatter_(1, torch.argsort(self.scores, dim=1, descending=True), torch.arange(D).expand(L, D))
        return pd.DataFrame(
            dict(
                layer=np.repeat(self.layers, D),
                neuron=np.tile(np.arange(D), L),
                score=self.scores.flatten().numpy(),
                rank=rank.flatten().numpy(),
                selected=(rank < self.top.shape[1]).flatten().numpy(),
            )
        )

    def plot(self, **kwargs):
        from arithinterp.viz import neurons as viz

        return viz.plot_importance(self, **kwargs)


@dataclasses.dataclass(frozen=True)
class NeuronMaps(Result):
    """K and KV maps of neurons over an operand grid (Nikankin et al. 2025).

    ``k_maps`` / ``kv_maps`` are ``[N, A, B]`` (NaN where the grid has no prompt); rows follow
    ``a_values``, columns ``b_values``; ``layer`` / ``neuron`` ([N]) name the neurons.
    """

    layer: torch.Tensor
    neuron: torch.Tensor
    a_values: list
    b_values: list
    k_maps: torch.Tensor
    kv_maps: torch.Tensor
    op: str
    modulus: Optional[int]
    meta: dict = dataclasses.field(default_factory=dict)

    # what load checks: the axes fields share and the values they may take
    _shapes = {"layer": "map", "neuron": "map", "a_values": "a", "b_values": "b", "k_maps": "map a b",
               "kv_maps": "map a b"}
    _legal = {"layer": NON_NEGATIVE, "neuron": NON_NEGATIVE}

    def to_frame(self) -> pd.DataFrame:
        N, A, B = self.k_maps.shape
        return pd.DataFrame(
            dict(
                layer=self.layer.repeat_interleave(A * B).numpy(),
                neuron=self.neuron.repeat_interleave(A * B).numpy(),
                a=np.tile(np.repeat(self.a_values, B), N),
                b=np.tile(np.tile(self.b_values, A), N),
                k=self.k_maps.flatten().numpy(),
                kv=self.kv_maps.flatten().numpy(),
            )
        )

    def plot(self, index: int = 0, kind: str = "both", **kwargs):
        """Heatmaps of row ``index``'s maps over (a, b); ``kind``: ``"K"``, ``"KV"`` or ``"both"``."""
        from arithinterp.viz import neurons as viz

        return viz.plot_maps(self, index=index, kind=kind, **kwargs)

    def classify(self, threshold: float = 0.6, **kwargs) -> HeuristicTable:
        """:func:`classify_maps` on these maps."""
        return classify_maps(
            self.k_maps, self.kv_maps, self.a_values, self.b_values, self.op, threshold,
            modulus=self.modulus, layers=self.layer, neurons=self.neuron, meta=dict(self.meta), **kwargs,
        )


# --- running the model ---------------------------------------------------------------------------


def _check_model_layers(model: HookedModel, layers) -> list[int]:
    return site_lib.check_layers(model, "mlp_post", layers)


def final_position_batches(prompts, batch_size: int):
    """(indices, unpadded tokens, final positions) per same-length batch."""
    batch_size = integer("batch_size", batch_size, minimum=1)
    for group in prompts.length_groups():
        for idx in group.split(batch_size):
            tokens = prompts.unpadded(idx)
            final = prompts.positions["final"][idx] - prompts.offset(idx)
            yield idx, tokens, final


def check_prompts(prompts, name: str = "prompts") -> None:
    if not all(hasattr(prompts, attr) for attr in ("tokens", "a", "b", "answer_tokens", "positions")):
        raise AnalysisError(
            f"{name} must be a PromptSet from arithinterp.tasks.arithmetic, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise AnalysisError(f"{name} is empty")


def _seq_len(prompts) -> int:
    return int(prompts.tokens.shape[1])


def _read_batch(model: HookedModel, prompts, layers: Sequence[int], budget: int, batch_size: Optional[int],
                share: float = 1.0) -> int:
    """Prompts per reads-only forward in ``share`` of ``budget``: the forward's transient plus the
    ``mlp_post`` rows read (a reads-only forward never runs the unembedding, even for a read at the
    last layer: :func:`arithinterp.engine.run` with ``logits="none"``)."""
    if batch_size is not None:
        return batch_size
    T = _seq_len(prompts)
    per_prompt = forward_bytes_per_prompt(model, T) + 3 * 4 * len(layers) * int(model.cfg.d_mlp)
    return chunk_for(budget, per_prompt, "prompt's forward", high=1024, share=share)


class _Moments:
    """Running mean and (unbiased) standard deviation over prompts of ``[B, ...]`` batches, in
    float64 (Chan et al.'s pairwise update), so no ``[prompts, ...]`` grid is kept."""

    def __init__(self) -> None:
        self.n = 0
        self.mean: Optional[torch.Tensor] = None
        self.m2: Optional[torch.Tensor] = None

    def add(self, batch: torch.Tensor) -> None:
        x = batch.double()
        n_b = x.shape[0]
        mean_b = x.mean(0)
        m2_b = ((x - mean_b) ** 2).sum(0)
        if self.mean is None or self.m2 is None:
            self.n, self.mean, self.m2 = n_b, mean_b, m2_b
            return
        n = self.n + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta**2 * (self.n * n_b / n)
        self.n = n

    def mean_plus_std(self) -> torch.Tensor:
        assert self.mean is not None and self.m2 is not None  # at least one batch was added
        std = (self.m2 / (self.n - 1)).sqrt() if self.n > 1 else torch.zeros_like(self.mean)
        return (self.mean + std).float()


@checked
def importance(
    model: HookedModel,
    pairs: PromptPairs,
    layers: Optional[Iterable[int]] = None,
    method: str = "attribution",
    top_k: Optional[int] = 200,
    *,
    batch_size: Optional[int] = None,
    max_memory: Optional[ByteSize] = None,
    engine: str = "auto",
    progress: bool = False,
) -> NeuronImportance:
    """Rank MLP neurons by their effect on the answer (Nikankin et al. 2025).

    The metric is the logit difference clean answer − corrupt answer at the final position.
    Each method is named for what it does to a neuron's final-position ``mlp_post`` activation:

    * ``"attribution"``: attribution patching (Nanda 2023; Syed et al. 2023), effect = gradient
      of the metric on the clean run × (corrupt − clean) activation; works on frozen models.
    * ``"patching"``: exact activation patching: the clean run with the neuron's activation set
      to its value on the corrupt prompt, effect = metric after − before (neurons batched together).
    * ``"mean_ablation"``: the clean run with the neuron's activation set to its mean ablation
      value, :func:`arithinterp.engine.mean_activation` over the clean prompts at the final
      position (the mean over all of them), effect = metric after − before.

    ``"ablation"`` is a deprecated name of ``"patching"`` (it always patched in the corrupt value).

    A neuron's score is mean + std over prompts of ``|effect|`` (the paper's mean + std; the
    magnitude *(choice)* so neurons that push either way count), kept as running statistics over
    batches. Returns the top ``top_k`` per layer (``None``: all neurons).

    Args:
        pairs: ``PromptPairs`` (clean / corrupt prompts with aligned positions).
        layers: layers to score (default all).
        batch_size: prompts per forward (default: from ``max_memory``).
        max_memory: bytes a batch may use on top of the model
            (:func:`arithinterp.engine.budget.memory_budget`; default from the model's size and the
            machine's available memory).
        engine: for ``"patching"`` and ``"mean_ablation"``: ``"auto"`` (one stacked run per layer
            and block of neurons, resumed at that layer and the final position with the prompts'
            keys and values reused, where the model's blocks can be stepped; else whole forwards),
            ``"stepped"`` (refuse to fall back) or ``"hooks"`` (whole forwards, the reference).

    Returns :class:`NeuronImportance` with ``scores`` ``[len(layers), d_mlp]``.
    """
    check_belongs(model, "neurons.importance", pairs=pairs)
    if method in _DEPRECATED_METHODS:
        warnings.warn(
            f"importance method {method!r} is deprecated: it patches in the corrupt value; call it "
            f"{_DEPRECATED_METHODS[method]!r} (or use 'mean_ablation' to ablate)", DeprecationWarning, stacklevel=2,
        )
        method = _DEPRECATED_METHODS[method]
    if method not in IMPORTANCE_METHODS:
        raise ConfigError(f"unknown importance method {method!r}; accepted: {accepted(IMPORTANCE_METHODS)}")
    check_engine(engine)
    if not hasattr(pairs, "clean") or not hasattr(pairs, "corrupt"):
        raise AnalysisError(f"pairs must be PromptPairs (from prompts.counterfactual()), got {type(pairs).__name__}")
    check_prompts(pairs.clean, "pairs.clean")
    batch_size = check_batch_size(batch_size)
    budget = memory_budget(model, max_memory)
    chosen = _check_model_layers(model, layers)
    d_mlp = int(model.cfg.d_mlp)
    if top_k is None:
        top_k = d_mlp
    top_k = integer("top_k", top_k, minimum=1, maximum=d_mlp, hint=" (d_mlp) or None")
    if method == "attribution":
        effects = _attribution(model, pairs, chosen, batch_size, budget, progress)
    elif method == "patching":
        effects = _patch_effects(model, pairs, chosen, batch_size, budget, progress, engine)
    else:
        effects = _mean_ablation_effects(model, pairs, chosen, batch_size, budget, progress, engine)
    moments = _Moments()
    for batch in effects:  # [B, L, d_mlp] per batch of prompts
        moments.add(batch.abs())
    release_freed_memory()  # the next phase (maps, scoring) should not add to this one's peak
    scores = moments.mean_plus_std()
    top = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :top_k]
    return NeuronImportance(
        layers=chosen, scores=scores, top=top, method=method,
        meta=build_meta(model, n_pairs=len(pairs), top_k=top_k, vary=getattr(pairs, "vary", None), metric="logit_diff",
                        max_memory=budget),
    )


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; accepted: {accepted(ENGINES)}")
    return engine


def check_batch_size(batch_size: Optional[int]) -> Optional[int]:
    return None if batch_size is None else integer("batch_size", batch_size, minimum=1,
                                                   hint=" or None (sized from max_memory)")


def _final_metric(logits: torch.Tensor, good: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Logit difference good − bad ``[B]`` from final-position logits ``[B, V]``."""
    rows = torch.arange(len(good))
    return logits[rows, good] - logits[rows, bad]


def _final_reads(layers: Sequence[int], final: torch.Tensor) -> list:
    return [engine.Read("mlp_post", layer, final) for layer in layers]


def _attribution(model, pairs, layers, batch_size, budget, progress) -> Iterator[torch.Tensor]:
    """Attribution-patching effects ``[B, len(layers), d_mlp]`` per batch: the gradient is read by
    the engine at each ``mlp_post`` (``engine.run(..., metric=...)``), so frozen models work."""
    clean, corrupt = pairs.clean, pairs.corrupt
    d_mlp = int(model.cfg.d_mlp)
    good, bad = clean.answer_tokens[:, 0], corrupt.answer_tokens[:, 0]
    if batch_size is None:
        # the clean run is kept for its backward, and each layer's read point adds four [T, d_mlp]
        # tensors to it (the engine's zero probe, the activation plus probe, the gradient, the reads)
        T = _seq_len(clean)
        per_prompt = backward_bytes_per_prompt(model, T) + 4 * 4 * len(layers) * T * d_mlp
        batch_size = chunk_for(budget, per_prompt, "prompt's forward and backward", high=1024)
    batches = list(final_position_batches(clean, batch_size))
    for idx, tokens, final in tqdm(batches, desc="attribution", disable=not progress):
        out = torch.zeros(len(idx), len(layers), d_mlp)
        reads = _final_reads(layers, final)
        corrupt_acts = engine.run(model, corrupt.unpadded(idx), reads=reads, logits="none").reads
        g, b = good[idx], bad[idx]
        clean_run = engine.run(model, tokens, reads=reads, metric=lambda logits, g=g, b=b: _final_metric(logits, g, b))
        grads = clean_run.grads if clean_run.grads is not None else [None] * len(reads)  # always set with a metric
        for i, (clean_act, grad, corrupt_act) in enumerate(zip(clean_run.reads, grads, corrupt_acts)):
            if grad is None:  # the metric does not depend on this layer
                continue
            out[:, i] = (grad * (corrupt_act - clean_act)).float().cpu()
        yield out


def _cells_per_forward(model, seq_len: int, budget: int) -> int:
    """Sequences (prompt copies) one stacked forward with logits at every position may hold."""
    return chunk_for(budget, forward_logits_bytes_per_prompt(model, seq_len), "patched sequence", high=4096)


def _replacement_effects(model, prompts, answers, layers, values_for, batch_size, budget, progress,
                         desc) -> Iterator[torch.Tensor]:
    """Effect ``[B, len(layers), d_mlp]`` per batch of setting each neuron's final-position
    ``mlp_post`` on ``prompts`` to ``values_for(idx, final)[i]`` (``[B, d_mlp]`` for layer
    ``layers[i]``): metric after − before, one neuron per sequence, many sequences stacked in one
    :func:`arithinterp.engine.run`. ``answers`` is ``(good, bad)`` answer tokens ``[P]``."""
    d_mlp = int(model.cfg.d_mlp)
    good, bad = answers
    # every (prompt, neuron) patch is its own sequence: batch prompts x a block of neurons
    sequences = _cells_per_forward(model, _seq_len(prompts), budget) if batch_size is None else 4096
    block = max(1, batch_size // 8) if batch_size is not None else min(64, sequences)
    jobs = list(final_position_batches(prompts, block))
    bar = tqdm(total=len(jobs) * len(layers), desc=desc, disable=not progress)
    with torch.inference_mode():
        for idx, tokens, final in jobs:
            out = torch.zeros(len(idx), len(layers), d_mlp)
            rows = torch.arange(len(idx))
            values = values_for(idx, final)
            base_logits = engine.run(model, tokens).logits
            assert base_logits is not None  # the final position's, by default
            base = _final_metric(base_logits, good[idx], bad[idx])
            chunk = max(1, sequences // len(idx))
            for i, layer in enumerate(layers):
                for start in range(0, d_mlp, chunk):
                    neurons = torch.arange(start, min(start + chunk, d_mlp))
                    reps = len(neurons)
                    prow = rows.repeat(reps)
                    pneuron = neurons.repeat_interleave(len(idx))
                    value = values[i][prow, pneuron]

                    def set_neuron(current, pneuron=pneuron, value=value):  # [reps * B, d_mlp] at the final position
                        current = current.clone()
                        every_row = torch.arange(len(current))
                        current[every_row, pneuron.to(current.device)] = value.to(current.device, current.dtype)
                        return current

                    patch = engine.Intervention("mlp_post", layer, final.repeat(reps), value=set_neuron)
                    logits = engine.run(model, tokens.repeat(reps, 1), [patch]).logits
                    assert logits is not None  # the final position's, by default
                    metric = _final_metric(logits, good[idx].repeat(reps), bad[idx].repeat(reps))
                    effect = (metric - base.repeat(reps)).view(reps, len(idx)).T
                    out[:, i, neurons] = effect.float().cpu()
                bar.update(1)
            yield out
    bar.close()


def _patch_effects(model, pairs, layers, batch_size, budget, progress, choice="auto") -> Iterator[torch.Tensor]:
    """``"patching"``: each neuron set to its value on the corrupt prompt, ``[B, len(layers), d_mlp]``
    per batch.

    The engine's stacked patch cells (:class:`arithinterp.engine.PatchRunner`): one cell per
    neuron, resumed from the patched layer at the final position with the clean run's keys and
    values reused (whole forwards, with a warning, where the model cannot be stepped). A neuron
    whose corrupt activation equals its clean one leaves the run unchanged: its effect is 0."""
    clean, corrupt = pairs.clean, pairs.corrupt
    d_mlp = int(model.cfg.d_mlp)
    good, bad = clean.answer_tokens[:, 0], corrupt.answer_tokens[:, 0]
    # a cell may be a whole forward where the model cannot be stepped: size cells as such
    sequences = _cells_per_forward(model, _seq_len(clean), budget) if batch_size is None else 4096
    block = max(1, batch_size // 8) if batch_size is not None else min(64, sequences)
    jobs = list(final_position_batches(clean, block))
    bar = tqdm(total=len(jobs) * len(layers), desc="patch neurons", disable=not progress)
    with torch.inference_mode():
        for idx, tokens, final in jobs:
            B = len(idx)
            out = torch.zeros(B, len(layers), d_mlp)
            stepper, _ = engine.stepper_for(model, tokens, choice)
            runner = engine.PatchRunner(model, stepper, "mlp_post", tokens, corrupt.unpadded(idx))
            g, b = good[idx], bad[idx]
            base = _final_metric(runner.base_logits.float(), g, b)
            chunk = max(1, sequences // B)
            for i, layer in enumerate(layers):
                for start in range(0, d_mlp, chunk):
                    neurons = torch.arange(start, min(start + chunk, d_mlp))
                    pos = final[None].expand(len(neurons), -1).to(runner.tokens.device)
                    unit = neurons.to(runner.tokens.device)
                    changed = runner.cell_states(layer, pos, unit).cpu() != UNCHANGED  # [C, B]
                    run = torch.nonzero(changed.any(1)).flatten()
                    if len(run) == 0:
                        continue
                    logits = runner.patched(layer, pos[run], unit[run]).float()  # [C', B, V]
                    C = len(run)
                    metric = _final_metric(logits.flatten(0, 1), g.repeat(C), b.repeat(C)).view(C, B).cpu()
                    effect = torch.where(changed[run], metric - base.cpu()[None], torch.zeros(()))
                    out[:, i, neurons[run]] = effect.T
                bar.update(1)
            yield out
    bar.close()


def _mean_ablation_effects(model, pairs, layers, batch_size, budget, progress, choice="auto") -> Iterator[torch.Tensor]:
    """``"mean_ablation"``: each neuron set to its mean ablation value over the clean prompts."""
    clean = pairs.clean
    mean = mean_final_activation(model, clean, layers, batch_size, max_memory=budget)  # [L, d_mlp]
    answers = (clean.answer_tokens[:, 0], pairs.corrupt.answer_tokens[:, 0])
    if choice != "hooks":
        first = next(iter(final_position_batches(clean, 1)))[1]
        stepper, _ = engine.stepper_for(model, first, choice, warn=False)
        if stepper is not None:
            return _stacked_ablation_effects(model, clean, answers, layers, mean, batch_size, budget, progress, choice)

    def mean_values(idx, final):
        return [mean[i][None].expand(len(idx), -1) for i in range(len(layers))]

    return _replacement_effects(model, clean, answers, layers, mean_values, batch_size, budget, progress,
                                "mean-ablate neurons")


def _stacked_ablation_effects(model, prompts, answers, layers, mean, batch_size, budget, progress,
                              choice) -> Iterator[torch.Tensor]:
    """:func:`_replacement_effects` with the same value for every prompt (``mean [L, d_mlp]``),
    through the engine's stacked ablations (:class:`arithinterp.engine.AblationRunner`): per batch
    of prompts one base run, then per layer one stack of single-neuron cells, resumed at that layer
    and the final position with the base run's keys and values of the earlier positions."""
    d_mlp = int(model.cfg.d_mlp)
    good, bad = answers
    block = max(1, batch_size // 8) if batch_size is not None else 64
    jobs = list(final_position_batches(prompts, block))
    bar = tqdm(total=len(jobs) * len(layers), desc="mean-ablate neurons", disable=not progress)
    with torch.inference_mode():
        for idx, tokens, final in jobs:
            stepper, _ = engine.stepper_for(model, tokens, choice, warn=False)
            runner = engine.AblationRunner(model, stepper, tokens)
            g, b = good[idx], bad[idx]
            base = _final_metric(runner.base_logits.float(), g, b)

            def effect(logits, g=g, b=b, base=base):  # [c, B, V] -> metric after - before, [c, B]
                c = logits.shape[0]
                metric = _final_metric(logits.flatten(0, 1).float(), g.repeat(c), b.repeat(c)).view(c, -1)
                return (metric - base[None]).cpu()

            out = torch.zeros(len(idx), len(layers), d_mlp)
            for i, layer in enumerate(layers):
                cells = [[engine.Ablation("mlp_post", layer, final, torch.tensor([n]), mean[i])]
                         for n in range(d_mlp)]
                out[:, i] = runner.run(cells, score=effect, max_memory=min(budget, DEFAULT_STACK_BYTES)).T.float()
                bar.update(1)
            yield out
    bar.close()


def _grid_index(prompts) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    a_vals = torch.unique(prompts.a)
    b_vals = torch.unique(prompts.b)
    ai = torch.searchsorted(a_vals, prompts.a)
    bi = torch.searchsorted(b_vals, prompts.b)
    return a_vals.tolist(), b_vals.tolist(), ai, bi


def _neuron_index(model: HookedModel, neurons) -> tuple[torch.Tensor, torch.Tensor]:
    """``neurons``: a NeuronImportance, a (layers, indices) pair, or ``[N, 2]`` (layer, neuron)."""
    if isinstance(neurons, NeuronImportance):
        layer, neuron = neurons.neurons()
    elif isinstance(neurons, tuple) and len(neurons) == 2:
        layer, neuron = (torch.as_tensor(x).long().flatten() for x in neurons)
    else:
        t = torch.as_tensor(neurons).long()
        if t.ndim != 2 or t.shape[1] != 2:
            raise SiteError(
                "neurons must be a NeuronImportance, a (layers, indices) pair or an [N, 2] tensor of "
                f"(layer, neuron); got shape {tuple(t.shape)}"
            )
        layer, neuron = t[:, 0], t[:, 1]
    if layer.shape != neuron.shape or layer.numel() == 0:
        raise SiteError("neurons must name at least one (layer, neuron) pair, with as many layers as indices")
    site_lib.check_layers(model, "mlp_post", sorted(set(layer.tolist())))
    d_mlp = int(model.cfg.d_mlp)
    if (neuron < 0).any() or (neuron >= d_mlp).any():
        raise SiteError(f"neuron indices must be in 0..{d_mlp - 1} (d_mlp = {d_mlp})")
    return layer, neuron


def _final_batches(model, prompts, layers: list[int], batch_size: int, progress: bool,
                   desc: str = "activations") -> Iterator[tuple[torch.Tensor, list]]:
    """``(indices, [mlp_post [B, d_mlp] per layer])`` at the final position, batch by batch."""
    batches = list(final_position_batches(prompts, batch_size))
    with torch.inference_mode():
        for idx, tokens, final in tqdm(batches, desc=desc, disable=not progress):
            reads = engine.run(model, tokens, reads=_final_reads(layers, final), logits="none").reads
            yield idx, [read.float().cpu() for read in reads]


def final_activations(
    model: HookedModel, prompts, layers: list[int], batch_size: Optional[int] = None, progress: bool = False, *,
    max_memory: Optional[ByteSize] = None,
) -> torch.Tensor:
    """``mlp_post`` at the final position: [P, len(layers), d_mlp] (reads of the engine)."""
    batch_size = _read_batch(model, prompts, layers, memory_budget(model, max_memory), batch_size)
    out = torch.zeros(len(prompts), len(layers), int(model.cfg.d_mlp))
    for idx, reads in _final_batches(model, prompts, layers, batch_size, progress):
        for i, read in enumerate(reads):
            out[idx, i] = read
    return out


def mean_final_activation(
    model: HookedModel, prompts: PromptSet, layers: Sequence[int], batch_size: Optional[int] = None, *,
    max_memory: Optional[ByteSize] = None,
) -> torch.Tensor:
    """The mean ablation value of ``mlp_post`` at the final position, ``[len(layers), d_mlp]``.

    :class:`arithinterp.engine.RunningMean` (the running form of the one definition,
    :func:`arithinterp.engine.mean_activation`: per position counted from the end of the prompt)
    of ``prompts``' final-position activations, batch by batch; every prompt has a final position,
    so this is the mean over all of ``prompts``.
    """
    layers = list(layers)
    batch_size = _read_batch(model, prompts, layers, memory_budget(model, max_memory), batch_size)
    mean = engine.RunningMean()
    for _, reads in _final_batches(model, prompts, layers, batch_size, False):
        mean.add(torch.stack(reads, 1)[:, None])  # a one-position frame: the final position
    return mean.value()[0]


def _answer_values(model: HookedModel, layer: torch.Tensor, neuron: torch.Tensor,
                   answers: torch.Tensor) -> torch.Tensor:
    """``(W_out[neuron] @ W_U)[:, answers]`` ``[N, len(answers)]``: each neuron's logit-lens value for
    the answer tokens only (never the ``[N, d_vocab]`` product)."""
    with torch.inference_mode():
        W_U = model.W_U.detach()[:, answers].float()  # [d_model, U]
        layers = torch.unique(layer).tolist()
        try:  # one layer's weight at a time where blocks expose it, else the stacked [n_layers, d_mlp, d_model]
            W_outs = {l: model.blocks[l].mlp.W_out for l in layers}
        except AttributeError:
            stacked = model.W_out
            W_outs = {l: stacked[l] for l in layers}
        out = torch.empty(len(layer), len(answers))
        for l in layers:
            rows = torch.nonzero(layer == l).flatten()
            out[rows] = W_outs[l].detach()[neuron[rows]].float() @ W_U
    return out


class _MapRows:
    """K and KV maps ``[n, A, B]`` of any rows of a neuron list.

    The final-position activations of a group of rows (``[rows, prompts]``: as many rows as fit
    ``buffer_share`` of the budget, at least the rows asked for) come from one pass of reads-only
    forwards over ``prompts`` that read only those rows' layers (batches in ``forward_share``);
    later requests inside the group are served from it, so every neuron of a model usually costs
    one pass over the prompts, not one per chunk.
    """

    def __init__(self, model, prompts, layer: torch.Tensor, neuron: torch.Tensor, batch_size: Optional[int],
                 budget: int, progress: bool = False, forward_share: float = 1.0, buffer_share: float = 0.0):
        self.model, self.prompts, self.layer, self.neuron = model, prompts, layer, neuron
        self.batch_size, self.budget, self.progress, self.forward_share = batch_size, budget, progress, forward_share
        self.group = int(buffer_share * budget // (4 * len(prompts)))  # rows whose activations one pass keeps
        self.a_values, self.b_values, self.ai, self.bi = _grid_index(prompts)
        answer = prompts.answer_tokens[:, 0]
        tokens, inverse = torch.unique(answer, return_inverse=True)
        self.value = _answer_values(model, layer, neuron, tokens)  # [N, U]
        self.answer_cell = torch.zeros(len(self.a_values), len(self.b_values), dtype=torch.long)
        self.answer_cell[self.ai, self.bi] = inverse
        self.present = torch.zeros(len(self.a_values), len(self.b_values), dtype=torch.bool)
        self.present[self.ai, self.bi] = True
        self._rows = (0, 0)
        self._acts = torch.empty(0, len(prompts))

    def _read(self, start: int, stop: int) -> torch.Tensor:
        """``mlp_post`` at the final position of rows ``start:stop``: ``[stop - start, prompts]``."""
        layer, neuron = self.layer[start:stop], self.neuron[start:stop]
        layers = sorted(set(layer.tolist()))
        acts = torch.empty(stop - start, len(self.prompts))
        batch = _read_batch(self.model, self.prompts, layers, self.budget, self.batch_size, self.forward_share)
        desc = f"mlp_post, layers {layers[0]}-{layers[-1]}"
        for idx, reads in _final_batches(self.model, self.prompts, layers, batch, self.progress, desc):
            for read, l in zip(reads, layers):
                rows = torch.nonzero(layer == l).flatten()
                acts[rows[:, None], idx[None]] = read[:, neuron[rows]].T
        release_freed_memory()  # the forwards' batches are done; the scoring should not add to their peak
        if not bool(torch.isfinite(acts).all()):
            where = int(layer[torch.nonzero(~torch.isfinite(acts).all(1)).flatten()[0]])
            raise AnalysisError(f"layer {where}'s mlp_post activations are not finite (NaN or inf) on some prompts: "
                                "the model's weights or activations are broken; no map can be scored")
        return acts

    def __call__(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self._rows
        if not lo <= start < stop <= hi:
            hi = max(stop, min(len(self.layer), start + self.group))
            self._acts = torch.empty(0)  # the old group goes before the new one is read
            self._acts, self._rows = self._read(start, hi), (start, hi)
            lo = start
        acts = self._acts[start - lo:stop - lo]
        n, A, B = stop - start, len(self.a_values), len(self.b_values)
        k_maps = torch.full((n, A, B), float("nan"))
        k_maps[:, self.ai, self.bi] = acts
        value = self.value[start:stop].gather(1, self.answer_cell.flatten()[None].expand(n, -1))  # [n, A * B]
        kv_maps = k_maps * value.view(n, A, B)
        return k_maps, kv_maps


@checked
def maps(
    model: HookedModel, prompts: PromptSet, neurons: Any, *, batch_size: Optional[int] = None,
    max_memory: Optional[ByteSize] = None, progress: bool = False,
) -> NeuronMaps:
    """K and KV maps of neurons over the operand grid of ``prompts`` (Nikankin et al. 2025).

    K map: the neuron's ``mlp_post`` at the final position for each (a, b). KV map: K ×
    ``(W_out[neuron] @ W_U)[answer token]``, the neuron's direct logit-lens contribution to the
    true answer's (first) token. Grid cells with no prompt (e.g. dropped by ``correct_only``) are
    NaN. Works for any operator: the grid is the sorted unique ``prompts.a`` × ``prompts.b``.
    The maps are filled batch by batch (no ``[prompts, layers, d_mlp]`` grid is kept); forwards
    are sized from ``max_memory`` (bytes on top of the model and the returned maps) unless
    ``batch_size`` is given.

    Args:
        prompts: a PromptSet from :func:`arithinterp.tasks.arithmetic` covering a grid.
        neurons: a :class:`NeuronImportance` (its top-k), a ``(layers, indices)`` pair or an
            ``[N, 2]`` tensor of (layer, neuron).
    """
    check_belongs(model, "neurons.maps", prompts=prompts)
    check_prompts(prompts)
    batch_size = check_batch_size(batch_size)
    budget = memory_budget(model, max_memory)
    layer, neuron = _neuron_index(model, neurons)
    rows = _MapRows(model, prompts, layer, neuron, batch_size, budget, progress)
    k_maps, kv_maps = rows(0, len(layer))
    missing = int((~rows.present).sum())
    return NeuronMaps(
        layer=layer, neuron=neuron, a_values=rows.a_values, b_values=rows.b_values, k_maps=k_maps, kv_maps=kv_maps,
        op=prompts.op, modulus=prompts.modulus,
        meta=build_meta(model, n_prompts=len(prompts), missing_cells=missing, op=prompts.op, template=prompts.template),
    )


@checked
def classify(
    model: HookedModel,
    prompts: PromptSet,
    layers: Optional[Iterable[int]] = None,
    top_k: Optional[int] = 200,
    threshold: float = 0.6,
    *,
    importance_scores: Optional[NeuronImportance] = None,
    pairs: Optional[PromptPairs] = None,
    method: str = "attribution",
    vary: str = "a",
    bottom: Optional[bool] = None,
    families: Optional[Sequence[str]] = None,
    min_cells: int = 3,
    max_fraction: float = 0.5,
    fdr: Optional[float] = 0.05,
    shuffle_control: bool = True,
    registry: Any = None,
    seed: int = 0,
    batch_size: Optional[int] = None,
    max_memory: Optional[ByteSize] = None,
    progress: bool = False,
) -> HeuristicTable:
    """Classify a model's important MLP neurons into heuristics (Nikankin et al. 2025).

    Runs :func:`importance` (unless ``top_k`` is None — all neurons — or ``importance_scores``
    is given) on ``pairs`` (default ``prompts.counterfactual(vary, seed, distinct_first_token=True)``: pairs
    whose answers share their first token would score 0), then the maps and
    :func:`classify_maps`'s scoring (``fdr``, ``shuffle_control`` and ``registry`` are passed on:
    a label needs the 0.6 threshold and the cell-shuffle test at that false-discovery rate).
    ``bottom`` defaults to ``model.cfg.gated_mlp``.

    Memory: the neurons are streamed in chunks (a multiple of 128 neurons, layer after layer):
    each chunk's maps are read from reads-only forwards over ``prompts`` and scored, and only the
    table's ``[neurons, heuristics]`` scores are kept, so no ``[prompts, layers, d_mlp]`` grid or
    ``[neurons, vocabulary]`` product exists. Chunks and forward batches are sized from
    ``max_memory`` (bytes on top of the model and the table;
    :func:`arithinterp.engine.budget.memory_budget` by default); ``batch_size`` fixes the prompts
    per forward instead. The table is the same whatever the chunking.
    """
    check_belongs(model, "neurons.classify", prompts=prompts, pairs=pairs)
    check_prompts(prompts)
    threshold = check_threshold(threshold)
    batch_size = check_batch_size(batch_size)
    budget = memory_budget(model, max_memory)
    chosen = _check_model_layers(model, layers)
    if importance_scores is None and top_k is not None:
        # partners whose answer starts with another token: a pair sharing the first answer token has a
        # first-token logit difference of 0 and would rank nothing (a third of 2-digit sums share a tens digit)
        pairs = pairs if pairs is not None else prompts.counterfactual(vary=vary, seed=seed, distinct_first_token=True)
        importance_scores = importance(model, pairs, chosen, method=method, top_k=top_k, batch_size=batch_size,
                                       max_memory=budget, progress=progress)
    if importance_scores is not None:
        missing = [l for l in chosen if l not in importance_scores.layers]
        if missing:
            raise ConfigError(
                f"importance_scores has no scores for layers {missing}; it covers {importance_scores.layers}")
        rows = [importance_scores.layers.index(l) for l in chosen]
        top = importance_scores.top[rows]
        layer = torch.tensor(chosen).repeat_interleave(top.shape[1])
        neuron = top.flatten()
        imp = importance_scores.scores[rows].gather(1, top).flatten()
    else:
        d_mlp = int(model.cfg.d_mlp)
        layer = torch.tensor(chosen).repeat_interleave(d_mlp)
        neuron = torch.arange(d_mlp).repeat(len(chosen))
        imp = None
    # a quarter of the budget for the forwards' batches, half for the activations of the neurons
    # whose maps are read in one pass, a quarter for the maps and scores of one chunk of neurons
    source = _MapRows(model, prompts, layer, neuron, batch_size, budget, progress, forward_share=0.25,
                      buffer_share=0.5)
    if bottom is None:
        bottom = bool(getattr(model.cfg, "gated_mlp", False))
    missing_cells = int((~source.present).sum())
    return classify_stream(
        source, len(layer), source.a_values, source.b_values, prompts.op, threshold, legal=source.present,
        max_memory=budget, memory_share=0.25,
        modulus=prompts.modulus, families=families, bottom=bottom, min_cells=min_cells, max_fraction=max_fraction,
        layers=layer, neurons=neuron, importance=imp, seed=seed, progress=progress,
        fdr=fdr, shuffle_control=shuffle_control, registry=registry,
        meta=build_meta(model, n_prompts=len(prompts), top_k=top_k, method=method if imp is not None else None,
                        missing_cells=missing_cells, max_memory=budget),
    )
