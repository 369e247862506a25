"""Config-driven, resumable sweeps: models × tasks × analyses × parameters.

A sweep is declared in a TOML or YAML file (or a dict) and expands into *cells*: one model, one
task, one analysis and one value of each of its parameters. Each cell is one job; its tidy table
is written atomically to ``OUT/results/<analysis>/<cell-id>.parquet`` where the cell id is a
stable hash of the cell's full spec, so

* re-running a config skips the cells already on disk, and a run killed at any moment resumes
  to the same tables an uninterrupted run writes (every random choice is seeded from the spec);
* ``OUT/manifest.json`` records the config hash, package versions and each cell's status and
  timing; :func:`load_results` concatenates the cells into one tidy table per analysis.

Jobs run in-process (``executor="local"``), in a local process pool (``"processes"``) or as Ray
tasks with per-job CPU/GPU requests on an existing cluster or a local one (``"ray"``). Workers only
compute; the driver writes every file, so the results directory needs to exist on the driver only.

Analyses come from a registry users extend with :func:`register_analysis`; each takes
``(model, prompts, **params)`` and returns a pandas DataFrame. See ``docs/sweep.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import platform
import random
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from arithinterp.errors import ArithInterpError, ConfigError, accepted
from arithinterp.results import Result, build_meta

EXECUTORS = ("local", "processes", "ray")
DEVICES = ("cpu", "cuda", "auto")
STATUSES = ("pending", "done", "failed")
MANIFEST = "manifest.json"
RESULTS = "results"
_TMP_MARK = ".tmp-"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")

# =================================================================================================
# The analysis registry
# =================================================================================================


@dataclass(frozen=True)
class Param:
    """One analysis parameter: accepted types, default, accepted values.

    ``type`` is a Python type or a tuple of them (``list`` for sequences, whose items must be of
    ``item``); ``choices`` lists accepted values (for lists: accepted items), or is a function
    returning them; ``None`` is accepted when it is the default.
    """

    type: Any
    default: Any = None
    choices: Union[tuple, Callable[[], tuple], None] = None
    item: Any = None
    required: bool = False
    help: str = ""

    def check(self, value: Any, where: str) -> Any:
        """``value`` as the cell spec stores it (``1`` as ``1.0`` for a float parameter, so both
        give one cell id); raises :class:`ConfigError` naming ``where`` if it is not acceptable."""
        if value is None and not self.required and self.default is None:
            return value
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        if not _is_instance(value, types):
            raise ConfigError(f"{where}: expected {_type_names(types)}, got {type(value).__name__} {value!r}")
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list):
            if self.item is not None:
                item_types = self.item if isinstance(self.item, tuple) else (self.item,)
                for i, v in enumerate(value):
                    if not _is_instance(v, item_types):
                        raise ConfigError(f"{where}[{i}]: expected {_type_names(item_types)}, got {v!r}")
        choices = self.choices() if callable(self.choices) else self.choices
        if choices is not None:
            for v in items:
                if not isinstance(v, (str, int, float, bool)) or v not in choices:
                    raise ConfigError(f"{where}: {v!r} is not accepted; accepted: {accepted(choices)}")
        if float in types and int not in types and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value


def _is_instance(value: Any, types: tuple) -> bool:
    # bool is an int in Python, but `layers = true` is a mistake, not layer 1
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _type_names(types: tuple) -> str:
    return " or ".join({list: "a list"}.get(t, getattr(t, "__name__", str(t))) for t in types)


@dataclass(frozen=True)
class Analysis:
    """A registered analysis: ``fn(model, prompts, **params) -> DataFrame`` and its parameters.

    ``plot(frame) -> list[Figure]`` draws the combined table (default: one bar chart per metric).
    """

    name: str
    fn: Callable[..., Any]
    params: dict
    plot: Optional[Callable] = None
    description: str = ""


ANALYSES: dict[str, Analysis] = {}


def register_analysis(
    name: str,
    fn: Callable[..., Any],
    params_schema: Optional[Mapping[str, Any]] = None,
    *,
    plot: Optional[Callable] = None,
    description: str = "",
    overwrite: bool = False,
) -> Analysis:
    """Add an analysis that sweeps can name.

    Args:
        name: the name configs use (letters, digits, ``_.-``; also the results folder name).
        fn: ``fn(model, prompts, **params) -> pandas.DataFrame`` (a tidy table). With the
            ``processes`` or ``ray`` executors it must be picklable (Ray pickles closures too).
        params_schema: ``{param: Param | dict | type}`` — a dict is ``Param(**dict)``, a bare type
            ``Param(type)``; a parameter named ``seed`` is how a cell's randomness is varied.
        plot: ``plot(frame) -> list[plotly Figure]`` drawing the combined table.
        overwrite: replace an existing analysis of the same name.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"analysis name must be letters, digits, '_', '.' or '-', got {name!r}")
    if name in ANALYSES and not overwrite:
        raise ConfigError(f"analysis {name!r} is already registered; pass overwrite=True to replace it")
    if not callable(fn):
        raise ConfigError(f"fn must be callable (model, prompts, **params) -> DataFrame, got {type(fn).__name__}")
    schema = {}
    for key, spec in dict(params_schema or {}).items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"parameter names must be identifiers, got {key!r} for analysis {name!r}")
        if isinstance(spec, Param):
            schema[key] = spec
        elif isinstance(spec, Mapping):
            schema[key] = Param(**spec)
        elif isinstance(spec, type) or isinstance(spec, tuple):
            schema[key] = Param(spec)
        else:
            raise ConfigError(f"schema of parameter {key!r}: expected a Param, a dict or a type, got {spec!r}")
    analysis = Analysis(name, fn, schema, plot, description)
    ANALYSES[name] = analysis
    return analysis


# --- built-in analyses ---------------------------------------------------------------------------


def accuracy_analysis(model: Any, prompts: Any) -> Any:
    """One row: greedy accuracy of the model on the prompts (``PromptSet.evaluate``)."""
    import pandas as pd

    evaluation = prompts.evaluate(model)
    return pd.DataFrame([dict(accuracy=evaluation.accuracy, n_correct=int(evaluation.correct.sum()), n_prompts=len(prompts))])


def patching_analysis(model: Any, prompts: Any, site: str, metric: str = "logit_diff", vary: str = "a", seed: int = 0,
                      direction: str = "denoise", normalize: bool = False, layers: Optional[list] = None,
                      positions: Optional[list] = None, per_position: bool = True) -> Any:
    """Exact activation patching of one site on ``prompts.counterfactual(vary, seed)`` (RECIPES §1)."""
    from arithinterp import patching

    pairs = prompts.counterfactual(vary=vary, seed=seed)
    result = patching.sweep(model, pairs, site=site, metric=metric, layers=layers, positions=positions,
                            direction=direction, normalize=normalize, per_position=per_position, seed=seed, progress=False)
    return result.to_frame()


def ablation_analysis(model: Any, prompts: Any, components: Union[str, list], mode: str = "mean", seed: int = 0) -> Any:
    """Accuracy and answer log-prob with components ablated (RECIPES §4); ``"attn0,mlp1"`` or a list."""
    from arithinterp import patching

    names = [c.strip() for c in components.split(",") if c.strip()] if isinstance(components, str) else list(components)
    return patching.ablate(model, prompts, names, mode=mode, seed=seed).to_frame()


def probes_analysis(model: Any, prompts: Any, target: str, kind: str = "logistic", site: str = "resid_post",
                    layers: Optional[list] = None, positions: Union[str, list] = "final", cv: int = 5, seed: int = 0) -> Any:
    """Linear probes for ``target`` at every collected layer × position, with a shuffled control."""
    from arithinterp import probes
    from arithinterp.activations import collect

    acts = collect(model, prompts, sites=[site], layers=layers, positions=positions, progress=False)
    return probes.sweep(acts, target, kind=kind, cv=cv, random_state=seed, progress=False).to_frame()


def _builtin_plot(kind: str) -> Callable:
    def plot(frame):
        from arithinterp.viz import sweep as viz

        return getattr(viz, kind)(frame)

    plot.__name__ = kind
    return plot


def _choices(module: str, name: str, fallback: tuple) -> Callable[[], tuple]:
    """Accepted values as the analysis module states them (read when a config is checked, so
    importing the sweep module stays light); ``fallback`` where that module is missing."""

    def resolve() -> tuple:
        import importlib

        try:
            return tuple(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            return fallback

    return resolve


def _register_builtins() -> None:
    from arithinterp.sites import HOOKS

    sites = tuple(HOOKS)
    patch_sites = _choices("arithinterp.patching", "SWEEP_SITES", sites)
    register_analysis("accuracy", accuracy_analysis, {}, plot=_builtin_plot("accuracy_figures"),
                      description="greedy accuracy of the model on the task", overwrite=True)
    register_analysis(
        "patching", patching_analysis,
        dict(
            site=Param(str, choices=patch_sites, required=True, help="site to patch"),
            metric=Param(str, "logit_diff", _choices("arithinterp.patching", "METRICS", ("logit_diff", "prob", "logprob", "ie"))),
            vary=Param(str, "a", _choices("arithinterp.tasks", "VARY", ("a", "b", "both", "keep_answer", "operator")),
                       help="what the corrupt prompt changes"),
            seed=Param(int, 0, help="counterfactual draw and bootstrap seed"),
            direction=Param(str, "denoise", _choices("arithinterp.patching", "DIRECTIONS", ("denoise", "noise"))),
            normalize=Param(bool, False),
            layers=Param(list, None, item=int),
            positions=Param(list, None, item=(str, int)),
            per_position=Param(bool, True),
        ),
        plot=_builtin_plot("patching_figures"), description="exact activation patching (arithinterp.patching.sweep)",
        overwrite=True,
    )
    register_analysis(
        "ablation", ablation_analysis,
        dict(
            components=Param((str, list), item=str, required=True, help="'attn0,mlp1' or a list of component names"),
            mode=Param(str, "mean", _choices("arithinterp.patching", "ABLATION_MODES", ("zero", "mean", "resample"))),
            seed=Param(int, 0),
        ),
        plot=_builtin_plot("ablation_figures"), description="component ablation (arithinterp.patching.ablate)",
        overwrite=True,
    )
    register_analysis(
        "probes", probes_analysis,
        dict(
            target=Param(str, required=True, help="a PromptSet label: a, b, answer, answer_digit_0, carry_0, ..."),
            kind=Param(str, "logistic", _choices("arithinterp.probes", "KINDS", ("logistic", "ridge", "circular", "mlp"))),
            site=Param(str, "resid_post", sites),
            layers=Param(list, None, item=int),
            positions=Param((str, list), "final", item=(str, int)),
            cv=Param(int, 5),
            seed=Param(int, 0),
        ),
        plot=_builtin_plot("probes_figures"), description="linear probe sweep (arithinterp.probes.sweep)",
        overwrite=True,
    )


_register_builtins()

# =================================================================================================
# Config
# =================================================================================================

_TOP_KEYS = ("out", "models", "tasks", "analyses", "executor", "workers", "device", "resources", "ray")
_TASK_KEYS = ("name", "op", "a", "b", "template", "modulus", "answer_digits", "few_shot", "limit", "seed",
              "correct_only", "from_zoo")
_ANALYSIS_KEYS = ("name", "grid", "params", "models", "tasks")
_RESOURCE_KEYS = ("num_cpus", "num_gpus")
_RAY_KEYS = ("address",)
_TASK_DEFAULTS = dict(op="+", template="{a}+{b}=", modulus=None, answer_digits=0, few_shot=0, limit=None, seed=0,
                      correct_only=False)


@dataclass(frozen=True)
class SweepConfig:
    """A validated sweep config. ``models`` are specs, ``tasks`` and ``analyses`` dicts with every
    default filled in; ``base`` is the folder relative paths (``out``, model dirs) resolve against."""

    out: Optional[str]
    models: list
    tasks: list
    analyses: list
    executor: str = "local"
    workers: int = 2
    device: str = "cpu"
    resources: dict = field(default_factory=lambda: dict(num_cpus=1, num_gpus=0))
    ray: dict = field(default_factory=dict)
    base: str = "."

    @property
    def out_dir(self) -> Path:
        if self.out is None:
            raise ConfigError("out: no results directory given; set 'out' in the config or pass --out")
        path = Path(self.out).expanduser()
        return path if path.is_absolute() else Path(self.base) / path

    def digest(self) -> str:
        """Hash of what determines the results (models, tasks, analyses), not of how they run."""
        return _digest(dict(models=self.models, tasks=self.tasks, analyses=self.analyses))


def _digest(value: Any, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:n]


def read_config_file(path: Union[str, Path]) -> dict:
    """Parse a ``.toml`` or ``.yaml`` / ``.yml`` sweep config into a dict (not yet validated)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"no such sweep config file: {path}")
    suffix = path.suffix.lower()
    text = path.read_text()
    if suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError as error:
                raise ConfigError("reading TOML on Python 3.10 needs 'tomli' (pip install tomli)") from error
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: invalid TOML: {error}") from error
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as error:
            raise ConfigError("reading YAML configs needs 'pyyaml' (pip install pyyaml)") from error
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: invalid YAML: {error}") from error
    else:
        raise ConfigError(f"{path}: unknown config format {suffix!r}; accepted: '.toml', '.yaml', '.yml'")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a table/mapping at the top level")
    return data


def load_config(config: Union[str, Path, Mapping, SweepConfig], **overrides: Any) -> SweepConfig:
    """Read and validate a sweep config (a path, a dict or a ``SweepConfig``).

    ``overrides`` (``out``, ``executor``, ``workers``, ``device``, ``num_cpus``, ``num_gpus``,
    ``address``) replace config values; ``None`` leaves a value alone. Every error names the bad
    key (``analyses[1].name``, ``tasks[0].a``, ...) and what is accepted.
    """
    if isinstance(config, SweepConfig):
        data, base = _config_dict(config), config.base
    elif isinstance(config, Mapping):
        data, base = dict(config), "."
    elif isinstance(config, (str, Path)):
        data, base = read_config_file(config), str(Path(config).expanduser().resolve().parent)
    else:
        raise ConfigError(f"config must be a path, a dict or a SweepConfig, got {type(config).__name__}")
    data = dict(data)
    resources, ray = dict(data.get("resources") or {}), dict(data.get("ray") or {})
    for key, value in overrides.items():
        if value is None:
            continue
        if key in ("num_cpus", "num_gpus"):
            resources[key] = value
        elif key == "address":
            ray[key] = value
        elif key in ("out", "executor", "workers", "device"):
            data[key] = value
        else:
            raise ConfigError(f"unknown override {key!r}; accepted: {accepted(('out', 'executor', 'workers', 'device', 'num_cpus', 'num_gpus', 'address'))}")
    data["resources"], data["ray"] = resources, ray
    return _validate(data, base)


def _config_dict(config: SweepConfig) -> dict:
    return dict(out=config.out, models=config.models, tasks=config.tasks, analyses=config.analyses,
                executor=config.executor, workers=config.workers, device=config.device,
                resources=config.resources, ray=config.ray)


def _unknown_keys(table: Mapping, known: Sequence[str], where: str) -> None:
    for key in table:
        if key not in known:
            raise ConfigError(f"{where}{key}: unknown key {key!r}; accepted: {accepted(known)}")


def _expect(value: Any, types: tuple, where: str) -> Any:
    if not _is_instance(value, types):
        raise ConfigError(f"{where}: expected {_type_names(types)}, got {type(value).__name__} {value!r}")
    return value


def _validate(data: dict, base: str) -> SweepConfig:
    _unknown_keys(data, _TOP_KEYS, "")
    for key in ("models", "tasks", "analyses"):
        if key not in data:
            raise ConfigError(f"{key}: missing; a sweep needs 'models', 'tasks' and 'analyses'")
        if not isinstance(data[key], list) or not data[key]:
            raise ConfigError(f"{key}: expected a non-empty list, got {data[key]!r}")
    out = data.get("out")
    if out is not None:
        _expect(out, (str,), "out")
    models = [_check_model(m, f"models[{i}]", base) for i, m in enumerate(data["models"])]
    if len(set(models)) != len(models):
        raise ConfigError(f"models: duplicate model specs in {models}")
    tasks = [_check_task(t, f"tasks[{i}]", models) for i, t in enumerate(data["tasks"])]
    names = [t["name"] for t in tasks]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise ConfigError(f"tasks[{i}].name: duplicate task name {name!r}; each task needs its own name")
    analyses = [_check_analysis(a, f"analyses[{i}]", models, names) for i, a in enumerate(data["analyses"])]
    executor = _expect(data.get("executor", "local"), (str,), "executor")
    if executor not in EXECUTORS:
        raise ConfigError(f"executor: unknown executor {executor!r}; accepted: {accepted(EXECUTORS)}")
    workers = _expect(data.get("workers", 2), (int,), "workers")
    if workers < 1:
        raise ConfigError(f"workers: must be >= 1, got {workers}")
    device = _expect(data.get("device", "cpu"), (str,), "device")
    if device not in DEVICES and not re.fullmatch(r"cuda:\d+", device):
        raise ConfigError(f"device: unknown device {device!r}; accepted: {accepted(DEVICES)} or 'cuda:N'")
    resources = _expect(data.get("resources") or {}, (dict,), "resources")
    _unknown_keys(resources, _RESOURCE_KEYS, "resources.")
    resources = dict(dict(num_cpus=1, num_gpus=0), **resources)
    for key in _RESOURCE_KEYS:
        _expect(resources[key], (int, float), f"resources.{key}")
        if resources[key] < 0:
            raise ConfigError(f"resources.{key}: must be >= 0, got {resources[key]}")
    ray = _expect(data.get("ray") or {}, (dict,), "ray")
    _unknown_keys(ray, _RAY_KEYS, "ray.")
    if ray.get("address") is not None:
        _expect(ray["address"], (str,), "ray.address")
    return SweepConfig(out, models, tasks, analyses, executor, workers, device, resources, ray, base)


def _check_model(spec: Any, where: str, base: str) -> str:
    from arithinterp.models.zoo import ZOO

    _expect(spec, (str,), where)
    if spec.startswith("zoo:"):
        name = spec.removeprefix("zoo:").split("@", 1)[0]
        if name not in ZOO:
            raise ConfigError(f"{where}: unknown model {spec!r}; accepted: {accepted('zoo:' + z for z in ZOO)}, "
                              "a local model directory, a .gguf file or a hub id")
        if not (ZOO[name].directory / "model.safetensors").exists():
            raise ConfigError(f"{where}: zoo model {spec!r} has no shipped checkpoint; train it with `arithinterp train {name}`")
        return spec
    looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith(".gguf")
    if _resolve_path(spec, base).exists():
        return spec
    if looks_like_path or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec):
        raise ConfigError(f"{where}: unknown model {spec!r}: no such file or directory (relative paths start at the "
                          f"config's folder {base}); accepted: {accepted('zoo:' + z for z in ZOO)}, a local model "
                          "directory, a .gguf file or a hub id")
    return spec  # a hub id: it can only be checked by loading it


def _resolve_path(spec: str, base: str) -> Path:
    path = Path(spec).expanduser()
    return path if path.is_absolute() else Path(base) / path


def _operand_range(value: Any, where: str) -> list:
    """``n`` -> [n, n+1]; ``[start, stop]`` / ``[start, stop, step]`` as written."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value, value + 1]
    if isinstance(value, list) and len(value) in (2, 3) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if not range(*value):
            raise ConfigError(f"{where}: range {value} is empty")
        return list(value)
    raise ConfigError(f"{where}: expected an int or a range [start, stop] / [start, stop, step] of ints, got {value!r}")


def _check_task(task: Any, where: str, models: list) -> dict:
    from arithinterp.tasks import OPERATORS

    _expect(task, (dict,), where)
    _unknown_keys(task, _TASK_KEYS, f"{where}.")
    name = _expect(task.get("name"), (str,), f"{where}.name")
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}.name: use letters, digits, '_', '.' or '-', got {name!r}")
    out = dict(_TASK_DEFAULTS, **task)
    from_zoo = _expect(out.pop("from_zoo", False), (bool,), f"{where}.from_zoo")
    if from_zoo:
        clash = [k for k in ("op", "a", "b", "template", "modulus", "answer_digits") if k in task]
        if clash:
            raise ConfigError(f"{where}.{clash[0]}: a task with from_zoo = true takes {clash[0]!r} from each zoo model")
        others = [m for m in models if not m.startswith("zoo:")]
        if others:
            raise ConfigError(f"{where}.from_zoo: model {others[0]!r} is not a zoo model; from_zoo needs zoo models only")
        for key in ("op", "a", "b", "template", "modulus", "answer_digits"):
            out[key] = None
        out["from_zoo"] = True
    else:
        for key in ("a", "b"):
            if key not in task:
                raise ConfigError(f"{where}.{key}: missing; give operand range [start, stop) or set from_zoo = true")
            out[key] = _operand_range(task[key], f"{where}.{key}")
        if _expect(out["op"], (str,), f"{where}.op") not in OPERATORS:
            raise ConfigError(f"{where}.op: unknown operator {out['op']!r}; accepted: {accepted(OPERATORS)}")
        template = _expect(out["template"], (str,), f"{where}.template")
        if "{a}" not in template or "{b}" not in template:
            raise ConfigError(f"{where}.template: must contain '{{a}}' and '{{b}}', got {template!r}")
        if out["modulus"] is not None and (_expect(out["modulus"], (int,), f"{where}.modulus") < 2):
            raise ConfigError(f"{where}.modulus: must be an int >= 2, got {out['modulus']}")
        if _expect(out["answer_digits"], (int,), f"{where}.answer_digits") < 0:
            raise ConfigError(f"{where}.answer_digits: must be >= 0")
    if _expect(out["few_shot"], (int,), f"{where}.few_shot") < 0:
        raise ConfigError(f"{where}.few_shot: must be >= 0")
    if out["limit"] is not None and _expect(out["limit"], (int,), f"{where}.limit") < 1:
        raise ConfigError(f"{where}.limit: must be >= 1, got {out['limit']}")
    _expect(out["seed"], (int,), f"{where}.seed")
    _expect(out["correct_only"], (bool,), f"{where}.correct_only")
    return out


def _check_analysis(entry: Any, where: str, models: list, task_names: list) -> dict:
    _expect(entry, (dict,), where)
    _unknown_keys(entry, _ANALYSIS_KEYS, f"{where}.")
    name = _expect(entry.get("name"), (str,), f"{where}.name")
    if name not in ANALYSES:
        raise ConfigError(f"{where}.name: unknown analysis {name!r}; accepted: {accepted(ANALYSES)}")
    schema = ANALYSES[name].params
    grid = dict(_expect(entry.get("grid") or {}, (dict,), f"{where}.grid"))
    params = dict(_expect(entry.get("params") or {}, (dict,), f"{where}.params"))
    for section, table in (("grid", grid), ("params", params)):
        for key, value in table.items():
            if key not in schema:
                known = accepted(schema) if schema else "none (this analysis takes no parameters)"
                raise ConfigError(f"{where}.{section}.{key}: unknown parameter {key!r} of analysis {name!r}; accepted: {known}")
            if section == "grid":
                if not isinstance(value, list) or not value:
                    raise ConfigError(f"{where}.grid.{key}: expected a non-empty list of values to sweep, got {value!r}")
                table[key] = [schema[key].check(v, f"{where}.grid.{key}[{i}]") for i, v in enumerate(value)]
            else:
                if key in grid:
                    raise ConfigError(f"{where}.params.{key}: {key!r} is in both grid and params; keep one")
                table[key] = schema[key].check(value, f"{where}.params.{key}")
    for key, param in schema.items():
        if param.required and key not in grid and key not in params:
            raise ConfigError(f"{where}.params.{key}: analysis {name!r} needs parameter {key!r} ({param.help or 'required'})")
    only_models = entry.get("models")
    if only_models is not None:
        _expect(only_models, (list,), f"{where}.models")
        for i, m in enumerate(only_models):
            if m not in models:
                raise ConfigError(f"{where}.models[{i}]: {m!r} is not one of the sweep's models; accepted: {accepted(models)}")
    only_tasks = entry.get("tasks")
    if only_tasks is not None:
        _expect(only_tasks, (list,), f"{where}.tasks")
        for i, t in enumerate(only_tasks):
            if t not in task_names:
                raise ConfigError(f"{where}.tasks[{i}]: unknown task {t!r}; accepted: {accepted(task_names)}")
    fixed = {k: params.get(k, p.default) for k, p in schema.items() if k not in grid}
    return dict(name=name, grid={k: list(v) for k, v in grid.items()}, params=fixed, models=only_models, tasks=only_tasks)


# =================================================================================================
# Cells
# =================================================================================================


@dataclass(frozen=True)
class Cell:
    """One job: a model, a task (fully resolved), an analysis and its parameters. ``id`` hashes them."""

    model: str
    task: dict
    analysis: str
    params: dict

    @property
    def spec(self) -> dict:
        return dict(model=self.model, task=self.task, analysis=self.analysis, params=self.params)

    @property
    def id(self) -> str:
        return _digest(self.spec)

    @property
    def seed(self) -> int:
        """The seed of every random choice the analysis does not seed itself."""
        return int(self.id[:8], 16)


def _resolve_task(task: dict, model: str) -> dict:
    if not task.get("from_zoo"):
        return task
    from arithinterp.models.zoo import get_entry

    zoo_task = get_entry(model).task
    return dict(task, op=zoo_task.op, a=list(zoo_task.a_range), b=list(zoo_task.b_range), template=zoo_task.template,
                modulus=zoo_task.modulus, answer_digits=zoo_task.answer_digits)


def plan(config: Union[SweepConfig, Mapping, str, Path]) -> list[Cell]:
    """Every cell of the sweep in a stable order (model, task, analysis, grid values)."""
    config = config if isinstance(config, SweepConfig) else load_config(config)
    cells = []
    for model in config.models:
        for task in config.tasks:
            resolved = _resolve_task(task, model)
            for entry in config.analyses:
                if entry["models"] is not None and model not in entry["models"]:
                    continue
                if entry["tasks"] is not None and task["name"] not in entry["tasks"]:
                    continue
                keys = list(entry["grid"])
                for values in itertools.product(*(entry["grid"][k] for k in keys)):
                    params = dict(entry["params"], **dict(zip(keys, values)))
                    cells.append(Cell(model, resolved, entry["name"], dict(sorted(params.items()))))
    ids = [c.id for c in cells]
    seen = set()
    unique = []
    for cell, cid in zip(cells, ids):  # the same cell listed twice runs once
        if cid not in seen:
            seen.add(cid)
            unique.append(cell)
    return unique


# =================================================================================================
# Running one cell (in whichever process the executor chose)
# =================================================================================================

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


# =================================================================================================
# Writing: atomic Parquet per cell, the manifest, combined tables
# =================================================================================================


def cell_path(out: Union[str, Path], cell: Cell) -> Path:
    return Path(out) / RESULTS / cell.analysis / f"{cell.id}.parquet"


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temp file in the same folder and ``os.replace`` it: readers (and a resumed
    run) see the old file or the whole new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _plain_column(values: list) -> list:
    """Arrow needs one type per column: lists/dicts become JSON, mixed types strings."""
    if any(isinstance(v, (list, tuple, dict)) for v in values):
        return [None if v is None else json.dumps(v) for v in values]
    kinds = {type(v) for v in values if v is not None}
    if len(kinds) > 1 and not kinds <= {int, float}:
        return [None if v is None else str(v) for v in values]
    return values


def tidy(cell: Cell, frame: Any) -> Any:
    """The cell's table with its identity in front: ``cell``, ``model``, ``task``, ``analysis``, params.

    A parameter the analysis already reports as a column (e.g. ``site``) keeps the analysis's column.
    """
    import pandas as pd

    frame = frame.reset_index(drop=True)
    ident = dict(cell=cell.id, model=cell.model, task=cell.task["name"], analysis=cell.analysis)
    frame = frame.rename(columns={k: f"result_{k}" for k in ident if k in frame.columns})
    front = dict(ident, **{k: v for k, v in cell.params.items() if k not in frame.columns})
    head = pd.DataFrame({k: _plain_column([v] * len(frame)) for k, v in front.items()}, index=frame.index)
    out = pd.concat([head, frame], axis=1)
    for column in out.columns:
        if out[column].dtype == object:
            out[column] = _plain_column(out[column].tolist())
    return out


def _write_cell(out: Path, cell: Cell, frame: Any) -> int:
    table = tidy(cell, frame)
    _atomic_write(cell_path(out, cell), lambda tmp: table.to_parquet(tmp, index=False))
    return len(table)


def versions() -> dict:
    import torch

    from arithinterp import __version__

    return dict(arithinterp=__version__, torch=torch.__version__, transformer_lens=_package_version("transformer-lens"),
                pyarrow=_package_version("pyarrow"), python=platform.python_version())


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def read_manifest(out: Union[str, Path]) -> dict:
    path = Path(out) / MANIFEST
    if not path.is_file():
        raise ConfigError(f"{out} is not a sweep results directory (no {MANIFEST})")
    return json.loads(path.read_text())


def _write_manifest(out: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=1, default=str)
    _atomic_write(out / MANIFEST, lambda tmp: tmp.write_text(text))


def load_results(out: Union[str, Path], analysis: Optional[str] = None) -> Any:
    """The combined tidy table of each analysis: ``{analysis: DataFrame}`` (or one DataFrame).

    Rows are the finished cells of the sweep last run in ``out``, in the sweep's cell order.
    """
    import pandas as pd

    out = Path(out)
    manifest = read_manifest(out)
    tables: dict[str, list] = {}
    for cid, entry in manifest["cells"].items():
        path = out / entry["path"]
        if path.is_file():
            tables.setdefault(entry["analysis"], []).append(pd.read_parquet(path))
    combined = {}
    for name, frames in tables.items():
        frame = pd.concat(frames, ignore_index=True)
        # which columns say what a cell is (plots label cells by those that vary)
        params = dict.fromkeys(k for e in manifest["cells"].values() if e["analysis"] == name for k in e["params"])
        frame.attrs["cell_columns"] = ["model", "task"] + [k for k in params if k in frame.columns]
        combined[name] = frame
    if analysis is None:
        return combined
    if analysis not in combined:
        raise ConfigError(f"no finished cells of analysis {analysis!r} in {out}; accepted: {accepted(combined)}")
    return combined[analysis]


# =================================================================================================
# Executors
# =================================================================================================


def _local(jobs: list) -> Iterator[dict]:
    for payload in jobs:
        yield _job(payload)


def _processes(jobs: list, workers: int) -> Iterator[dict]:
    import concurrent.futures
    import multiprocessing

    # spawn, not fork: forking a process that already runs torch threads can deadlock
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = {pool.submit(_job, payload): payload[0].id for payload in jobs}
        for future in concurrent.futures.as_completed(futures):
            try:
                yield future.result()
            except Exception as error:  # the worker died (e.g. out of memory): this cell fails, the rest go on
                yield _lost(futures[future], error)


def _lost(cell_id: str, error: BaseException) -> dict:
    return dict(id=cell_id, status="failed", seconds=None, frame=None, worker=None,
                error=f"the job was lost: {type(error).__name__}: {error}")


def _check_picklable(names: set) -> None:
    import pickle

    for name in sorted(names):
        try:
            pickle.dumps(ANALYSES[name].fn)
        except Exception as error:
            raise ConfigError(
                f"executor: analysis {name!r} cannot be sent to worker processes ({error}); define its function "
                "at the top level of a module, or use executor 'local' or 'ray'"
            ) from error


def _import_ray():
    try:
        import ray
    except ImportError as error:
        raise ConfigError("the 'ray' executor needs Ray: pip install 'arithinterp[ray]'") from error
    return ray


def _ray(jobs: list, address: Optional[str], resources: dict) -> Iterator[dict]:
    ray = _import_ray()
    started = False
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        started = True
    try:
        env = {k: os.environ[k] for k in ("MKL_CBWR",) if k in os.environ}
        remote = ray.remote(_job).options(num_cpus=resources["num_cpus"], num_gpus=resources["num_gpus"], max_retries=2,
                                          runtime_env=dict(env_vars=env))
        refs = {remote.remote(payload): payload[0].id for payload in jobs}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    yield ray.get(ref)
                except Exception as error:  # the task or its node died after Ray's retries
                    yield _lost(refs[ref], error)
    finally:
        if started:
            ray.shutdown()


# =================================================================================================
# The sweep
# =================================================================================================


@dataclass(frozen=True)
class SweepRun(Result):
    """What a sweep run did: one entry per cell (status, seconds, rows, error) and the totals."""

    out: str
    config_hash: str
    cells: list  # [{id, analysis, model, task, params, status, seconds, rows, error, this_run}]
    executor: str
    seconds: float
    meta: dict

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in self.counts().items())
        return f"SweepRun(out={self.out!r}, executor={self.executor!r}, {counts}, seconds={self.seconds:.1f})"

    def counts(self) -> dict:
        ran = [c for c in self.cells if c["this_run"]]
        return dict(total=len(self.cells), done=sum(c["status"] == "done" for c in ran),
                    skipped=sum(not c["this_run"] and c["status"] == "done" for c in self.cells),
                    failed=sum(c["status"] == "failed" for c in ran),
                    pending=sum(c["status"] == "pending" for c in self.cells))

    def summary(self) -> dict:
        """JSON-able totals and one row per analysis (cells done / skipped / failed, time)."""
        rows = []
        for name in dict.fromkeys(c["analysis"] for c in self.cells):
            mine = [c for c in self.cells if c["analysis"] == name]
            rows.append(dict(analysis=name, cells=len(mine),
                             done=sum(c["this_run"] and c["status"] == "done" for c in mine),
                             skipped=sum(not c["this_run"] and c["status"] == "done" for c in mine),
                             failed=sum(c["status"] == "failed" for c in mine),
                             seconds=round(sum(c["seconds"] or 0 for c in mine if c["this_run"]), 2)))
        errors = [dict(cell=c["id"], analysis=c["analysis"], error=(c["error"] or "").splitlines()[0])
                  for c in self.cells if c["status"] == "failed"]
        return dict(out=self.out, config_hash=self.config_hash, executor=self.executor, **self.counts(),
                    seconds=round(self.seconds, 2), analyses=rows, **(dict(errors=errors) if errors else {}))

    def to_frame(self):
        """One row per cell: analysis, model, task, parameters (as JSON), status, seconds, rows."""
        import pandas as pd

        return pd.DataFrame([dict(cell=c["id"], analysis=c["analysis"], model=c["model"], task=c["task"],
                                  params=json.dumps(c["params"], sort_keys=True), status=c["status"],
                                  this_run=c["this_run"], seconds=c["seconds"], rows=c["rows"]) for c in self.cells])

    def plot(self, **kwargs):
        """Seconds per cell, coloured by status (see ``viz.sweep.cell_timings``)."""
        from arithinterp.viz.sweep import cell_timings

        return cell_timings(self.to_frame(), **kwargs)

    def results(self, analysis: Optional[str] = None):
        return load_results(self.out, analysis)


@contextlib.contextmanager
def _driver_lock(out: Path) -> Iterator[None]:
    """One driver per results directory: ``OUT/.lock`` names the host and process holding it.

    A lock left by a killed driver on this host (its process is gone) is taken over; one held by
    a live process, or by another host, is an error (delete the file if that driver is gone).
    """
    path = out / ".lock"
    me = dict(host=platform.node(), pid=os.getpid())
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text() or "{}")
            except (OSError, json.JSONDecodeError):
                holder = {}
            if holder.get("host") == me["host"] and not _alive(holder.get("pid")):
                path.unlink(missing_ok=True)
                continue
            raise ConfigError(f"out: {out} is in use by another sweep ({holder or 'unknown holder'}); wait for it, "
                              f"or delete {path} if that run is gone")
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(me))
        break
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_temp_files(out: Path) -> None:
    """Remove temp files a killed run left behind (only ours: ``.<name>.tmp-<pid>``)."""
    for path in list((out / RESULTS).glob(f"*/.*{_TMP_MARK}*")) + list(out.glob(f".{MANIFEST}{_TMP_MARK}*")):
        path.unlink(missing_ok=True)


def run_sweep(
    config: Union[str, Path, Mapping, SweepConfig],
    *,
    out: Union[str, Path, None] = None,
    executor: Optional[str] = None,
    workers: Optional[int] = None,
    address: Optional[str] = None,
    num_cpus: Optional[float] = None,
    num_gpus: Optional[float] = None,
    device: Optional[str] = None,
    progress: bool = True,
) -> SweepRun:
    """Run every unfinished cell of a sweep and write its results under ``out``.

    The config is validated before any job runs. Cells whose Parquet file exists are skipped;
    failed cells are recorded in the manifest and retried by the next run. Keyword arguments
    override the config (``executor``: ``"local"``, ``"processes"`` or ``"ray"``; ``address``:
    a Ray cluster such as ``"ray://head:10001"``; ``num_cpus`` / ``num_gpus``: per Ray job).
    One driver may use a results directory at a time (``OUT/.lock``).
    """
    cfg = load_config(config, out=None if out is None else str(Path(out).expanduser().resolve()), executor=executor,
                      workers=workers, device=device, num_cpus=num_cpus, num_gpus=num_gpus, address=address)
    # MKL's float results can depend on buffer alignment, i.e. on what a process did before; its
    # conditional numerical reproducibility makes a cell's table bit-identical in any process, so a
    # resumed or distributed sweep matches an uninterrupted local one. Read when MKL first runs.
    os.environ.setdefault("MKL_CBWR", "AUTO")
    try:
        import pyarrow  # noqa: F401  (pandas writes Parquet through it)
    except ImportError as error:
        raise ConfigError("sweeps write Parquet tables, which needs pyarrow: pip install pyarrow") from error
    if cfg.executor == "ray":
        _import_ray()  # a missing extra fails before anything is written
    if cfg.executor == "processes":
        _check_picklable({a["name"] for a in cfg.analyses})
    cells = plan(cfg)
    out_dir = cfg.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    with _driver_lock(out_dir):
        return _run_cells(cfg, cells, out_dir, progress)


def _run_cells(cfg: SweepConfig, cells: list, out_dir: Path, progress: bool) -> SweepRun:
    from tqdm.auto import tqdm

    (out_dir / RESULTS).mkdir(exist_ok=True)
    _clean_temp_files(out_dir)
    previous_manifest = {}
    with contextlib.suppress(ConfigError, json.JSONDecodeError):
        previous_manifest = read_manifest(out_dir)
    previous = previous_manifest.get("cells", {})
    entries = {}
    for cell in cells:
        path = cell_path(out_dir, cell)
        old = previous.get(cell.id, {})
        done = path.is_file()
        entries[cell.id] = dict(
            analysis=cell.analysis, model=cell.model, task=cell.task["name"], params=cell.params,
            path=str(path.relative_to(out_dir)), status="done" if done else ("failed" if old.get("status") == "failed" else "pending"),
            seconds=old.get("seconds") if done else None, rows=old.get("rows") if done else None,
            error=None if done else old.get("error"), worker=old.get("worker") if done else None, this_run=False,
        )
        if done and entries[cell.id]["rows"] is None:  # finished just before a kill, after the last manifest write
            import pyarrow.parquet as pq

            entries[cell.id]["rows"] = pq.read_metadata(path).num_rows
    manifest = dict(config_hash=cfg.digest(), versions=versions(), executor=cfg.executor,
                    created=previous_manifest.get("created", time.time()), updated=time.time(),
                    config=dict(models=cfg.models, tasks=cfg.tasks, analyses=cfg.analyses), cells=entries)
    _write_manifest(out_dir, manifest)
    todo = [c for c in cells if entries[c.id]["status"] != "done"]
    threads = max(1, int(cfg.resources["num_cpus"])) if cfg.executor != "local" else 0
    jobs = [(c, ANALYSES[c.analysis].fn, cfg.base, cfg.device, threads) for c in todo]
    by_id = {c.id: c for c in todo}
    start = time.perf_counter()
    if jobs:
        runner = {"local": lambda: _local(jobs), "processes": lambda: _processes(jobs, cfg.workers),
                  "ray": lambda: _ray(jobs, cfg.ray.get("address"), cfg.resources)}[cfg.executor]
        last_write = time.monotonic()
        bar = tqdm(total=len(jobs), desc=f"sweep ({cfg.executor})", disable=not progress, unit="cell")
        try:
            for outcome in runner():
                cell = by_id[outcome["id"]]
                entry = entries[cell.id]
                if outcome["status"] == "done":
                    try:
                        entry["rows"] = _write_cell(out_dir, cell, outcome["frame"])
                    except Exception as exc:  # e.g. a table Arrow cannot store: the cell fails, the sweep goes on
                        outcome.update(status="failed", error=f"cannot write the results table: {type(exc).__name__}: {exc}")
                entry.update(status=outcome["status"], seconds=outcome["seconds"], error=outcome["error"],
                             worker=outcome["worker"], this_run=True)
                bar.update(1)
                bar.set_postfix_str(f"{cell.analysis} {outcome['status']}")
                if time.monotonic() - last_write > 1.0:  # Parquet files are the truth; the manifest may lag
                    _write_manifest(out_dir, manifest)
                    last_write = time.monotonic()
        finally:
            bar.close()
            _write_manifest(out_dir, manifest)
    run = SweepRun(out=str(out_dir), config_hash=cfg.digest(),
                   cells=[dict(id=c.id, **{k: v for k, v in entries[c.id].items() if k != "path"}) for c in cells],
                   executor=cfg.executor, seconds=time.perf_counter() - start,
                   meta=build_meta(versions=versions()))
    return run


# =================================================================================================
# Figures
# =================================================================================================


def figures(out: Union[str, Path]) -> dict:
    """``{analysis: [Figure, ...]}`` for every analysis with finished cells in ``out``."""
    from arithinterp.viz import sweep as viz

    drawn = {}
    for name, frame in load_results(out).items():
        plot = ANALYSES[name].plot if name in ANALYSES and ANALYSES[name].plot else viz.generic_figures
        drawn[name] = list(plot(frame))
    return drawn


def plot_sweep(out: Union[str, Path], to: Union[str, Path, None] = None) -> list[Path]:
    """Write each analysis's figures into one self-contained HTML file ``<to>/<analysis>.html``
    (default ``to``: ``OUT/figures``); returns the files written."""
    out = Path(out)
    to = Path(to) if to is not None else out / "figures"
    written = []
    for name, figs in figures(out).items():
        parts = [fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figs)]
        html = f"<!doctype html><html><head><meta charset='utf-8'><title>{name}</title></head><body>{''.join(parts)}</body></html>"
        path = to / f"{name}.html"
        _atomic_write(path, lambda tmp: tmp.write_text(html))
        written.append(path)
    return written


# =================================================================================================
# Command line
# =================================================================================================


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``sweep`` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser("sweep", help="run a config-driven, resumable sweep (or plot one with --plot)",
                              description="Run every unfinished cell of a sweep config (TOML or YAML): models x tasks "
                              "x analyses x parameters. Re-running skips finished cells.")
    p.add_argument("config", nargs="?", default=None, help="sweep config file (.toml, .yaml or .yml)")
    p.add_argument("--out", default=None, help="results directory (default: the config's 'out')")
    p.add_argument("--executor", choices=EXECUTORS, default=None, help="where jobs run (default: the config's, else local)")
    p.add_argument("--workers", type=int, default=None, help="processes for --executor processes (default: 2)")
    p.add_argument("--address", default=None, help="Ray cluster address, e.g. ray://head:10001 (default: start a local one)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs each Ray job requests (default: 1)")
    p.add_argument("--num-gpus", type=float, default=None, help="GPUs each Ray job requests (default: 0)")
    p.add_argument("--device", default=None, help="device models load on: cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--dry-run", action="store_true", help="validate the config and list its cells without running")
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="DIR",
                   help="write HTML figures of the sweep in DIR (or, without DIR, of the config's results after running)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")
    return p


def run_cli(args: argparse.Namespace) -> dict:
    """Run the ``sweep`` subcommand; returns a JSON-able summary."""
    if args.plot and not args.config:
        files = plot_sweep(args.plot)
        return dict(out=args.plot, figures=[str(f) for f in files])
    if not args.config:
        raise ConfigError("give a sweep config file, or --plot DIR to draw an existing sweep")
    overrides = dict(out=args.out, executor=args.executor, workers=args.workers, address=args.address,
                     num_cpus=args.num_cpus, num_gpus=args.num_gpus, device=args.device)
    if args.dry_run:
        cfg = load_config(args.config, **{k: (str(Path(v).resolve()) if k == "out" and v else v) for k, v in overrides.items()})
        cells = plan(cfg)
        out = cfg.out_dir if cfg.out else None
        finished = sum(out is not None and cell_path(out, c).is_file() for c in cells)
        return dict(config_hash=cfg.digest(), out=str(out), cells=len(cells), finished=finished,
                    to_run=len(cells) - finished,
                    plan=[dict(cell=c.id, analysis=c.analysis, model=c.model, task=c.task["name"],
                               params=json.dumps(c.params, sort_keys=True)) for c in cells])
    run = run_sweep(args.config, progress=not args.no_progress, **overrides)
    summary = run.summary()
    if args.plot is not None:
        summary["figures"] = [str(f) for f in plot_sweep(run.out, args.plot or None)]
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m arithinterp.sweep CONFIG [flags]``: exit 0 when every cell finished, 1 when some
    failed, 2 on a bad config."""
    parser = add_cli(argparse.ArgumentParser().add_subparsers(dest="command"))
    parser.prog = "python -m arithinterp.sweep"
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        summary = run_cli(args)
    except ArithInterpError as error:
        print(f"arithinterp sweep: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        import pandas as pd

        for key, value in summary.items():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                print(f"{key}:\n{pd.DataFrame(value).to_string(index=False)}")
            else:
                print(f"{key}: {value}")
    return 1 if summary.get("failed") else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
