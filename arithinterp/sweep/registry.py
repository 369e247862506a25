"""The analysis registry: :class:`Param`, :class:`Analysis`, :func:`register_analysis` and the
built-in analyses (accuracy, patching, ablation, probes) a sweep config can name, with the checks
that refuse a cell's parameters before any cell runs."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Union

from arithinterp.errors import ArithInterpError, ConfigError, accepted

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet
    from arithinterp.types import HookedModel

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Param:
    """One analysis parameter: accepted types, default, accepted values.

    Attributes:
        type: A Python type or a tuple of them (``list`` for sequences, whose items must be of ``item``).
        default: The value when a config omits it; ``None`` is accepted when it is the default.
        choices: The accepted values (for lists: accepted items), or a function returning them.
        item: The accepted type(s) of a list's items.
        required: Whether a config must give it.
        help: What it means, for listings.
    """

    type: Any
    default: Any = None
    choices: Union[tuple, Callable[[], tuple], None] = None
    item: Any = None
    required: bool = False
    help: str = ""

    def check(self, value: Any, where: str) -> Any:
        """Check a value of the parameter.

        Args:
            value: The value a config gives.
            where: The config key, for the message (``analyses[0].params.site``).

        Returns:
            ``value`` as the cell spec stores it (``1`` as ``1.0`` for a float parameter, so both give
            one cell id).

        Raises:
            ConfigError: A value of the wrong type, or not among the choices.
        """
        if value is None and not self.required and self.default is None:
            return value
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        if not is_instance(value, types):
            raise ConfigError(f"{where}: expected {type_names(types)}, got {type(value).__name__} {value!r}")
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list):
            if self.item is not None:
                item_types = self.item if isinstance(self.item, tuple) else (self.item,)
                for i, v in enumerate(value):
                    if not is_instance(v, item_types):
                        raise ConfigError(f"{where}[{i}]: expected {type_names(item_types)}, got {v!r}")
        choices = self.choices() if callable(self.choices) else self.choices
        if choices is not None:
            for v in items:
                if not isinstance(v, (str, int, float, bool)) or v not in choices:
                    raise ConfigError(f"{where}: {v!r} is not accepted; accepted: {accepted(choices)}")
        if float in types and int not in types and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value


def is_instance(value: Any, types: tuple) -> bool:
    # bool is an int in Python, but `layers = true` is a mistake, not layer 1
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def type_names(types: tuple) -> str:
    return " or ".join({list: "a list"}.get(t, getattr(t, "__name__", str(t))) for t in types)


@dataclass(frozen=True)
class Analysis:
    """A registered analysis.

    Attributes:
        name: The name configs use.
        fn: ``fn(model, prompts, **params) -> DataFrame``.
        params: ``{name: Param}``.
        plot: ``plot(frame) -> list[Figure]`` drawing the combined table (default: one bar chart per metric).
        description: One line, for listings.
        check: ``check(model, prompts, **params)``, run on every cell before the first cell runs:
            raises an :class:`~arithinterp.errors.ArithInterpError` for parameters this model or
            these prompts cannot take (a layer the model lacks, a position the prompts lack), and
            computes nothing; ``None`` when only the parameter types can be checked.
        whole_sample: The analysis measures the model's answers, so it reads every prompt of its
            task even where the task keeps only ``correct_only`` prompts (on those alone the
            built-in ``accuracy`` would be 1 by construction).
    """

    name: str
    fn: Callable[..., Any]
    params: dict
    plot: Optional[Callable] = None
    description: str = ""
    check: Optional[Callable[..., Any]] = None
    whole_sample: bool = False


ANALYSES: dict[str, Analysis] = {}


def register_analysis(
    name: str,
    fn: Callable[..., Any],
    params_schema: Optional[Mapping[str, Any]] = None,
    *,
    plot: Optional[Callable] = None,
    description: str = "",
    overwrite: bool = False,
    check: Optional[Callable[..., Any]] = None,
    whole_sample: bool = False,
) -> Analysis:
    """Add an analysis that sweeps can name.

    Args:
        name: the name configs use (letters, digits, ``_.-``; also the results folder name).
        fn: ``fn(model, prompts, **params) -> pandas.DataFrame`` (a tidy table). With the
            ``processes`` or ``ray`` executors it must be picklable (Ray pickles closures too).
        params_schema: ``{param: Param | dict | type}`` — a dict is ``Param(**dict)``, a bare type
            ``Param(type)``; a parameter named ``seed`` is how a cell's randomness is varied.
        plot: ``plot(frame) -> list[plotly Figure]`` drawing the combined table.
        description: one line, for listings.
        overwrite: replace an existing analysis of the same name.
        check: ``check(model, prompts, **params)``: refuses a cell's parameters before the sweep
            runs (see :class:`Analysis`; :func:`checking` names the parameter in its error).
        whole_sample: read every prompt of the task, ignoring its ``correct_only`` (see :class:`Analysis`).

    Returns:
        The registered analysis (also in :data:`ANALYSES`).

    Raises:
        ConfigError: A bad name or parameter schema, a callable missing, or a name already
            registered without ``overwrite``.
    """
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"analysis name must be letters, digits, '_', '.' or '-', got {name!r}")
    if name in ANALYSES and not overwrite:
        raise ConfigError(f"analysis {name!r} is already registered; pass overwrite=True to replace it")
    if not callable(fn):
        raise ConfigError(f"fn must be callable (model, prompts, **params) -> DataFrame, got {type(fn).__name__}")
    if not isinstance(whole_sample, bool):
        raise ConfigError(f"whole_sample must be True or False, got {whole_sample!r}")
    if check is not None and not callable(check):
        raise ConfigError(f"check must be callable (model, prompts, **params) or None, got {type(check).__name__}")
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
    analysis = Analysis(name, fn, schema, plot, description, check, whole_sample)
    ANALYSES[name] = analysis
    return analysis


def list_analyses() -> list[dict[str, str]]:
    """Every registered analysis's parameters, one row each (what ``arithinterp sweep --list`` prints).

    Returns:
        Rows of ``analysis``, ``parameter``, ``type``, ``default`` (``required`` where a config must
        give it), ``accepted`` (the values a config may give, where the analysis states them) and
        ``help``; an analysis without parameters has one row with an empty ``parameter``.
    """
    rows = []
    for name, analysis in ANALYSES.items():
        if not analysis.params:
            rows.append(dict(analysis=name, parameter="", type="", default="", accepted="", help=analysis.description))
        for key, param in analysis.params.items():
            types = param.type if isinstance(param.type, tuple) else (param.type,)
            kind = type_names(types)
            if list in types and param.item is not None:
                kind += f" of {type_names(param.item if isinstance(param.item, tuple) else (param.item,))}"
            choices = param.choices() if callable(param.choices) else param.choices
            rows.append(dict(analysis=name, parameter=key, type=kind,
                             default="required" if param.required else repr(param.default),
                             accepted=", ".join(str(c) for c in choices) if isinstance(choices, tuple) else "",
                             help=param.help))
    return rows


def describe_analyses() -> dict[str, str]:
    """:func:`list_analyses` as text: per analysis its description, then a line per parameter.

    Returns:
        ``{analysis: text}``.
    """
    described: dict[str, list[str]] = {}
    for row in list_analyses():
        lines = described.setdefault(row["analysis"], [ANALYSES[row["analysis"]].description or ""])
        if not row["parameter"]:
            continue
        default = "required" if row["default"] == "required" else f"default {row['default']}"
        notes = "; ".join(x for x in (row["help"], f"accepted: {row['accepted']}" if row["accepted"] else "") if x)
        lines.append(f"  {row['parameter']} ({row['type']}, {default}){': ' + notes if notes else ''}")
    return {name: "\n".join(lines) for name, lines in described.items()}


@contextlib.contextmanager
def checking(name: str, value: Any) -> Iterator[None]:
    """Name the parameter an analysis's check refuses: an :class:`~arithinterp.errors.ArithInterpError`
    raised in the block becomes a ConfigError that starts with ``name=value``.

    Args:
        name: The parameter checked in the block.
        value: Its value.

    Yields:
        Nothing; the block runs the analysis module's own validation of the value.

    Raises:
        ConfigError: The block refused the value; the message names it and keeps the refusal's
            words (what is accepted).
    """
    try:
        yield
    except ArithInterpError as error:
        raise ConfigError(f"{name}={value!r} is not accepted: {error}") from error


# --- built-in analyses ---------------------------------------------------------------------------


def accuracy_analysis(model: HookedModel, prompts: PromptSet) -> Any:
    """The built-in ``accuracy`` analysis: greedy accuracy of the model on the prompts.

    Args:
        model: The hooked model.
        prompts: The prompts.

    Returns:
        One row: ``accuracy``, ``n_correct``, ``n_prompts``.
    """
    import pandas as pd

    evaluation = prompts.evaluate(model)
    return pd.DataFrame([dict(accuracy=evaluation.accuracy, n_correct=int(evaluation.correct.sum()),
                              n_prompts=len(prompts))])


def patching_analysis(model: HookedModel, prompts: PromptSet, site: str, metric: str = "logit_diff", vary: str = "a",
                      seed: int = 0, direction: str = "denoise", normalize: bool = False, layers: Optional[list] = None,
                      positions: Optional[list] = None, per_position: bool = True) -> Any:
    """The built-in ``patching`` analysis: exact activation patching of one site on
    ``prompts.counterfactual(vary, seed)`` (Kantamneni & Tegmark 2025).

    Args:
        model: The hooked model.
        prompts: The prompts to pair.
        site: The site to patch.
        metric: The pair metric.
        vary: What the corrupt prompt changes.
        seed: Seeds the counterfactual draw and the bootstrap.
        direction: ``"denoise"`` or ``"noise"``.
        normalize: Normalize the values.
        layers: The layers (default: all).
        positions: The positions (default: all).
        per_position: False patches every position at once.

    Returns:
        :meth:`PatchResult.to_frame`: one row per cell, with the metric's mean on the unpatched clean
        and corrupt runs (``clean_baseline``, ``corrupt_baseline``: what the figures normalise by).
    """
    from arithinterp import patching

    pairs = prompts.counterfactual(vary=vary, seed=seed)
    result = patching.activation_patching(model, pairs, site=site, metric=metric, layers=layers, positions=positions,
                                          direction=direction, normalize=normalize, per_position=per_position,
                                          seed=seed, progress=False)
    frame = result.to_frame()
    frame["clean_baseline"] = float(result.clean_baseline.mean())
    frame["corrupt_baseline"] = float(result.corrupt_baseline.mean())
    return frame


def patching_check(model: HookedModel, prompts: PromptSet, site: str, layers: Optional[list] = None,
                   positions: Optional[list] = None, **params: Any) -> None:
    """Refuse a ``patching`` cell's layers or positions before the sweep runs, as
    :func:`arithinterp.patching.activation_patching` would.

    Args:
        model: The hooked model.
        prompts: The task's prompts (the clean prompts of the pairs are among them).
        site: The site to patch.
        layers: The layers (default: all).
        positions: The positions (default: all).
        **params: The analysis's other parameters (their values are checked with the config).

    Raises:
        ConfigError: A layer the model lacks at ``site``, or a position the prompts lack.
    """
    from arithinterp.sites import check_layers

    with checking("layers", layers):
        check_layers(model, site, layers)
    if positions is not None:
        with checking("positions", positions):
            prompts.locate(positions)


def ablation_analysis(
    model: HookedModel, prompts: PromptSet, components: Union[str, list], ablation: str = "mean", seed: int = 0
) -> Any:
    """The built-in ``ablation`` analysis: accuracy and answer log-prob with components ablated
    (Nikankin et al. 2025).

    Args:
        model: The hooked model.
        prompts: The prompts.
        components: ``"attn0,mlp1"`` or a list of component names.
        ablation: ``"mean"``, ``"zero"`` or ``"resample"``.
        seed: Seeds the resample ablation.

    Returns:
        The ablation result's table.
    """
    from arithinterp import patching

    return patching.ablate(model, prompts, _component_names(components), ablation=ablation, seed=seed).to_frame()


def _component_names(components: Union[str, list]) -> list:
    return [c.strip() for c in components.split(",") if c.strip()] if isinstance(components, str) else list(components)


def ablation_check(model: HookedModel, prompts: PromptSet, components: Union[str, list], **params: Any) -> None:
    """Refuse an ``ablation`` cell's components before the sweep runs, as :func:`arithinterp.patching.ablate`
    would.

    Args:
        model: The hooked model.
        prompts: The task's prompts.
        components: ``"attn0,mlp1"`` or a list of component names.
        **params: The analysis's other parameters (their values are checked with the config).

    Raises:
        ConfigError: A component that cannot be read, or names a layer, head, neuron or position
            the model or prompts lack.
    """
    from arithinterp.patching.component_ablation import ABLATABLE_KINDS
    from arithinterp.patching.components import parse_components

    with checking("components", components):
        parse_components(model, _component_names(components), ABLATABLE_KINDS, prompts)


def probes_analysis(model: HookedModel, prompts: PromptSet, target: str, kind: str = "logistic",
                    site: str = "resid_post", layers: Optional[list] = None,
                    positions: Union[str, list] = "final", cv: int = 5, seed: int = 0) -> Any:
    """The built-in ``probes`` analysis: linear probes for a label at every layer × position, with a
    shuffled control.

    Args:
        model: The hooked model.
        prompts: The prompts.
        target: A PromptSet label (``a``, ``answer_units``, ``carry_tens``, ...).
        kind: The probe kind.
        site: The site to read.
        layers: The layers (default: all).
        positions: One position spec or several.
        cv: Cross-validation folds.
        seed: Seeds the folds and probes.

    Returns:
        The probe result's table: one row per layer and position.
    """
    from arithinterp import probes
    from arithinterp.activations import collect

    acts = collect(model, prompts, sites=[site], layers=layers, positions=positions, progress=False)
    return probes.probe_layers(acts, target, kind=kind, cv=cv, seed=seed, progress=False).to_frame()


def probes_check(model: HookedModel, prompts: PromptSet, target: str, site: str = "resid_post",
                 layers: Optional[list] = None, positions: Union[str, list] = "final", cv: int = 5,
                 **params: Any) -> None:
    """Refuse a ``probes`` cell's parameters before the sweep runs, as :func:`arithinterp.activations.collect`
    and :func:`arithinterp.probes.probe_layers` would.

    Args:
        model: The hooked model.
        prompts: The task's prompts.
        target: A PromptSet label.
        site: The site to read.
        layers: The layers (default: all).
        positions: One position spec or several.
        cv: Cross-validation folds.
        **params: The analysis's other parameters (their values are checked with the config).

    Raises:
        ConfigError: A layer the model lacks at ``site``, a position the prompts lack, a target
            that is not a label of the prompts, or a fold count the prompts cannot be split into.
    """
    from arithinterp.probes.cross_validation import check_folds, resolve_groups
    from arithinterp.probes.targets import resolve_target
    from arithinterp.sites import check_layers

    with checking("layers", layers):
        check_layers(model, site, layers)
    with checking("positions", positions):
        prompts.locate(positions, answers=prompts.answer_tokens.shape[1])  # collect feeds the answers
    with checking("target", target):
        _, keep, _ = resolve_target(prompts, target, len(prompts))
    groups, _ = resolve_groups(prompts, "auto", len(prompts))  # probe_layers's default grouping
    with checking("cv", cv):
        check_folds(cv, int(keep.sum()), None if groups is None else groups[keep.numpy()])


def _builtin_plot(kind: str) -> Callable:
    def plot(frame):
        from arithinterp.viz import sweep as viz

        return getattr(viz, kind)(frame)

    plot.__name__ = kind
    return plot


def _accepted() -> dict[str, tuple]:
    """Accepted values of the built-in analyses' parameters, as the analysis modules state them
    (imported directly, so a renamed constant fails here and in type checking, never silently;
    read when a config is checked, so importing the sweep module stays light)."""
    from arithinterp.patching import COMPONENT_ABLATIONS, DIRECTIONS, METRICS, PATCHING_SITES
    from arithinterp.probes import PROBE_KINDS
    from arithinterp.tasks import VARY

    return dict(site=PATCHING_SITES, metric=METRICS, vary=VARY, direction=DIRECTIONS, ablation=COMPONENT_ABLATIONS,
                kind=PROBE_KINDS)


def _choices(name: str) -> Callable[[], tuple]:
    return lambda: tuple(_accepted()[name])


def _register_builtins() -> None:
    from arithinterp.sites import HOOKS

    sites = tuple(HOOKS)
    register_analysis("accuracy", accuracy_analysis, {}, plot=_builtin_plot("plot_sweep_accuracy"),
                      description="greedy accuracy of the model on the task", overwrite=True, whole_sample=True)
    register_analysis(
        "patching", patching_analysis,
        dict(
            site=Param(str, choices=_choices("site"), required=True, help="site to patch"),
            metric=Param(str, "logit_diff", _choices("metric"), help="the pair metric read at the final position"),
            vary=Param(str, "a", _choices("vary"), help="what the corrupt prompt changes"),
            seed=Param(int, 0, help="counterfactual draw and bootstrap seed"),
            direction=Param(str, "denoise", _choices("direction"),
                            help="denoise patches clean activations into the corrupt run, noise the reverse"),
            normalize=Param(bool, False, help="store each pair's values as its fraction of the clean-corrupt gap "
                                              "(the figures show that fraction either way)"),
            layers=Param(list, None, item=int, help="layers to patch (default: all)"),
            positions=Param(list, None, item=(str, int), help="positions to patch (default: all)"),
            per_position=Param(bool, True, help="false patches every position at once"),
        ),
        plot=_builtin_plot("plot_sweep_patching"),
        description="exact activation patching (arithinterp.patching.activation_patching)",
        overwrite=True, check=patching_check,
    )
    register_analysis(
        "ablation", ablation_analysis,
        dict(
            components=Param((str, list), item=str, required=True, help="'attn0,mlp1' or a list of component names"),
            ablation=Param(str, "mean", _choices("ablation"), help="what the ablated components carry"),
            seed=Param(int, 0, help="seed of the resample ablation"),
        ),
        plot=_builtin_plot("plot_sweep_ablation"), description="component ablation (arithinterp.patching.ablate)",
        overwrite=True, check=ablation_check,
    )
    register_analysis(
        "probes", probes_analysis,
        dict(
            target=Param(str, required=True, help="a PromptSet label: a, b, answer, answer_units, carry_tens, ..."),
            kind=Param(str, "logistic", _choices("kind"), help="the probe"),
            site=Param(str, "resid_post", sites, help="the site read"),
            layers=Param(list, None, item=int, help="layers read (default: all)"),
            positions=Param((str, list), "final", item=(str, int), help="one position spec or several"),
            cv=Param(int, 5, help="cross-validation folds"),
            seed=Param(int, 0, help="seed of the folds and probes"),
        ),
        plot=_builtin_plot("plot_sweep_probes"), description="linear probe sweep (arithinterp.probes.probe_layers)",
        overwrite=True, check=probes_check,
    )


_register_builtins()
