"""Running one cell, in whichever process the executor chose: load the model and the task's
prompts (kept for the next cell), seed every random choice, call the analysis."""

from __future__ import annotations

import json
import os
import platform
import random
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Mapping

from arithinterp.errors import ArithInterpError, ConfigError
from arithinterp.sweep.config import GRID_BUILT_WHOLE, Cell, grid_size, range_length, resolve_path

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

_MODELS: dict = {}
_PROMPTS: dict = {}


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _model(spec: str, base: str, device: str) -> Any:
    """Load a model, keeping the last one (cells run grouped by model, so reloads are rare)."""
    key = (spec, base, device)
    if key not in _MODELS:
        from arithinterp.models import load_model

        _MODELS.clear()
        _PROMPTS.clear()
        path = resolve_path(spec, base)
        _MODELS[key] = load_model(str(path) if not spec.startswith("zoo:") and path.exists() else spec,
                                  device=None if device == "cpu" else _device(device))
    return _MODELS[key]


def build_prompts(model: HookedModel, task: Mapping) -> Any:
    """The task's prompts: the operand grid, a seeded ``limit`` subsample, then ``correct_only``.

    Args:
        model: The hooked model.
        task: A resolved task of the config (``op``, ``a``, ``b``, ``template``, ``few_shot``,
            ``modulus``, ``answer_digits``, ``limit``, ``seed``, ``correct_only``).

    Returns:
        The prompt set.
    """
    import torch

    from arithinterp.tasks import arithmetic

    options = dict(modulus=task["modulus"], answer_digits=task["answer_digits"], seed=task["seed"])
    if task["limit"] is not None and grid_size(task) > max(GRID_BUILT_WHOLE, task["limit"]):
        prompts = _sampled_prompts(model, task, options)
    else:
        prompts = arithmetic(model, op=task["op"], a=range(*task["a"]), b=range(*task["b"]), template=task["template"],
                             few_shot=task["few_shot"], **options)
        if task["limit"] is not None and task["limit"] < len(prompts):
            pick = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(task["seed"]))[: task["limit"]]
            prompts = prompts[pick.sort().values]
    if task["correct_only"]:
        prompts = prompts.correct_only(model)
    return prompts


def _sampled_prompts(model: Any, task: Mapping, options: dict) -> Any:
    """``limit`` distinct pairs of a large grid drawn by index (seeded), never materialising the grid."""
    from arithinterp.tasks import few_shot_prefix, prompts_for_pairs

    a, b = range(*task["a"]), range(*task["b"])
    skip = b.index(0) if task["op"] in ("//", "mod") and 0 in b else None  # b == 0 is undefined there
    width = range_length(b) - (skip is not None)
    rng = random.Random(task["seed"])
    chosen: set = set()
    while len(chosen) < task["limit"]:
        chosen.add(rng.randrange(range_length(a) * width))
    pairs = []
    for index in sorted(chosen):  # grid order, as when the whole grid is built
        row, column = divmod(index, width)
        pairs.append((a[row], b[column + (skip is not None and column >= skip)]))
    prefix = few_shot_prefix(task["few_shot"], task["op"], task["template"], a, b, task["modulus"], task["seed"],
                              task["answer_digits"])
    return prompts_for_pairs(model, task["op"], [p[0] for p in pairs], [p[1] for p in pairs], task["template"],
                             few_shot=prefix, **options)


def _prompts(model: Any, key: tuple, task: dict) -> Any:
    cache_key = (key, json.dumps(task, sort_keys=True))
    if cache_key not in _PROMPTS:
        _PROMPTS[cache_key] = build_prompts(model, task)
    return _PROMPTS[cache_key]


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_cell(cell: Cell, fn: Callable, base: str = ".", device: str = "cpu") -> dict:
    """Run one cell in this process: load the model (cached), build the prompts (cached), seed, run.

    Args:
        cell: The cell.
        fn: Its analysis's function.
        base: The folder relative model paths resolve against.
        device: Where the model runs.

    Returns:
        ``{id, status, seconds, frame, error, worker}``; the cell's own errors are recorded in
        ``error`` (with ``status="failed"``), never raised.
    """
    import pandas as pd
    import torch

    start = time.perf_counter()
    try:
        model = _model(cell.model, base, device)
        prompts = _prompts(model, (cell.model, base, device), cell.task)
        _seed_everything(cell.seed)
        with torch.inference_mode(False):  # an analysis may need gradients (attribution)
            frame = fn(model, prompts, **cell.params)
        if not isinstance(frame, pd.DataFrame):
            raise ConfigError(f"analysis {cell.analysis!r} returned {type(frame).__name__}, not a pandas DataFrame")
        status, error = "done", None
    except Exception as exc:  # a failing cell is recorded and retried on the next run, never fatal
        frame, status = None, "failed"
        trace = "" if isinstance(exc, ArithInterpError) else "\n" + traceback.format_exc(limit=6)
        error = f"{type(exc).__name__}: {exc}" + trace
    return dict(id=cell.id, status=status, seconds=round(time.perf_counter() - start, 4), frame=frame, error=error,
                worker=f"{platform.node()}:{os.getpid()}")


def run_job(payload: tuple) -> dict:
    cell, fn, base, device, threads = payload
    if threads:
        import torch

        torch.set_num_threads(threads)
    return run_cell(cell, fn, base, device)
