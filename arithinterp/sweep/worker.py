"""Running one cell, in whichever process the executor chose: load the model and the task's
prompts (kept for the next cell), seed every random choice, call the analysis."""

from __future__ import annotations

import json
import os
import platform
import random
import time
import traceback
from typing import Any, Callable, Mapping

from arithinterp.errors import ArithInterpError, ConfigError
from arithinterp.sweep.config import Cell, _resolve_path

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
        path = _resolve_path(spec, base)
        _MODELS[key] = load_model(str(path) if not spec.startswith("zoo:") and path.exists() else spec,
                                  device=None if device == "cpu" else _device(device))
    return _MODELS[key]


def build_prompts(model: Any, task: Mapping) -> Any:
    """The task's prompts: the operand grid, a seeded ``limit`` subsample, then ``correct_only``."""
    import torch

    from arithinterp.tasks import arithmetic

    prompts = arithmetic(model, op=task["op"], a=range(*task["a"]), b=range(*task["b"]), template=task["template"],
                         modulus=task["modulus"], answer_digits=task["answer_digits"], few_shot=task["few_shot"],
                         seed=task["seed"])
    if task["limit"] is not None and task["limit"] < len(prompts):
        pick = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(task["seed"]))[: task["limit"]]
        prompts = prompts[pick.sort().values]
    if task["correct_only"]:
        prompts = prompts.correct_only(model)
    return prompts


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
    """Run one cell; returns ``{id, status, seconds, frame, error}`` (never raises for the cell's own errors)."""
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
        error = f"{type(exc).__name__}: {exc}" + ("" if isinstance(exc, ArithInterpError) else "\n" + traceback.format_exc(limit=6))
    return dict(id=cell.id, status=status, seconds=round(time.perf_counter() - start, 4), frame=frame, error=error,
                worker=f"{platform.node()}:{os.getpid()}")


def _job(payload: tuple) -> dict:
    cell, fn, base, device, threads = payload
    if threads:
        import torch

        torch.set_num_threads(threads)
    return run_cell(cell, fn, base, device)
