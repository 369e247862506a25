"""Running one cell, in whichever process the executor chose: load the model and the task's
prompts (kept for the next cell), seed every random choice, call the analysis; and checking every
cell's parameters against its model and prompts before the first cell runs (:func:`check_cells`)."""

from __future__ import annotations

import inspect
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


def run_cell(cell: Cell, fn: Callable, base: str = ".", device: str = "cpu", whole_sample: bool = False) -> dict:
    """Run one cell in this process: load the model (cached), build the prompts (cached), seed, run.

    Args:
        cell: The cell.
        fn: Its analysis's function.
        base: The folder relative model paths resolve against.
        device: Where the model runs.
        whole_sample: Its analysis reads every prompt of the task, ignoring ``correct_only``
            (:attr:`~arithinterp.sweep.registry.Analysis.whole_sample`).

    Returns:
        ``{id, status, seconds, frame, error, worker}``; the cell's own errors are recorded in
        ``error`` (with ``status="failed"``), never raised.
    """
    import pandas as pd
    import torch

    start = time.perf_counter()
    try:
        model = _model(cell.model, base, device)
        task = cell.task
        if whole_sample and task["correct_only"]:
            task = dict(task, correct_only=False)
        prompts = _prompts(model, (cell.model, base, device), task)
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


def _describe(cell: Cell) -> str:
    """The cell in words, for messages: its id, analysis, model, task and parameters."""
    return (f"cell {cell.id} ({cell.analysis}, model {cell.model!r}, task {cell.task['name']!r}, "
            f"params {json.dumps(cell.params, sort_keys=True)})")


def check_cells(cells: list, base: str = ".", device: str = "cpu", keep_loaded: bool = True) -> None:
    """Refuse a sweep whose cells cannot run, before the first one does: each cell's parameters must
    bind to its analysis's function and pass the analysis's check (:attr:`Analysis.check`) on the
    cell's model and prompts. No analysis is computed; a model is loaded (and the task's prompts
    built) only for cells whose analysis has a check. A model that cannot be loaded, or a task whose
    prompts cannot be built, is left to fail its cells when they run (recorded, retried on the next
    run), as it would without the check.

    Args:
        cells: The cells to check.
        base: The folder relative model paths resolve against.
        device: Where the models load.
        keep_loaded: Keep the model loaded last (the first one cells run on) and its prompts for
            the cells run in this process; ``False`` frees them.

    Raises:
        ConfigError: The first cell refused, named with its analysis, model, task and parameters,
            then the parameter, its value and what is accepted.
    """
    from arithinterp.sweep.registry import ANALYSES

    for cell in cells:
        fn = ANALYSES[cell.analysis].fn
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a callable without a readable signature is checked when it runs
            continue
        try:
            signature.bind(None, None, **cell.params)  # model and prompts are its first two arguments
        except TypeError as error:
            raise ConfigError(f"{_describe(cell)}: the analysis function takes ({', '.join(signature.parameters)}), "
                              f"not these parameters: {error}") from None
    checks = {c.id: check for c in cells if (check := ANALYSES[c.analysis].check) is not None}
    checked = [c for c in cells if c.id in checks]
    models = list(dict.fromkeys(c.model for c in checked))
    try:
        for spec in reversed(models):  # cells run model by model: the first one's is left loaded
            try:
                model = _model(spec, base, device)
            except Exception:  # its cells fail when they run, with this error, and are retried next time
                continue
            for cell in (c for c in checked if c.model == spec):
                try:
                    prompts = _prompts(model, (spec, base, device), cell.task)
                except Exception:  # likewise: this task's cells fail when they run
                    continue
                try:
                    checks[cell.id](model, prompts, **cell.params)
                except ArithInterpError as error:
                    raise ConfigError(f"{_describe(cell)}: {error}") from None
    finally:
        if not keep_loaded:
            _MODELS.clear()
            _PROMPTS.clear()


def run_job(payload: tuple) -> dict:
    """Run one job of an executor: ``(cell, fn, base, device, threads, whole_sample)``, with ``threads``
    torch threads (0: leave them), in whichever process the executor chose (the analysis travels as
    its function and properties, since a user's registration is not repeated in a spawned worker)."""
    cell, fn, base, device, threads, whole_sample = payload
    if threads:
        import torch

        torch.set_num_threads(threads)
    return run_cell(cell, fn, base, device, whole_sample)
