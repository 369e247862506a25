"""Neuron importance: ranking MLP neurons by their effect on the answer (Nikankin et al. 2025).

:func:`importance` scores every neuron of the chosen layers by attribution patching, exact
activation patching or mean ablation of its final-position ``mlp_post`` activation →
:class:`NeuronImportance`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

import numpy as np
import pandas as pd
import torch

from arithinterp import engine
from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.engine.budget import (
    backward_bytes_per_prompt,
    chunk_for,
    forward_logits_bytes_per_prompt,
    memory_budget,
    release_freed_memory,
)
from arithinterp.engine.ablations import DEFAULT_STACK_BYTES
from arithinterp.engine.patches import UNCHANGED
from arithinterp.engine.steppers import final_gradients, read_last
from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.metrics import answer_columns
from arithinterp.neurons.final_reads import (
    check_engine, check_model_layers, check_prompts, final_position_batches, final_reads,
    mean_final_activation, seq_len,
)
from arithinterp.progress import progress_bar
from arithinterp.results import NON_NEGATIVE, Result, build_meta
from arithinterp.sites import hook_name
from arithinterp.types import ByteSize, HookedModel, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs

IMPORTANCE_METHODS = ("attribution", "patching", "mean-ablation")

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
        """Every selected neuron, layer by layer.

        Returns:
            ``(layer, neuron)`` LongTensors [len(layers) * top_k].
        """
        k = self.top.shape[1]
        return torch.tensor(self.layers).repeat_interleave(k), self.top.flatten()

    def top_scores(self) -> torch.Tensor:
        """The selected neurons' scores.

        Returns:
            [len(layers), top_k], best first.
        """
        return self.scores.gather(1, self.top)

    def to_frame(self) -> pd.DataFrame:
        """One row per layer × neuron: score, rank in its layer, whether it is selected.

        Returns:
            A pandas DataFrame.
        """
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
        """The scores per layer (see ``viz.neurons``).

        Args:
            **kwargs: Passed to :func:`arithinterp.viz.neurons.plot_importance`.

        Returns:
            A plotly Figure.
        """
        return draw(self, **kwargs)


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
    method: str = "attribution",
    *,
    layers: Optional[Iterable[int]] = None,
    top_k: Optional[PositiveInt] = 200,
    batch_size: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    engine: str = "auto",
    progress: bool = True,
) -> NeuronImportance:
    """Rank MLP neurons by their effect on the answer (Nikankin et al. 2025).

    The metric is the logit difference clean answer − corrupt answer at the final position.
    Each method is named for what it does to a neuron's final-position ``mlp_post`` activation:

    * ``"attribution"``: attribution patching (Nanda 2023; Syed et al. 2023), effect = gradient
      of the metric on the clean run × (corrupt − clean) activation; works on frozen models.
    * ``"patching"``: exact activation patching: the clean run with the neuron's activation set
      to its value on the corrupt prompt, effect = metric after − before (neurons batched together).
    * ``"mean-ablation"``: the clean run with the neuron's activation set to its mean ablation
      value, :func:`arithinterp.engine.mean_activation` over the clean prompts at the final
      position (the mean over all of them), effect = metric after − before.

    A neuron's score is mean + std over prompts of ``|effect|`` (the paper's mean + std; the
    magnitude *(choice)* so neurons that push either way count), kept as running statistics over
    batches. Returns the top ``top_k`` per layer (``None``: all neurons).

    Args:
        model: the hooked model.
        pairs: ``PromptPairs`` (clean / corrupt prompts with aligned positions).
        layers: layers to score (default all).
        method: ``"attribution"``, ``"patching"`` or ``"mean-ablation"``.
        top_k: neurons kept per layer (``None``: all).
        batch_size: prompts per forward (default: from ``max_memory``).
        max_memory: bytes a batch may use on top of the model
            (:func:`arithinterp.engine.budget.memory_budget`; default from the model's size and the
            machine's available memory).
        engine: for ``"patching"`` and ``"mean-ablation"``: ``"auto"`` (one stacked run per layer
            and block of neurons, resumed at that layer and the final position with the prompts'
            keys and values reused, where the model's blocks can be stepped; else whole forwards),
            ``"stepped"`` (refuse to fall back) or ``"hooks"`` (whole forwards, the reference).
        progress: show a progress bar.

    Returns:
        :class:`NeuronImportance` with ``scores`` ``[len(layers), d_mlp]``.

    Raises:
        ConfigError: an unknown method or engine, or a ``top_k`` out of range.
        AnalysisError: ``pairs`` is not prompt pairs.
    """
    check_belongs(model, "neurons.importance", pairs=pairs)
    if method not in IMPORTANCE_METHODS:
        raise ConfigError(f"unknown importance method {method!r}; accepted: {accepted(IMPORTANCE_METHODS)}")
    check_engine(engine)
    if not hasattr(pairs, "clean") or not hasattr(pairs, "corrupt"):
        raise AnalysisError(f"pairs must be PromptPairs (from prompts.counterfactual()), got {type(pairs).__name__}")
    check_prompts(pairs.clean, "pairs.clean")
    budget = memory_budget(model, max_memory)
    chosen = check_model_layers(model, layers)
    d_mlp = int(model.cfg.d_mlp)
    if top_k is None:
        top_k = d_mlp
    if top_k > d_mlp:  # the type and the lower bound are declared; d_mlp is the model's
        raise ConfigError(f"top_k must be an integer in 1..{d_mlp} (d_mlp) or None, got {top_k}")
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


def _final_metric(logits: torch.Tensor, good: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Logit difference good − bad ``[B]`` from final-position logits ``[B, V]``."""
    rows = torch.arange(len(good))
    return logits[rows, good] - logits[rows, bad]


def _attribution(model, pairs, layers, batch_size, budget, progress) -> Iterator[torch.Tensor]:
    """Attribution-patching effects ``[B, len(layers), d_mlp]`` per batch: the gradient is read by
    the engine at each ``mlp_post``, so frozen models work; from the final position alone resumed
    with gradients where the model can be stepped (:func:`arithinterp.engine.steppers.final_gradients`),
    else from whole forwards (``engine.run(..., metric=...)``)."""
    clean, corrupt = pairs.clean, pairs.corrupt
    d_mlp = int(model.cfg.d_mlp)
    good, bad = clean.answer_tokens[:, 0], corrupt.answer_tokens[:, 0]
    if batch_size is None:
        # the clean run is kept for its backward, and each layer's read point adds four [T, d_mlp]
        # tensors to it (the engine's zero probe, the activation plus probe, the gradient, the reads);
        # the metric reads the final position's logits alone
        T = seq_len(clean)
        per_prompt = backward_bytes_per_prompt(model, T, logit_positions=1) + 4 * 4 * len(layers) * T * d_mlp
        batch_size = chunk_for(budget, per_prompt, "prompt's forward and backward", high=1024)
    batches = list(final_position_batches(clean, batch_size))
    names = [(layer, hook_name("mlp_post", layer)) for layer in layers]
    for idx, tokens, final in progress_bar(batches, desc="attribution", disable=not progress):
        out = torch.zeros(len(idx), len(layers), d_mlp)
        corrupt_tokens = corrupt.unpadded(idx)
        g, b = good[idx], bad[idx]
        stepped = corrupt_read = None  # the final position alone with gradients, the shared prefix computed once
        if bool((final == tokens.shape[1] - 1).all()) and corrupt_tokens.shape == tokens.shape:
            corrupt_read = read_last(model, corrupt_tokens, [name for _, name in names], 1, only_if_shared=False)
        if corrupt_read is not None:
            # the metric reads two columns of the unembedding: their indices among the columns computed
            columns, (g_at, b_at) = answer_columns(g, b)
            stepped = final_gradients(model, tokens, names, lambda logits: _final_metric(logits, g_at, b_at),
                                      columns)
        if stepped is not None and corrupt_read is not None:
            (clean_acts, grads), corrupt_acts = stepped, [corrupt_read[name][:, 0] for _, name in names]
        else:  # whole forwards
            reads = final_reads(layers, final)
            corrupt_acts = engine.run(model, corrupt_tokens, reads=reads, logits="none").reads
            clean_run = engine.run(model, tokens, reads=reads,
                                   metric=lambda logits, g=g, b=b: _final_metric(logits, g, b))
            clean_acts = clean_run.reads
            grads = clean_run.grads if clean_run.grads is not None else [None] * len(reads)  # set with a metric
        for i, (clean_act, grad, corrupt_act) in enumerate(zip(clean_acts, grads, corrupt_acts)):
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
    sequences = _cells_per_forward(model, seq_len(prompts), budget) if batch_size is None else 4096
    block = max(1, batch_size // 8) if batch_size is not None else min(64, sequences)
    jobs = list(final_position_batches(prompts, block))
    bar = progress_bar(total=len(jobs) * len(layers), desc=desc, disable=not progress)
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

                    patch = engine.Write("mlp_post", layer, final.repeat(reps), value=set_neuron)
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
    sequences = _cells_per_forward(model, seq_len(clean), budget) if batch_size is None else 4096
    block = max(1, batch_size // 8) if batch_size is not None else min(64, sequences)
    jobs = list(final_position_batches(clean, block))
    bar = progress_bar(total=len(jobs) * len(layers), desc="patch neurons", disable=not progress)
    with torch.inference_mode():
        for idx, tokens, final in jobs:
            B = len(idx)
            out = torch.zeros(B, len(layers), d_mlp)
            stepper, _ = engine.stepper_for(model, tokens, choice)
            # the logit difference reads two columns of the unembedding: compute those alone
            columns, (g, b) = answer_columns(good[idx], bad[idx])
            runner = engine.PatchRunner(model, stepper, "mlp_post", tokens, corrupt.unpadded(idx), columns=columns)
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
    """``"mean-ablation"``: each neuron set to its mean ablation value over the clean prompts."""
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
    bar = progress_bar(total=len(jobs) * len(layers), desc="mean-ablate neurons", disable=not progress)
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
