"""Memory budgets: how many units (prompts, neurons, edge sets) one step may hold at once.

Analyses over many units stream over them in chunks whose size comes from a budget in bytes
(``max_memory=``). The default follows evaluation (:func:`arithinterp.engine.decode.batch_size_for`:
half the model's parameter bytes), with a higher floor (:data:`DEFAULT_FLOOR`), capped at a quarter
of the memory the machine has available now, so a run never plans to take more than the machine
can give. The per-unit costs are estimates (:func:`backward_bytes_per_prompt` and the analyses'
own), checked on the 135M-parameter Llama shape by ``benchmarks/memory.py``.
"""

from __future__ import annotations

import ctypes
import math
from typing import TYPE_CHECKING, Optional, Union

from arithinterp.errors import MemoryBudgetError
from arithinterp.types import byte_size

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

DEFAULT_FLOOR = 2**30  # bytes the default budget always allows (unless the machine has less than 4x that free)

__all__ = ["available_bytes", "backward_bytes_per_prompt", "chunk_for", "forward_bytes_per_prompt",
           "forward_logits_bytes_per_prompt", "held_bytes", "memory_budget", "model_bytes", "release_freed_memory"]


def model_bytes(model: HookedModel) -> int:
    """Bytes of the model's parameters.

    Args:
        model: The hooked model.

    Returns:
        The sum over parameters of elements × element size.
    """
    return sum(p.numel() * p.element_size() for p in model.parameters())


def held_bytes(*values: object) -> int:
    """Bytes of the distinct tensor storages in ``values`` and the tuples, lists, dicts and
    dataclasses inside them (a view shares its base's storage and counts once; modules and other
    objects are not entered).

    Args:
        *values: Tensors, or containers holding them.

    Returns:
        The bytes of the storages found.
    """
    import dataclasses

    import torch

    storages: dict[int, int] = {}
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, (tuple, list)):
            stack += value
        elif isinstance(value, dict):
            stack += value.values()
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            stack += [getattr(value, f.name) for f in dataclasses.fields(value)]
    return sum(storages.values())


def available_bytes() -> Optional[int]:
    """Memory the machine can give now.

    Returns:
        ``MemAvailable`` of ``/proc/meminfo`` in bytes, or ``None`` where it cannot be read.
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_budget(model: HookedModel, max_memory: Union[float, str, None] = None) -> int:
    """Bytes one step of an analysis may use on top of the model.

    Args:
        model: The hooked model.
        max_memory: A size in bytes or with a unit (``"2GiB"``). ``None``: half the model's
            parameter bytes (as evaluation sizes its batches), at least :data:`DEFAULT_FLOOR` (1 GiB:
            one prompt's backward through every receiver of a 135M-parameter model's edge graph
            needs several hundred MB), and at most a quarter of the machine's available memory.

    Returns:
        The budget in bytes.

    Raises:
        ConfigError: ``max_memory`` is not a positive size.
    """
    if max_memory is None:
        budget = max(0.5 * model_bytes(model), DEFAULT_FLOOR)
        free = available_bytes()
        if free is not None:
            budget = min(budget, max(free // 4, 2**26))
        return int(budget)
    return byte_size(max_memory)  # None above: a budget from the model's size and the machine's memory


def chunk_for(budget: int, per_unit: float, what: str, *, fixed: float = 0, high: Optional[int] = None,
              share: float = 1.0) -> int:
    """How many units fit in a share of a memory budget.

    Args:
        budget: The budget in bytes.
        per_unit: The bytes each unit costs.
        what: The unit, for the message (``"prompt"``, ``"edge set"``).
        fixed: Bytes taken whatever the number of units.
        high: The most units to return; ``None`` for no cap.
        share: The fraction of ``budget`` the units may use.

    Returns:
        The number of units, at least 1.

    Raises:
        MemoryBudgetError: Not even one unit fits; the message gives the budget one would need.
    """
    room = budget * share - fixed
    if room < per_unit:
        need = int(math.ceil((fixed + per_unit) / share))
        raise MemoryBudgetError(f"max_memory={budget} bytes is too small: one {what} needs about {need} bytes "
                          f"({need / 2**20:.1f} MiB); give max_memory >= {need} or None for the default budget")
    n = int(room // per_unit)
    return max(1, min(n, high) if high is not None else n)


def forward_bytes_per_prompt(model: HookedModel, seq_len: int) -> int:
    """Rough transient memory of one prompt's forward: residual-width and MLP-width tensors
    per layer plus attention scores (float32). Measured within ~30% on the zoo models.

    Args:
        model: The hooked model.
        seq_len: Tokens in the prompt.

    Returns:
        The estimate in bytes.
    """
    cfg = model.cfg
    per_token = 12 * cfg.d_model + 4 * (cfg.d_mlp or 4 * cfg.d_model) + 3 * cfg.n_heads * seq_len
    return 4 * seq_len * per_token


def backward_bytes_per_prompt(model: HookedModel, seq_len: int, logit_positions: Optional[int] = None) -> int:
    """Rough memory of one prompt's forward kept for a backward pass, plus its logits.

    Every layer's activations stay alive until the backward (the forward's transient,
    :func:`forward_bytes_per_prompt`, once per layer), and the model
    returns float32 logits (and their gradient) at ``logit_positions`` positions.

    Args:
        model: The hooked model.
        seq_len: Tokens in the prompt.
        logit_positions: Positions whose logits are built (a metric of the final one: 1);
            ``None``: every position.

    Returns:
        The estimate in bytes.
    """
    positions = seq_len if logit_positions is None else logit_positions
    return int(model.cfg.n_layers) * forward_bytes_per_prompt(model, seq_len) + 3 * 4 * positions * _vocab(model)


def forward_logits_bytes_per_prompt(model: HookedModel, seq_len: int) -> int:
    """One prompt's transient forward memory including float32 logits at every position.

    Args:
        model: The hooked model.
        seq_len: Tokens in the prompt.

    Returns:
        The estimate in bytes.
    """
    return forward_bytes_per_prompt(model, seq_len) + 2 * 4 * seq_len * _vocab(model)


def _vocab(model: HookedModel) -> int:
    vocab = getattr(model.cfg, "d_vocab_out", -1)
    return int(vocab if vocab and vocab > 0 else model.cfg.d_vocab)


def release_freed_memory() -> None:
    """Return memory that freed tensors left in the C heap to the operating system.

    glibc keeps freed blocks below its mmap threshold in the heap, so after one phase of an
    analysis (an importance pass with its backward) the process keeps that phase's peak and the
    next phase's allocations add to it; measured on the 135M Llama shape, an importance pass left
    1.5 GB resident of which ``malloc_trim`` returned 1 GB. Called between phases, never per batch.
    Elsewhere than glibc this does nothing.
    """
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
