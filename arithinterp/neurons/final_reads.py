"""Reading MLP neurons at the final position: the prompts' batches, the engine's reads, the mean
ablation value, and the checks every neuron analysis shares.

Reads-only forwards (:func:`arithinterp.engine.run` with ``logits="none"``) read ``mlp_post`` at
each prompt's final position, batch by batch, in batches sized from a memory budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch

from arithinterp import engine
from arithinterp import sites as site_lib
from arithinterp.engine.budget import chunk_for, forward_bytes_per_prompt, memory_budget
from arithinterp.engine.steppers import ENGINES
from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.progress import progress_bar
from arithinterp.types import ByteSize, HookedModel

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet


def check_model_layers(model: HookedModel, layers) -> list[int]:
    """The ``mlp_post`` layers asked for, checked against the model.

    Args:
        model: The hooked model.
        layers: Layer indices, or ``None`` for every layer.

    Returns:
        The layers, as a list.

    Raises:
        SiteError: a layer is out of range.
    """
    return site_lib.check_layers(model, "mlp_post", layers)


def final_position_batches(prompts, batch_size: int):
    """The prompts in same-length batches, with their final positions.

    Args:
        prompts: The prompts.
        batch_size: Prompts per batch at most.

    Yields:
        ``(indices [B], unpadded tokens [B, T], final positions [B])`` per batch.
    """
    for group in prompts.length_groups():
        for idx in group.split(batch_size):
            tokens = prompts.unpadded(idx)
            final = prompts.positions["final"][idx] - prompts.offset(idx)
            yield idx, tokens, final


def check_prompts(prompts, name: str = "prompts") -> None:
    """Refuse what is not a non-empty prompt set.

    Args:
        prompts: What was passed.
        name: The argument's name, for the message.

    Raises:
        AnalysisError: ``prompts`` is not a non-empty PromptSet.
    """
    if not all(hasattr(prompts, attr) for attr in ("tokens", "a", "b", "answer_tokens", "positions")):
        raise AnalysisError(
            f"{name} must be a PromptSet from arithinterp.tasks.arithmetic, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise AnalysisError(f"{name} is empty")


def seq_len(prompts) -> int:
    """The prompts' padded token length.

    Args:
        prompts: The prompts.

    Returns:
        ``T`` of ``prompts.tokens [N, T]``.
    """
    return int(prompts.tokens.shape[1])


def read_batch_size(model: HookedModel, prompts, layers: Sequence[int], budget: int, batch_size: Optional[int],
                    share: float = 1.0) -> int:
    """Prompts per reads-only forward in ``share`` of ``budget``: the forward's transient plus the
    ``mlp_post`` rows read (a reads-only forward never runs the unembedding, even for a read at the
    last layer: :func:`arithinterp.engine.run` with ``logits="none"``).

    Args:
        model: The hooked model.
        prompts: The prompts.
        layers: The layers read.
        budget: Bytes available.
        batch_size: A fixed batch size (returned as is), or ``None``.
        share: The share of ``budget`` the forwards may use.

    Returns:
        Prompts per forward.
    """
    if batch_size is not None:
        return batch_size
    T = seq_len(prompts)
    per_prompt = forward_bytes_per_prompt(model, T) + 3 * 4 * len(layers) * int(model.cfg.d_mlp)
    return chunk_for(budget, per_prompt, "prompt's forward", high=1024, share=share)


def check_engine(engine: str) -> str:
    """Refuse an unknown engine choice.

    Args:
        engine: ``"auto"``, ``"stepped"`` or ``"hooks"``.

    Returns:
        ``engine``, unchanged.

    Raises:
        ConfigError: ``engine`` is unknown.
    """
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; accepted: {accepted(ENGINES)}")
    return engine


def final_reads(layers: Sequence[int], final: torch.Tensor) -> list:
    """The engine's reads of ``mlp_post`` at each prompt's final position.

    Args:
        layers: The layers read.
        final: Each prompt's final position, long [B].

    Returns:
        The reads, one :class:`arithinterp.engine.Read` per layer.
    """
    return [engine.Read("mlp_post", layer, final) for layer in layers]


def final_batches(model, prompts, layers: list[int], batch_size: int, progress: bool,
                   desc: str = "activations") -> Iterator[tuple[torch.Tensor, list]]:
    """``mlp_post`` at the final position, batch by batch.

    Args:
        model: The hooked model.
        prompts: The prompts.
        layers: The layers read.
        batch_size: Prompts per forward.
        progress: Show a progress bar.
        desc: The progress bar's label.

    Yields:
        ``(indices [B], [mlp_post [B, d_mlp] per layer])``.
    """
    batches = list(final_position_batches(prompts, batch_size))
    with torch.inference_mode():
        for idx, tokens, final in progress_bar(batches, desc=desc, disable=not progress):
            reads = engine.run(model, tokens, reads=final_reads(layers, final), logits="none").reads
            yield idx, [read.float().cpu() for read in reads]


def final_activations(
    model: HookedModel, prompts, layers: list[int], batch_size: Optional[int] = None, progress: bool = False, *,
    max_memory: Optional[ByteSize] = None,
) -> torch.Tensor:
    """``mlp_post`` at the final position (reads of the engine).

    Args:
        model: The hooked model.
        prompts: The prompts (P of them).
        layers: The layers read.
        batch_size: Prompts per forward; ``None`` sizes it from ``max_memory``.
        progress: Show a progress bar.
        max_memory: Bytes a batch may use on top of the model.

    Returns:
        [P, len(layers), d_mlp].
    """
    batch_size = read_batch_size(model, prompts, layers, memory_budget(model, max_memory), batch_size)
    out = torch.zeros(len(prompts), len(layers), int(model.cfg.d_mlp))
    for idx, reads in final_batches(model, prompts, layers, batch_size, progress):
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

    Args:
        model: The hooked model.
        prompts: The reference prompts.
        layers: The layers read.
        batch_size: Prompts per forward; ``None`` sizes it from ``max_memory``.
        max_memory: Bytes a batch may use on top of the model.

    Returns:
        [len(layers), d_mlp].
    """
    layers = list(layers)
    batch_size = read_batch_size(model, prompts, layers, memory_budget(model, max_memory), batch_size)
    mean = engine.RunningMean()
    for _, reads in final_batches(model, prompts, layers, batch_size, False):
        mean.add(torch.stack(reads, 1)[:, None])  # a one-position frame: the final position
    return mean.value()[0]
