"""The ``arithinterp`` command: a thin layer over the same functions a notebook calls.

Every subcommand validates its flags, prints a short human summary (or JSON with ``--json``),
and exits 0 on success, 2 on bad input (an ``ArithInterpError``), 1 on anything unexpected.

One module past 600 lines on purpose: each of the twenty commands is a short function over the
library whose flags are declared in :func:`build_parser`, and a reader checks one against the other.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from typing import Any, Callable, Optional, Sequence, cast

from arithinterp.errors import AnalysisError, ArithInterpError, ConfigError
from arithinterp.outputs import fail, print_summary

COMMANDS: dict[str, Callable[[argparse.Namespace], dict]] = {}
# what each command writes, by flag: "result" (a folder for Result.save) or "new-dir" (other folders
# written whole at the end), or "file"; every one is checked (outputs.check_target) before the
# command starts its work, so a bad path never costs an analysis
OUTPUTS: dict[str, dict[str, str]] = {}

SEED_MAX = 2**32 - 1  # the largest seed numpy and scikit-learn take; torch takes it too
FLOAT32_MAX = 3.4028234663852886e38  # a learning rate above this overflows the float32 optimizer


def _whole(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: a whole number written as digits, in ``low..high`` (``1.5``, ``1e3``, ``nan`` refused)."""

    def read(text: str) -> int:
        value = int(text) if re.fullmatch(r"\s*-?\d+\s*", text) else None
        if value is None or value < low or (high is not None and value > high):
            words = f"an int >= {low}" if high is None else f"an int in {low}..{high}"
            raise argparse.ArgumentTypeError(f"{text!r} is not accepted; give {words}")
        return value

    read.__name__ = "int"  # the word argparse uses when int() itself fails
    return read


def _learning_rate(text: str) -> float:
    """An argparse type: a finite learning rate > 0 that float32 holds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= FLOAT32_MAX):
        raise argparse.ArgumentTypeError(f"{text!r} is not accepted; give a finite number > 0 "
                                         f"(at most {FLOAT32_MAX:.3g}, what float32 holds)")
    return value


def _items(text: str, flag: str, sep: str = ",") -> list[str]:
    """The ``sep``-separated items of a flag, each named once (empty items are skipped), else a
    ConfigError naming the flag."""
    items = [item.strip() for item in text.split(sep) if item.strip()]
    if not items:
        raise ConfigError(f"{flag}: {text!r} names nothing; give {sep}-separated names")
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise ConfigError(f"{flag}: {', '.join(map(repr, repeated))} named more than once in {text!r}; "
                          "name each once")
    return items


def command(name: str, outputs: Optional[dict[str, str]] = None):
    """Register a function as a subcommand.

    Args:
        name: The subcommand's name (``arithinterp NAME``).
        outputs: ``{argument: "file" | "new-dir" | "result"}``: the outputs :func:`check_outputs`
            checks before the command runs.

    Returns:
        A decorator that records the function in :data:`COMMANDS` and returns it unchanged.
    """

    def register(function):
        COMMANDS[name] = function
        OUTPUTS[name] = dict(outputs or {})
        return function

    return register


# --- info ----------------------------------------------------------------------------------------


@command("info")
def info(args: argparse.Namespace) -> dict:
    """List the zoo and evaluate a model on its task.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from arithinterp.models import list_zoo, load_model
    from arithinterp.models.zoo import evaluate, get_entry

    if args.limit < 1:  # not a slice [:-1] of the held-out problems
        raise ConfigError(f"--limit: {args.limit} is not accepted; give an int >= 1")
    if args.model is not None and not args.model.strip():  # not "list the zoo only", unasked
        raise ConfigError("model: '' is an empty model spec; give one such as zoo:add-100, or leave it out to only "
                          "list the zoo")
    summary: dict[str, Any] = {"zoo": list_zoo()}
    if args.model:
        model = load_model(args.model)
        summary["model"] = args.model
        summary["config"] = dict(
            n_layers=model.cfg.n_layers, d_model=model.cfg.d_model, n_heads=model.cfg.n_heads, d_mlp=model.cfg.d_mlp
        )
        if args.model.startswith("zoo:"):
            summary["evaluation"] = evaluate(get_entry(args.model), model, limit=args.limit)
    return summary


# --- report --------------------------------------------------------------------------------------


@command("report", outputs=dict(out="file"))
def report_command(args: argparse.Namespace) -> dict:
    """Run the standard battery on a model and write one offline HTML report.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from arithinterp.report import write_report

    if args.template is not None and not args.template.strip():  # not the default template, unasked
        raise ConfigError("--template: '' is an empty template; give one with {a} and {b} such as '{a}+{b}=', "
                          "or leave --template out")
    if args.operands is not None:
        _check_operands(args.operands)
    stages = None if args.stages is None else [name.strip() for name in args.stages.split(",") if name.strip()]
    path = write_report(args.model, out=args.out, stages=stages, limit=args.limit, seed=args.seed,
                        template=args.template, few_shot=args.few_shot, operands=args.operands,
                        budget=args.budget, max_memory=args.max_memory, correct_only=not args.all_prompts,
                        progress=not args.no_progress, overwrite=args.overwrite, raise_on_failure=True,
                        plan=args.plan, deadline=args.deadline)
    return dict(report=str(path), size_kib=round(path.stat().st_size / 1024, 1))


OPERAND_PAIRS_MAX = 2**24  # the report builds every operand pair before it samples --limit of them


def _check_operands(text: str) -> None:
    """``--operands`` as the report reads it, each value once and a grid the report can build."""
    from arithinterp.tasks.operators import parse_operands

    span = re.fullmatch(r"(\d+)-(\d+)", text.replace(" ", ""))
    count = int(span.group(2)) - int(span.group(1)) + 1 if span else None
    if count is None or count * count <= OPERAND_PAIRS_MAX:
        try:
            values = parse_operands(text)
        except ConfigError as error:
            raise ConfigError(f"--operands: {error}") from None
        count = len(values)
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ConfigError(f"--operands: {repeated} named more than once in {text!r}; name each value once")
    if count * count > OPERAND_PAIRS_MAX:
        raise ConfigError(f"--operands: {text!r} gives {count:,} values, {count * count:,} operand pairs; "
                          f"the report builds at most {OPERAND_PAIRS_MAX:,} operand pairs "
                          f"({math.isqrt(OPERAND_PAIRS_MAX):,} values)")


# --- analyses ------------------------------------------------------------------------------------
# Each loads the model and a seeded sample of its task's prompts, runs one analysis, saves the
# result (``--out DIR``, reload with ``Result.load``) and optionally its figure (``--figure F.html``).


def check_outputs(args: argparse.Namespace) -> None:
    """Fail on an unwritable output of any command (``OUTPUTS``) now, before its work: a file where a
    folder is needed or the reverse, a folder that cannot be written, a result folder that already
    holds a different result (without ``--overwrite``).

    Args:
        args: The parsed command line.

    Raises:
        ConfigError: An output that cannot be written.
    """
    from arithinterp.outputs import check_target
    from arithinterp.results import holds_result

    for dest, kind in OUTPUTS.get(args.command, {}).items():
        path, flag = getattr(args, dest, None), "--" + dest.replace("_", "-")
        if path is None:
            continue
        if not str(path).strip():  # not "nothing saved", nor the default folder
            raise ConfigError(f"{flag}: {path!r} is an empty path; give a file or folder name, or omit {flag}")
        overwrite = getattr(args, "overwrite", False)
        if kind == "result" and not overwrite and holds_result(path):
            raise ConfigError(f"{flag}: {path} already holds a saved result; pass --overwrite to replace it, "
                              "or give another folder")
        check_target(path, overwrite=overwrite, what=flag, folder=kind != "file")


_ANALYSIS_OUTPUTS = dict(out="result", figure="file")


def _model_and_prompts(args: argparse.Namespace, correct_only: bool = True):
    from arithinterp.models import load_model
    from arithinterp.models.zoo import task_prompts

    model = load_model(args.model)
    prompts = task_prompts(model, args.model, args.limit, args.seed)
    return model, (prompts.correct_only(model) if correct_only else prompts)


def _finish(result: Any, args: argparse.Namespace, summary: dict) -> dict:
    from arithinterp.outputs import write_figure

    if args.out:
        summary["result"] = str(result.save(args.out, overwrite=args.overwrite))
    if args.figure:
        write_figure(result.plot(), args.figure, overwrite=args.overwrite, what="--figure")
        summary["figure"] = args.figure
    return summary


@command("patch", outputs=_ANALYSIS_OUTPUTS)
def patch_command(args: argparse.Namespace) -> dict:
    """Exact activation patching of one site over layers x positions.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from arithinterp import patching

    model, prompts = _model_and_prompts(args)
    pairs = prompts.counterfactual(vary=args.vary, seed=args.seed)
    result = patching.activation_patching(model, pairs, args.site, metric=args.metric, normalize=args.normalize,
                            direction=args.direction, progress=not args.no_progress)
    best = int(result.mean.flatten().argmax())
    return _finish(result, args, dict(site=args.site, pairs=len(pairs), metric=args.metric,
                                      best_cell_mean=round(float(result.mean.flatten()[best]), 4)))


@command("probe", outputs=_ANALYSIS_OUTPUTS)
def probe_command(args: argparse.Namespace) -> dict:
    """Probe a label at every layer and position, with a shuffled-label control.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from arithinterp import probes
    from arithinterp.activations import collect

    positions = _items(args.positions, "--positions")
    model, prompts = _model_and_prompts(args)
    acts = collect(model, prompts, sites=args.site, positions=positions, progress=not args.no_progress)
    result = probes.probe_layers(acts, args.target, kind=args.kind, cv=args.cv, progress=not args.no_progress)
    return _finish(result, args, dict(target=args.target, kind=args.kind, best=result.best()))


@command("fourier", outputs=_ANALYSIS_OUTPUTS)
def fourier_command(args: argparse.Namespace) -> dict:
    """Fourier spectrum of the number-token embeddings.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from arithinterp import fourier
    from arithinterp.models import load_model

    model = load_model(args.model)
    if args.numbers > model.cfg.d_vocab:  # not one token each: refused now, not after tokenizing them all
        raise ConfigError(f"--numbers: {args.numbers} is more numbers than this model's vocabulary of "
                          f"{model.cfg.d_vocab} tokens; a Fourier axis needs one token per number")
    result = fourier.embedding_spectrum(model, range(args.numbers))
    periods = [round(result.n / k, 3) for k in result.key[0] if k > 0]
    return _finish(result, args, dict(numbers=args.numbers, key_frequencies=list(result.key[0]), key_periods=periods,
                                      key_fraction=round(float(result.key_fraction[0]), 4)))


def _numbers(flag: str, text: str) -> tuple[float, ...]:
    """Comma-separated numbers of a flag, e.g. ``--periods 2,5,10,100``."""
    values = []
    for part in text.split(","):
        try:
            values.append(float(part))
        except ValueError:
            raise ConfigError(f"{flag}: {part.strip()!r} is not a number; "
                              "give comma-separated numbers such as 2,5,10,100") from None
    if not all(math.isfinite(v) for v in values):
        raise ConfigError(f"{flag}: {text!r} is not accepted; give finite numbers such as 2,5,10,100")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ConfigError(f"{flag}: {', '.join(f'{v:g}' for v in repeated)} named more than once in {text!r}; "
                          "name each once")
    return tuple(values)


@command("helix", outputs=_ANALYSIS_OUTPUTS)
def helix_command(args: argparse.Namespace) -> dict:
    """Fit a helix to the residual stream at an operand and test it causally.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from arithinterp import helix
    from arithinterp.activations import collect

    periods = _numbers("--periods", args.periods)
    model, prompts = _model_and_prompts(args)
    acts = collect(model, prompts, sites="resid_pre", layers=[args.layer], positions=args.position, progress=False)
    fit = helix.fit(acts, args.position, periods=periods, kind=args.kind, site="resid_pre", layer=args.layer,
                    positions=args.position)
    # the test scores the corrupt answer's first token: pairs whose answers share it would score 0
    pairs = prompts.counterfactual(vary=args.position, seed=args.seed, distinct_first_token=True)
    result = helix.patch_test(model, pairs, fit, layer=args.layer, positions=args.position)
    fractions = [round(f, 4) for f in result.fraction.tolist()]
    summary = dict(r2_held_out=round(float(fit.r2_full), 4),
                   fraction_of_layer_patch=dict(zip(result.methods, fractions)))
    return _finish(result, args, dict(summary, note=result.note) if result.note else summary)


@command("neurons", outputs=_ANALYSIS_OUTPUTS)
def neurons_command(args: argparse.Namespace) -> dict:
    """Classify the most important MLP neurons into heuristics.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from arithinterp import neurons

    model, prompts = _model_and_prompts(args)
    result = neurons.classify(model, prompts, top_k=args.top_k, threshold=args.threshold, progress=not args.no_progress)
    return _finish(result, args, dict(neurons=len(result.layer), coverage=result.coverage()))


@command("ablate", outputs=_ANALYSIS_OUTPUTS)
def ablate_command(args: argparse.Namespace) -> dict:
    """Ablate components and compare accuracy and answer log-probability with the full model.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from arithinterp import patching

    components = _items(args.components, "--components")
    model, prompts = _model_and_prompts(args)
    if args.full_answer:
        prompts = prompts.with_scoring("full-answer")
    ablation = args.ablation
    result = patching.ablate(model, prompts, components, ablation=ablation, seed=args.seed)
    token_accuracy = [round(float(t), 4) for t in result.token_correct_after.float().mean(0)]
    return _finish(result, args, dict(components=result.components, ablation=ablation,
                                      accuracy_before=round(result.accuracy_before, 4),
                                      accuracy_after=round(result.accuracy_after, 4),
                                      token_accuracy_after=token_accuracy))


@command("digits", outputs=_ANALYSIS_OUTPUTS)
def digits_command(args: argparse.Namespace) -> dict:
    """Ablate each head at each answer position alone and score that answer digit.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from arithinterp import patching

    model, prompts = _model_and_prompts(args)
    result = patching.digit_ablation(model, prompts, ablation=args.ablation, seed=args.seed,
                                     progress=not args.no_progress)
    worst = int(result.drop.flatten().argmax())
    head, token = divmod(worst, result.drop.shape[1])
    return _finish(result, args, dict(prompts=len(prompts), baseline=[round(float(v), 4) for v in result.baseline],
                                      largest_drop=dict(head=result.heads[head], answer_token=token,
                                                        drop=round(float(result.drop[head, token]), 4))))


@command("circuit", outputs=dict(_ANALYSIS_OUTPUTS, html="file"))
def circuit_command(args: argparse.Namespace) -> dict:
    """Score every edge, keep the smallest top-k reaching the target faithfulness (or --top).

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    import pandas as pd

    from arithinterp import circuits
    from arithinterp.errors import ConfigError

    positions = _items(args.positions, "--positions") if args.positions is not None else None
    if args.top is None and not 0 < args.target <= 1:  # before the edges are scored
        raise ConfigError(f"--target must be in (0, 1], got {args.target}")
    model, prompts = _model_and_prompts(args)
    pairs = prompts.counterfactual(vary=args.vary, seed=args.seed)
    scored = circuits.score_edges(model, pairs, args.method, positions=positions, ig_steps=args.ig_steps,
                                  metric=args.metric, progress=not args.no_progress)
    if args.top is not None:
        size = args.top
    else:
        curve = circuits.faithfulness_curve(model, pairs, scored, ablation=args.ablation)
        size = curve.smallest(args.target)
        size = scored.n_edges if size is None else size
    circuit = circuits.top_n(scored, size)
    value = circuits.edge_faithfulness(model, pairs, circuit, ablation=args.ablation).faithfulness
    top = circuit.to_frame().query("kept").sort_values("score", key=abs, ascending=False).head(10)
    # A list of column labels selects a DataFrame; pandas annotates ``frame[labels]`` as DataFrame | Series.
    top_edges = cast(pd.DataFrame, top[["edge", "score"]]).round(4).to_dict("records")
    if args.html:
        circuit.to_html(args.html, overwrite=args.overwrite)
    return _finish(circuit, args, dict(method=circuit.method, pairs=len(pairs), edges=circuit.n_edges,
                                       kept=circuit.n_kept, fraction_kept=round(circuit.n_kept / circuit.n_edges, 4),
                                       faithfulness=round(value, 4), ablation=args.ablation, top_edges=top_edges,
                                       **({"html": args.html} if args.html else {})))


# --- train ---------------------------------------------------------------------------------------


@command("train", outputs=dict(out="new-dir"))
def train_command(args: argparse.Namespace) -> dict:
    """Train a zoo model from scratch with its recipe.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from pathlib import Path

    from arithinterp.models.train import train

    card = train(args.name, out=Path(args.out) if args.out else None, seed=args.seed, steps=args.steps,
                 progress=not args.no_progress, overwrite=args.overwrite)
    card.pop("history", None)
    return card


@command("train-transcoders", outputs=dict(out="new-dir"))
def train_transcoders_command(args: argparse.Namespace) -> dict:
    """Train a model's transcoders with the plan its shape and task give, and cache them with a card.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    import dataclasses

    from arithinterp.features.cache import cache_folder
    from arithinterp.features.plan import plan_transcoders, train_planned
    from arithinterp.models import load_model
    from arithinterp.outputs import check_target

    if args.operands is not None:
        _check_operands(args.operands)
    model = load_model(args.model)
    out = args.out or cache_folder(model)  # the cache's folder is named by the model's fingerprint: known now
    check_target(out, overwrite=args.overwrite, what="--out", folder=True)
    plan = plan_transcoders(model, template=args.template, few_shot=args.few_shot, operands=args.operands,
                            seed=args.seed)
    changes = {name: value for name, value in (("steps", args.steps), ("n_train", args.prompts)) if value is not None}
    plan = dataclasses.replace(plan, **changes)
    card = train_planned(model, plan, out, overwrite=args.overwrite, progress=not args.no_progress)[1]
    return dict(command="train-transcoders", model=args.model, out=card["out"], wall_seconds=card["wall_seconds"],
                replacement=card["replacement"], layers=card["layers"], plan=card["plan"])


@command("graph", outputs=dict(_ANALYSIS_OUTPUTS, html="file"))
def graph_command(args: argparse.Namespace) -> dict:
    """The attribution graph of one prompt over the model's transcoders: shipped (zoo), cached by
    ``arithinterp train-transcoders``, or ``--transcoders DIR``.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    from arithinterp.features import load_transcoders
    from arithinterp.features.cache import require_transcoders
    from arithinterp.features.graph import prompt_graph
    from arithinterp.models import load_model

    if args.transcoders is not None and not args.transcoders.strip():  # not the shipped ones, unasked
        raise ConfigError("--transcoders: '' is an empty path; give a folder of saved transcoders, or leave "
                          "--transcoders out for the model's shipped or cached ones")
    if args.grids and not args.html:
        raise ConfigError("--grids draws operand plots in the --html page; give --html FILE too")
    model = load_model(args.model)
    transcoders = load_transcoders(args.transcoders) if args.transcoders else require_transcoders(model)
    graph = prompt_graph(model, args.prompt, transcoders, n_logits=args.logits, max_nodes=args.max_nodes,
                         max_feature_nodes=args.max_feature_nodes)
    columns = ["layer", "position", "token", "feature", "activation", "influence"]
    kept = [node for node in graph.nodes if node["kept"] and node["kind"] == "feature"]
    top = [{c: node[c] for c in columns} for node in sorted(kept, key=lambda n: -n["influence"])[:10]]
    summary = dict(command="graph", model=args.model, prompt=graph.prompt, scores=graph.scores, top_features=top)
    if args.html:
        grids = _graph_grids(model, transcoders, graph, args.prompt) if args.grids else None
        graph.to_html(args.html, overwrite=args.overwrite, grids=grids)
        summary["html"] = args.html
    return _finish(graph, args, summary)


def _graph_grids(model: Any, transcoders: Any, graph: Any, text: str) -> list:
    """The operand plots of the graph's kept features for ``--grids``: each at its position's role in
    the prompt (read as an arithmetic problem of the plan's template), over the plan's grid."""
    from arithinterp.features.operand_plots import graph_feature_grids
    from arithinterp.features.plan import plan_transcoders, transcoder_plots
    from arithinterp.tasks import parse_prompt

    plan = plan_transcoders(model)
    prompt = parse_prompt(model, text, op=plan.op, template=plan.template)
    return graph_feature_grids(graph, transcoder_plots(model, transcoders), prompt)


# --- parser --------------------------------------------------------------------------------------


@command("das", outputs=_ANALYSIS_OUTPUTS)
def das_command(args: argparse.Namespace) -> dict:
    """Distributed alignment search for one causal variable at one site, or over layers x positions.

    Args:
        args: The parsed command line (:func:`build_parser`).

    Returns:
        The command's JSON-able summary, printed by :func:`main`.
    """
    import pandas as pd

    from arithinterp import causal

    for flag in ("layers", "resume"):  # not silently ignored
        if getattr(args, flag) is not None and not args.every_layer:
            raise ConfigError(f"--{flag} is for --every-layer; give --every-layer too")
    if args.resume is not None and not args.resume.strip():  # Path("") is the current folder
        raise ConfigError("--resume: '' is an empty path; give the --out folder of the interrupted run")
    resume = causal.DASLayersResult.load(args.resume) if args.resume is not None else None  # before any work
    layers = _int_list(args.layers, "--layers") if args.layers is not None else None  # before any work
    positions = _items(args.position, "--position")
    if not args.every_layer and len(positions) != 1:
        raise ConfigError(f"--position takes one position without --every-layer, got {args.position!r}")
    together = _items(positions[0], "--position", sep="+")  # "final+answer[0]": positions through one subspace
    model, prompts = _model_and_prompts(args)
    dataset = causal.interchange_dataset(prompts, args.variable, n=args.pairs, seed=args.seed, shuffle=args.shuffle,
                                         value_from=args.value_from)
    if args.every_layer:
        fits = causal.das_layers(model, dataset, args.site, args.k, layers=layers, positions=positions,
                                 steps=args.steps, lr=args.lr, reachable_only=args.reachable_only, seed=args.seed,
                                 resume=resume, progress=not args.no_progress)
        summary: dict[str, Any] = dict(variable=args.variable, pairs=len(dataset), site=args.site, k=args.k,
                                       chance=round(dataset.chance, 4))
        if fits.meta["stopped"]:  # interrupted: the cells finished are saved, and --resume fits the rest
            summary.update(stopped=fits.meta["stopped"], cells_done=int(sum(map(sum, fits.meta["done"]))),
                           cells=fits.iia.numel())
        try:
            layer, position, iia = fits.best()
            summary.update(best_layer=layer, best_position=position, best_iia=round(iia, 4))
        except AnalysisError as error:  # every cell NaN: the fits are saved, and the run says it found nothing
            summary.update(best_layer=None, best_position=None, best_iia=None, failed=str(error))
        return _finish(fits, args, summary)
    result = causal.das(model, dataset, args.site, args.layer, args.k,
                        positions=together if len(together) > 1 else together[0], method=args.method,
                        reachable_only=args.reachable_only, head=args.head, per_position=args.per_position,
                        steps=args.steps, lr=args.lr, seed=args.seed, progress=not args.no_progress)
    rows = result.to_frame()[["intervention", "k", "iia", "iia_low", "iia_high", "logit_diff"]].round(4)
    assert isinstance(rows, pd.DataFrame)
    return _finish(result, args, dict(variable=args.variable, pairs=len(dataset), held_out=len(dataset.test),
                                      site=result.site, layer=args.layer, position=positions[0],
                                      chance=round(result.chance, 4), unreachable=result.meta["unreachable"],
                                      scores=rows.to_dict("records")))


def _int_list(text: str, flag: str) -> list[int]:
    """A comma-separated list of ints from a flag (``0,2,5``), else a ConfigError naming the flag."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(re.fullmatch(r"-?\d+", p) for p in parts):
        raise ConfigError(f"{flag} takes comma-separated whole numbers, e.g. 0,1,2; got {text!r}")
    repeated = sorted({p for p in parts if parts.count(p) > 1}, key=int)
    if repeated:
        raise ConfigError(f"{flag}: {', '.join(repeated)} named more than once in {text!r}; name each once")
    return [int(p) for p in parts]


def build_parser() -> argparse.ArgumentParser:
    """The ``arithinterp`` command line: one subparser per command of :data:`COMMANDS`.

    Returns:
        The parser.
    """
    from arithinterp._version import __version__
    from arithinterp.checks import STEPS_MAX
    from arithinterp.models.zoo import ZOO

    parser = argparse.ArgumentParser(
        prog="arithinterp",
        description="How does a language model do arithmetic? Patching, probes, Fourier/helix fits, "
        "heuristic neurons and reports for TransformerLens models.",
    )
    parser.add_argument("--version", action="version", version=f"arithinterp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from arithinterp.report import DEFAULT_BUDGET, STAGES

    p = sub.add_parser("report", help="run the standard analyses on a model and write an offline HTML report")
    p.add_argument("model", nargs="?", default=None,
                   help="model spec (default: zoo:add-100, or with --plan the plan's model)")
    p.add_argument("--out", default="report.html", help="output HTML file (default: report.html)")
    p.add_argument("--overwrite", action="store_true", help="replace --out when it exists")
    p.add_argument("--stages", default=None, help=f"comma-separated stages to run (default: all of {','.join(STAGES)})")
    p.add_argument("--limit", type=int, default=2000, help="at most this many task prompts (default: 2000)")
    p.add_argument("--seed", type=_whole(0, SEED_MAX), default=0,
                   help="random seed for sampling and counterfactuals (default: 0)")
    p.add_argument("--template", default=None,
                   help="prompt template with {a} and {b} (default: the zoo task's, else {a}+{b}=)")
    p.add_argument("--few-shot", type=int, default=0, help="solved examples before each prompt (default: 0)")
    p.add_argument("--operands", default=None, help="operand values for a and b: LO-HI (inclusive) or 1,5,9 "
                   "(default: the zoo task's, else the single-token numbers below 100)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help=f"seconds of model work at the reference rate (one thread of the machine the cost model was "
                   f"measured on) for the evaluation and all stages together; stages sample fewer prompts, pairs, "
                   f"layers or steps to fit their share and say so. The plan depends on it, never on this machine "
                   f"(default: {DEFAULT_BUDGET:.0f})")
    p.add_argument("--plan", default=None, metavar="PAGE",
                   help="run the plan recorded in a report page again (its model, task, samples and layers): "
                   "the same numbers")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="instead of --budget, fit wall-clock seconds on this machine (the samples then depend on "
                   "the machine and its load; the page says so)")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="memory each stage's batches may use beyond the model, e.g. 2GiB or 512MB "
                   "(default: half the available memory, at most 2 GiB)")
    p.add_argument("--all-prompts", action="store_true",
                   help="analyse every evaluated prompt, not only the correctly answered ones (e.g. a random model)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")

    from arithinterp import sweep

    sweep.add_cli(sub)
    COMMANDS["sweep"] = sweep.run_cli
    OUTPUTS["sweep"] = {}  # the sweep checks its --out and --plot itself (a dry run creates nothing)

    def analysis(name: str, help: str, default_model: str = "zoo:add-100"):
        p = sub.add_parser(name, help=help)
        p.add_argument("model", nargs="?", default=default_model, help=f"model spec (default: {default_model})")
        p.add_argument("--limit", type=int, default=1000, help="at most this many task prompts (default: 1000)")
        p.add_argument("--seed", type=_whole(0, SEED_MAX), default=0,
                       help="random seed for sampling and counterfactuals (default: 0)")
        p.add_argument("--out", default=None, help="directory to save the result in (reload with Result.load)")
        p.add_argument("--figure", default=None, help="write the result's figure to this HTML file")
        p.add_argument("--overwrite", action="store_true",
                       help="replace a different result already saved in --out, and an existing --figure file")
        p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
        p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")
        return p

    p = analysis("patch", "exact activation patching of one site over layers x positions")
    p.add_argument("--site", default="resid_pre",
                   help="site to patch, e.g. resid_pre, attn_out, mlp_out, attn_z, mlp_post")
    p.add_argument("--metric", default="logit_diff", help="logit_diff, prob, logprob or ie (default: logit_diff)")
    p.add_argument("--vary", default="a", help="what the corrupt prompts change: a, b, both, keep-answer, operator")
    p.add_argument("--direction", default="denoise", help="denoise (patch clean into corrupt) or noise")
    p.add_argument("--normalize", action="store_true", help="scale effects to 0 = corrupt, 1 = clean")
    p = analysis("probe", "probe a label at every layer and position, with a shuffled control")
    p.add_argument("--target", default="answer",
                   help="label to probe: a, b, answer, answer_units, a_tens, carry_tens, ...")
    p.add_argument("--kind", default="logistic", help="logistic, ridge, circular or mlp (default: logistic)")
    p.add_argument("--site", default="resid_post", help="activation site (default: resid_post)")
    p.add_argument("--positions", default="a,b,final", help="comma-separated positions (default: a,b,final)")
    p.add_argument("--cv", type=int, default=5, help="cross-validation folds (default: 5)")
    p = analysis("fourier", "Fourier spectrum and key frequencies of the number embeddings")
    p.add_argument("--numbers", type=_whole(2), default=100, help="spectrum over numbers 0..N-1 (default: 100)")
    p = analysis("helix", "fit a helix at an operand token and test it causally")
    p.add_argument("--layer", type=int, default=0, help="layer whose resid_pre is fitted and patched (default: 0)")
    p.add_argument("--position", default="a", choices=("a", "b"), help="operand position: a or b (default: a)")
    p.add_argument("--periods", default="2,5,10,100", help="comma-separated periods (default: 2,5,10,100)")
    p.add_argument("--kind", default="helix", help="helix, circle, poly or linear (default: helix)")
    p = analysis("neurons", "classify the most important MLP neurons into heuristics")
    p.add_argument("--top-k", type=int, default=50, help="most important neurons per layer (default: 50)")
    p.add_argument("--threshold", type=float, default=0.6, help="score needed to assign a heuristic (default: 0.6)")

    p = analysis("ablate", "ablate components and compare accuracy with the full model")
    p.add_argument("--components", default="attn0",
                   help="comma-separated components: attn0, mlp1, L0H2, L1N7, each optionally @a, @b, "
                   "@final, @answer[1] (answer token 1, with --full-answer) or @3 (default: attn0)")
    p.add_argument("--ablation", default="mean", help="zero, mean or resample (default: mean)")
    p.add_argument("--full-answer", action="store_true",
                   help="score every answer token, teacher-forced (multi-token answers)")
    p = analysis("digits", "which head computes which answer digit (multi-token answers)",
                 default_model="zoo:add-3digit")
    p.add_argument("--ablation", default="mean", help="zero, mean or resample (default: mean)")

    p = analysis("circuit", "score every edge (path patching, EAP, EAP-IG) and keep the smallest faithful circuit")
    p.add_argument("--method", default="eap-ig",
                   help="eap-ig, eap-ig-activations, eap, exact or auto (exact where it costs about as much as "
                        "eap-ig; default: eap-ig)")
    p.add_argument("--ig-steps", type=int, default=5, help="EAP-IG interpolation steps (default: 5)")
    p.add_argument("--positions", default=None,
                   help="comma-separated positions for a per-position graph, e.g. a,b,final (default: position-free)")
    p.add_argument("--metric", default="logit_diff", help="logit_diff, prob, logprob or ie (default: logit_diff)")
    p.add_argument("--vary", default="a", help="what the corrupt prompts change: a, b, both, keep-answer, operator")
    p.add_argument("--top", type=int, default=None, help="keep this many edges instead of searching for --target")
    p.add_argument("--target", type=float, default=0.9,
                   help="normalised faithfulness the kept top-k must reach (default: 0.9)")
    p.add_argument("--ablation", default="resample", choices=("resample", "mean"),
                   help="how edges outside the circuit are ablated: resample or mean")
    p.add_argument("--html", default=None, help="write the circuit's interactive page (offline) to this HTML file")

    p = analysis("das", "distributed alignment search: where a causal variable (a carry, a digit) is used",
                 default_model="zoo:add-3digit")
    p.add_argument("--variable", required=True, help="causal variable, e.g. carry_hundreds (the carry into the "
                   "hundreds), answer_units, sum_mod_10, magnitude")
    p.add_argument("--site", default="resid_post", help="vector site (default: resid_post)")
    p.add_argument("--layer", type=int, default=0, help="layer (default: 0)")
    p.add_argument("--position", default="final", help="position, e.g. final, b, answer[0], or final+answer[0] "
                   "(swapped together); with --every-layer a comma-separated list (default: final)")
    p.add_argument("--k", type=int, default=2, help="dimensions interchanged (default: 2)")
    p.add_argument("--method", default="das", help="das or boundless (default: das)")
    p.add_argument("--steps", type=_whole(1, STEPS_MAX), default=200, help="training steps (default: 200)")
    p.add_argument("--lr", type=_learning_rate, default=1e-2, help="learning rate (default: 0.01)")
    p.add_argument("--pairs", type=int, default=None, help="interchange pairs (default: one per prompt)")
    p.add_argument("--shuffle", action="store_true", help="the control: the variable's value from a random prompt")
    p.add_argument("--value-from", default=None, help="the other control: the variable's value from another variable "
                   "(product_parity for a carry)")
    p.add_argument("--reachable-only", action="store_true", help="train and score only the pairs the position can "
                   "reach (counterfactual equal to the base before it)")
    p.add_argument("--head", type=int, default=None, help="with --site attn_z: the head whose output is swapped")
    p.add_argument("--per-position", action="store_true", help="with a+b positions: each its own subspace")
    p.add_argument("--every-layer", action="store_true", help="fit every layer (or --layers) x --position")
    p.add_argument("--layers", default=None, help="with --every-layer: comma-separated layers (default: all)")
    p.add_argument("--resume", default=None, help="with --every-layer: the --out folder of an interrupted run of this "
                   "same command; its finished cells are kept and only the rest are fitted")

    p = sub.add_parser("info", help="list the model zoo and evaluate a model on its task")
    p.add_argument("model", nargs="?", default=None, help="model spec, e.g. zoo:add-100 (default: only list the zoo)")
    p.add_argument("--limit", type=int, default=2000, help="held-out problems to evaluate (default: 2000)")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")

    p = sub.add_parser("train", help="train a zoo model from scratch with its recipe")
    p.add_argument("name", choices=sorted(ZOO), help="zoo model to train")
    p.add_argument("--out", default=None, help="output directory (default: the package's checkpoint folder, "
                   "replaced only with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace what --out already holds")
    p.add_argument("--seed", type=_whole(0, SEED_MAX), default=None, help="random seed (default: the recipe's)")
    p.add_argument("--steps", type=_whole(1, STEPS_MAX), default=None, help="optimizer steps (default: the recipe's)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")
    p = sub.add_parser("graph", help="attribution graph of one prompt over transcoder features")
    p.add_argument("model", help="model spec, e.g. zoo:add-100")
    p.add_argument("prompt", help='the prompt, e.g. "36+59="')
    p.add_argument("--transcoders", default=None, help="saved transcoders (default: the model's "
                   "shipped or cached ones, from `arithinterp train-transcoders`)")
    p.add_argument("--logits", type=int, default=1, help="answer tokens the graph explains (default: 1)")
    p.add_argument("--max-nodes", type=int, default=100, help="at most this many kept nodes (default: 100)")
    p.add_argument("--max-feature-nodes", type=int, default=1000,
                   help="at most this many features have their incoming edges computed, the most influential "
                        "first (default: 1000)")
    p.add_argument("--out", default=None, help="directory to save the graph in (reload with AttributionGraph.load)")
    p.add_argument("--figure", default=None, help="write the graph's figure to this HTML file")
    p.add_argument("--html", default=None, help="write the graph's interactive page (offline) to this HTML file")
    p.add_argument("--grids", action="store_true",
                   help="with --html: each kept feature's operand plot over the task's a x b grid")
    p.add_argument("--overwrite", action="store_true", help="replace a graph already saved in --out, and an existing "
                   "--figure or --html file")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")

    p = sub.add_parser("train-transcoders", help="train a model's transcoders (any model) and cache them for the "
                       "report, the notebooks and `arithinterp graph`")
    p.add_argument("model", help="model spec: zoo:NAME, a Hugging Face folder, a .gguf file, pkg:gemma-3-270m")
    p.add_argument("--out", default=None, help="output directory (default: this model's folder in the user cache, "
                   "where they are found again)")
    p.add_argument("--overwrite", action="store_true", help="replace what --out already holds")
    p.add_argument("--template", default=None, help="prompt template (default: the zoo task's, else '{a}+{b}=')")
    p.add_argument("--few-shot", type=_whole(0, 64), default=None,
                   help="solved examples before each prompt (default: 0 for zoo models, else 3)")
    p.add_argument("--operands", default=None, help="operand values for a and b: LO-HI (inclusive) or 1,5,9 "
                   "(default: the zoo task's, else 0-99)")
    p.add_argument("--seed", type=_whole(0, SEED_MAX), default=0, help="random seed (default: 0)")
    p.add_argument("--steps", type=_whole(1, STEPS_MAX), default=None,
                   help="optimizer steps per layer (default: the plan's)")
    p.add_argument("--prompts", type=_whole(10, 10**6), default=None,
                   help="training prompts (default: the plan's, from the model's size)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON summary")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``arithinterp`` command.

    Args:
        argv: The arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 on a library error or no command, 1 on another error with
        ``--json``, 130 when interrupted (Ctrl-C at any moment: one line, no traceback).
    """
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # while the parser is built (the first seconds import torch) or the summary printed
        print("arithinterp: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # argparse has printed its usage message on stderr
        if stop.code and "--json" in argv:
            name = next((a for a in argv if a in COMMANDS), "")
            print(json.dumps(dict(command=name, error="invalid arguments; see the usage message on stderr",
                                  error_type="UsageError", exit_code=stop.code), indent=2))
        raise
    if not args.command:
        parser.print_help()
        return 2
    as_json = getattr(args, "json", False)
    try:
        with warnings.catch_warnings():  # one plain line per warning, not the library's source line
            warnings.showwarning = lambda message, *rest, **kw: print(
                f"arithinterp {args.command}: warning: {message}", file=sys.stderr)
            check_outputs(args)
            summary = COMMANDS[args.command](args)
    except KeyboardInterrupt:  # what was finished is kept (the report's page, a sweep's cells): no traceback
        print(f"arithinterp {args.command}: interrupted", file=sys.stderr)
        return 130
    except ArithInterpError as error:
        return fail(args.command, error, 2, as_json)
    except Exception as error:
        if not as_json:
            raise
        import traceback

        traceback.print_exc()  # the full story on stderr; a JSON object on stdout all the same
        return fail(args.command, error, 1, as_json)
    print_summary(summary, as_json)
    if summary.get("stopped") == "interrupted":  # a partial result was kept (das --every-layer: --resume it)
        return 130
    return 1 if summary.get("failed") else 0  # e.g. sweep cells that failed (they retry on the next run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
