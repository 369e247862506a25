"""Sweep configs: reading and validating a TOML / YAML file or dict into a :class:`SweepConfig`,
and expanding it into its cells (:class:`Cell`, :func:`plan`)."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from arithinterp.errors import ConfigError, accepted
from arithinterp.sweep.registry import NAME_PATTERN, ANALYSES, is_instance, type_names

EXECUTORS = ("local", "processes", "ray")
DEVICES = ("cpu", "cuda", "auto")

_TOP_KEYS = ("out", "models", "tasks", "analyses", "executor", "workers", "device", "resources", "ray")
_TASK_KEYS = ("name", "op", "a", "b", "template", "modulus", "answer_digits", "few_shot", "limit", "seed",
              "correct_only", "from_zoo")
_ANALYSIS_KEYS = ("name", "grid", "params", "models", "tasks")
_RESOURCE_KEYS = ("num_cpus", "num_gpus")
_RAY_KEYS = ("address",)
SEED_MAX = 2**32 - 1  # the largest seed numpy and scikit-learn take
_TASK_DEFAULTS = dict(op="+", template="{a}+{b}=", modulus=None, answer_digits=0, few_shot=0, limit=None, seed=0,
                      correct_only=False)


@dataclass(frozen=True)
class SweepConfig:
    """A validated sweep config.

    Attributes:
        out: The results directory, or ``None`` when not given yet.
        models: Model specs.
        tasks: Task dicts, every default filled in.
        analyses: Analysis dicts (name, params, grid, models, tasks), every default filled in.
        executor: ``"local"``, ``"processes"`` or ``"ray"``.
        workers: Processes of the ``"processes"`` executor.
        device: Where models run (``"cpu"``, ``"cuda"``).
        resources: Per-job Ray requests (``num_cpus``, ``num_gpus``).
        ray: Ray options (``address``).
        base: The folder relative paths (``out``, model dirs) resolve against.
    """

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
        """The results directory, resolved against :attr:`base`; a ConfigError when ``out`` is unset."""
        if self.out is None:
            raise ConfigError("out: no results directory given; set 'out' in the config or pass --out")
        path = Path(self.out).expanduser()
        return path if path.is_absolute() else Path(self.base) / path

    def digest(self) -> str:
        """Hash of what determines the results (models, tasks, analyses), not of how they run.

        Returns:
            16 hex digits.
        """
        return _digest(dict(models=self.models, tasks=self.tasks, analyses=self.analyses))


def _digest(value: Any, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:n]


def read_config_file(path: Union[str, Path]) -> dict:
    """Parse a sweep config file into a dict, not yet validated.

    Args:
        path: A ``.toml``, ``.yaml`` or ``.yml`` file.

    Returns:
        The config's top-level table.

    Raises:
        ConfigError: A missing file, an unknown suffix, invalid TOML / YAML, a missing parser, or a
            top level that is not a table.
    """
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
                import tomli as tomllib  # pyright: ignore[reportMissingImports]
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

    Args:
        config: A config file's path, a dict, or a ``SweepConfig``.
        **overrides: ``out``, ``executor``, ``workers``, ``device``, ``num_cpus``, ``num_gpus``,
            ``address``: they replace config values; ``None`` leaves a value alone.

    Returns:
        The validated config.

    Raises:
        ConfigError: A bad config or override; every error names the bad key
            (``analyses[1].name``, ``tasks[0].a``, ...) and what is accepted.
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
            override_keys = ("out", "executor", "workers", "device", "num_cpus", "num_gpus", "address")
            raise ConfigError(f"unknown override {key!r}; accepted: {accepted(override_keys)}")
    data["resources"], data["ray"] = resources, ray
    for key in ("address", "num_gpus"):  # asked for on this run, they would be ignored by any other executor
        if overrides.get(key) is not None and data.get("executor", "local") != "ray":
            raise ConfigError(f"{key}={overrides[key]!r} is a request to Ray, but the executor is "
                              f"{data.get('executor', 'local')!r}; pass executor 'ray' (--executor ray) or drop {key}")
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
    if not is_instance(value, types):
        raise ConfigError(f"{where}: expected {type_names(types)}, got {type(value).__name__} {value!r}")
    return value


def _validate(data: dict, base: str) -> SweepConfig:
    _unknown_keys(data, _TOP_KEYS, "")
    for key in ("models", "tasks", "analyses"):
        if key not in data:
            raise ConfigError(f"{key}: missing; a sweep needs 'models', 'tasks' and 'analyses'")
        if not isinstance(data[key], list) or not data[key]:
            raise ConfigError(f"{key}: expected a non-empty list, got {data[key]!r}")
    out = data.get("out")
    if out is not None and not _expect(out, (str,), "out").strip():  # not the config's own folder, unasked
        raise ConfigError("out: '' is an empty path; give a results folder (relative paths start at the config's "
                          "folder), or pass --out")
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
        if not (math.isfinite(resources[key]) and resources[key] >= 0):  # nan passes a plain "< 0" check
            raise ConfigError(f"resources.{key}: must be a finite number >= 0, got {resources[key]}")
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
            raise ConfigError(f"{where}: zoo model {spec!r} has no shipped checkpoint; "
                              f"train it with `arithinterp train {name}`")
        return spec
    looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith(".gguf")
    if resolve_path(spec, base).exists():
        return spec
    if looks_like_path or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec):
        raise ConfigError(f"{where}: unknown model {spec!r}: no such file or directory (relative paths start at the "
                          f"config's folder {base}); accepted: {accepted('zoo:' + z for z in ZOO)}, a local model "
                          "directory, a .gguf file or a hub id")
    return spec  # a hub id: it can only be checked by loading it


def resolve_path(spec: str, base: str) -> Path:
    path = Path(spec).expanduser()
    return path if path.is_absolute() else Path(base) / path


def _operand_range(value: Any, where: str) -> list:
    """``n`` -> [n, n+1]; ``[start, stop]`` / ``[start, stop, step]`` as written."""
    if isinstance(value, (int, list)) and not isinstance(value, bool):
        ends = value if isinstance(value, list) else [value]
        if any(isinstance(v, int) and abs(v) > 2**63 - 1 for v in ends):
            raise ConfigError(f"{where}: operands must lie within ±(2**63 - 1), got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool):
        return [value, value + 1]
    if isinstance(value, list) and len(value) in (2, 3) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        if not range(*value):
            raise ConfigError(f"{where}: range {value} is empty")
        return list(value)
    raise ConfigError(f"{where}: expected an int or a range [start, stop] / [start, stop, step] of ints, got {value!r}")


# Grids up to this many operand pairs are built whole and then sampled (the tables of existing
# sweeps stay the same); larger ones are sampled by index and only the chosen prompts are built.
GRID_BUILT_WHOLE = 2**20


def grid_size(task: Mapping) -> int:
    """Operand pairs in a task's grid that are defined for its operator (``b == 0`` is not for // and mod)."""
    a, b = range(*task["a"]), range(*task["b"])
    return range_length(a) * (range_length(b) - (task["op"] in ("//", "mod") and 0 in b))


def range_length(values: range) -> int:
    """``len(values)``, also past ``sys.maxsize`` (64-bit operand ranges can be that long)."""
    return max(0, -((values.start - values.stop) // values.step))


def _check_task(task: Any, where: str, models: list) -> dict:
    from arithinterp.errors import TaskError
    from arithinterp.tasks import OPERATORS, check_template

    _expect(task, (dict,), where)
    _unknown_keys(task, _TASK_KEYS, f"{where}.")
    name = _expect(task.get("name"), (str,), f"{where}.name")
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"{where}.name: use letters, digits, '_', '.' or '-', got {name!r}")
    out: dict[str, Any] = dict(_TASK_DEFAULTS, **task)
    from_zoo = _expect(out.pop("from_zoo", False), (bool,), f"{where}.from_zoo")
    if from_zoo:
        clash = [k for k in ("op", "a", "b", "template", "modulus", "answer_digits") if k in task]
        if clash:
            raise ConfigError(f"{where}.{clash[0]}: a task with from_zoo = true takes {clash[0]!r} from each zoo model")
        others = [m for m in models if not m.startswith("zoo:")]
        if others:
            raise ConfigError(f"{where}.from_zoo: model {others[0]!r} is not a zoo model; "
                              "from_zoo needs zoo models only")
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
        try:
            check_template(template, out["op"])
        except TaskError as error:
            raise ConfigError(f"{where}.template: {error}") from None
        if out["modulus"] is not None and (_expect(out["modulus"], (int,), f"{where}.modulus") < 2):
            raise ConfigError(f"{where}.modulus: must be an int >= 2, got {out['modulus']}")
        if _expect(out["answer_digits"], (int,), f"{where}.answer_digits") < 0:
            raise ConfigError(f"{where}.answer_digits: must be >= 0")
    if _expect(out["few_shot"], (int,), f"{where}.few_shot") < 0:
        raise ConfigError(f"{where}.few_shot: must be >= 0")
    if out["limit"] is not None and _expect(out["limit"], (int,), f"{where}.limit") < 1:
        raise ConfigError(f"{where}.limit: must be >= 1, got {out['limit']}")
    _check_seed(out["seed"], f"{where}.seed")
    _expect(out["correct_only"], (bool,), f"{where}.correct_only")
    if not from_zoo and out["limit"] is None:
        if grid_size(out) > GRID_BUILT_WHOLE:
            raise ConfigError(f"{where}.limit: the operand grid has {grid_size(out):,} pairs, too many to build whole "
                              f"(at most {GRID_BUILT_WHOLE:,}); set limit to sample that many pairs from it")
    return out


def _check_seed(seed: Any, where: str) -> int:
    _expect(seed, (int,), where)
    if not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"{where}: must be an int in 0..{SEED_MAX}, got {seed}")
    return seed


def _check_param(key: str, value: Any, where: str) -> Any:
    """What a parameter's type allows but its cell would fail on or misread: a seed out of range, an
    empty list (not "the default"), an item listed twice."""
    if key == "seed" and value is not None:
        _check_seed(value, where)
    if isinstance(value, list):
        if not value:
            raise ConfigError(f"{where}: an empty list; leave {key!r} out for its default")
        repeated = [v for i, v in enumerate(value) if v in value[:i]]
        if repeated:
            raise ConfigError(f"{where}: {repeated[0]!r} named more than once in {value!r}; name each once")
    return value


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
                raise ConfigError(f"{where}.{section}.{key}: unknown parameter {key!r} of analysis {name!r}; "
                                  f"accepted: {known}")
            if section == "grid":
                if not isinstance(value, list) or not value:
                    raise ConfigError(f"{where}.grid.{key}: expected a non-empty list of values to sweep, "
                                      f"got {value!r}")
                table[key] = [_check_param(key, schema[key].check(v, f"{where}.grid.{key}[{i}]"),
                                           f"{where}.grid.{key}[{i}]") for i, v in enumerate(value)]
            else:
                if key in grid:
                    raise ConfigError(f"{where}.params.{key}: {key!r} is in both grid and params; keep one")
                table[key] = _check_param(key, schema[key].check(value, f"{where}.params.{key}"),
                                          f"{where}.params.{key}")
    for key, param in schema.items():
        if param.required and key not in grid and key not in params:
            raise ConfigError(f"{where}.params.{key}: analysis {name!r} needs parameter {key!r} "
                              f"({param.help or 'required'})")
    only_models = entry.get("models")
    if only_models is not None:
        _expect(only_models, (list,), f"{where}.models")
        for i, m in enumerate(only_models):
            if m not in models:
                raise ConfigError(f"{where}.models[{i}]: {m!r} is not one of the sweep's models; "
                                  f"accepted: {accepted(models)}")
    only_tasks = entry.get("tasks")
    if only_tasks is not None:
        _expect(only_tasks, (list,), f"{where}.tasks")
        for i, t in enumerate(only_tasks):
            if t not in task_names:
                raise ConfigError(f"{where}.tasks[{i}]: unknown task {t!r}; accepted: {accepted(task_names)}")
    fixed = {k: params.get(k, p.default) for k, p in schema.items() if k not in grid}
    return dict(name=name, grid={k: list(v) for k, v in grid.items()}, params=fixed, models=only_models,
                tasks=only_tasks)


# =================================================================================================
# Cells
# =================================================================================================


@dataclass(frozen=True)
class Cell:
    """One job: a model, a task, an analysis and its parameters.

    Attributes:
        model: The model spec.
        task: The task, fully resolved.
        analysis: The analysis's registered name.
        params: Its parameters, sorted by name.
    """

    model: str
    task: dict
    analysis: str
    params: dict

    @property
    def spec(self) -> dict:
        """The cell's full spec: model, task, analysis and parameters."""
        return dict(model=self.model, task=self.task, analysis=self.analysis, params=self.params)

    @property
    def id(self) -> str:
        """A stable hash of :attr:`spec` (16 hex digits): the cell's file name, so a sweep run before
        finds the cells it finished."""
        return _digest(dict(self.spec, params=dict(sorted(self.params.items()))))

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
    """Every cell of the sweep in a stable order (model, task, analysis, grid values).

    Args:
        config: A ``SweepConfig``, or what :func:`load_config` reads.

    Returns:
        The cells, each once.

    Raises:
        ConfigError: An invalid config.
    """
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
