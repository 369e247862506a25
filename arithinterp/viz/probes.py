"""Figures for probes and error detection: probe score over layers (with CI bands and controls),
ROC curves and reliability diagrams of the error detector, confusion matrices of digit probes,
repair outcomes."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import plotly.graph_objects as go

from arithinterp.drawing import draws
from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.probes.detector_result import DetectorResult
from arithinterp.probes.probe_result import ProbeResult
from arithinterp.probes.reask import RepairResult
from arithinterp.tasks.places import PLACES
from arithinterp.viz.base import bars, cycle_colour, figure, heatmap, layer_lines


_METRIC_NAMES = {"accuracy": "held-out accuracy", "r2": "held-out R²"}


@draws(ProbeResult)
def plot_probe_layers(result: ProbeResult, position: Optional[str] = None, controls: bool = True,
                      chance: bool = True) -> go.Figure:
    """Mean held-out score over layers with 95% CI bands, one line per position (or ``position``)
    and one per control; a dotted line at chance (majority-class accuracy)."""
    positions = list(result.positions) if position is None else [str(position)]
    for p in positions:
        if p not in result.positions:
            raise AnalysisError(f"position {p!r} is not in this result; accepted: {accepted(result.positions)}")
    low, high = result.ci
    control_low, control_high = result.control_ci
    series, bands = {}, {}
    for p in positions:
        pi = result.positions.index(p)
        name = f"{result.target} @ {p}" if len(positions) > 1 else f"{result.target} ({result.kind} probe)"
        series[name] = result.mean[:, pi]
        bands[name] = (low[:, pi], high[:, pi])
        for c, control in enumerate(result.controls if controls else []):
            control_name = f"{control} control" + (f" @ {p}" if len(positions) > 1 else "")
            series[control_name] = result.control_mean[c, :, pi]
            bands[control_name] = (control_low[c, :, pi], control_high[c, :, pi])
    y_title = _METRIC_NAMES.get(result.metric, str(result.metric))
    title = f"Probing {result.target} in {result.site}"
    if hasattr(result, "finding"):  # what the controls allow to be said, under the title
        finding = result.finding()
        verdict = {"finding": f"finding: layer {finding['layer']}, position '{finding['position']}' beats chance "
                              "and every control",
                   "no random-init control": "above chance and the controls run; no random-init control",
                   "no signal": "no cell beats chance and every control"}[finding["verdict"]]
        title += f"<br><sub>{verdict}</sub>"
    fig = layer_lines(series, title=title, y_title=y_title, layers=result.layers, bands=bands)
    if chance and result.metric == "accuracy":
        fig.add_hline(y=result.chance, line_dash="dot", line_color="grey",
                      annotation_text=f"chance {result.chance:.3g}", annotation_position="bottom right")
    return fig


@draws(DetectorResult)
def plot_detector(result: DetectorResult, kind: str = "roc", digit: Optional[str] = None, probe: str = "true",
                  **kwargs: Any) -> go.Figure:
    """A detector's figure: ``kind="roc"`` (:func:`plot_roc`), ``"calibration"``
    (:func:`plot_calibration`) or ``"confusion"`` (:func:`plot_digit_confusion` of ``digit`` and
    ``probe``).

    Raises:
        ConfigError: An unknown ``kind`` or ``probe``.
    """
    if probe not in ("true", "output"):
        raise ConfigError(f"probe must be 'true' or 'output', got {probe!r}")
    if kind == "roc":
        return plot_roc(result, **kwargs)
    if kind == "calibration":
        return plot_calibration(result, **kwargs)
    if kind == "confusion":
        return plot_digit_confusion(result, digit=digit, probe=probe, **kwargs)
    raise ConfigError(f"unknown plot kind {kind!r}; accepted: {accepted(('roc', 'calibration', 'confusion'))}")


def plot_roc(result: DetectorResult, methods: Optional[list] = None) -> go.Figure:
    """ROC curve of each detector method (correct = positive class), AUROC in the legend."""
    from sklearn.metrics import roc_auc_score
    from sklearn.metrics import roc_curve as sk_roc

    truth = result.correct.bool().numpy()
    if len(np.unique(truth)) < 2:
        raise AnalysisError("a ROC curve needs both correct and wrong answers among the prompts")
    fig = figure("Error detector ROC (positive class: correct answer)", "false positive rate (wrong called correct)",
                 "true positive rate (correct called correct)")
    for i, method in enumerate(methods or result.methods):
        m = result.methods.index(method)
        score = result.scores[:, m].double().numpy()
        fpr, tpr, thresholds = sk_roc(truth, score)
        auroc = roc_auc_score(truth, score)
        fig.add_trace(
            go.Scatter(
                x=fpr,
                y=tpr,
                mode="lines",
                name=f"{method} (AUROC {auroc:.3f})" + (" *" if method == result.method else ""),
                line=dict(color=cycle_colour(i)),
                customdata=thresholds,
                hovertemplate="FPR %{x:.3f}<br>TPR %{y:.3f}<br>threshold %{customdata:.3g}<extra></extra>",
            )
        )
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="chance", line=dict(dash="dot", color="grey")))
    fig.update_xaxes(range=[0, 1])
    fig.update_yaxes(range=[0, 1.02])
    return fig


def plot_calibration(result: DetectorResult, methods: Optional[list] = None, bins: int = 10) -> go.Figure:
    """Reliability diagram: mean predicted P(correct) against the observed fraction correct, in
    ``bins`` equal-count bins per method; the diagonal is perfect calibration."""
    if not (isinstance(bins, int) and bins >= 2):
        raise ConfigError(f"bins must be an integer >= 2, got {bins!r}")
    truth = result.correct.double().numpy()
    fig = figure(
        "Error detector calibration (reliability diagram)", "predicted P(correct)", "observed fraction correct"
    )
    for i, method in enumerate(methods or result.methods):
        if method not in result.methods:
            raise ConfigError(f"unknown method {method!r}; accepted: {accepted(result.methods)}")
        score = result.scores[:, result.methods.index(method)].double().numpy()
        groups = [g for g in np.array_split(np.argsort(score, kind="stable"), min(bins, len(score))) if len(g)]
        x = [float(score[g].mean()) for g in groups]
        y = [float(truth[g].mean()) for g in groups]
        counts = [len(g) for g in groups]
        fig.add_trace(go.Scatter(
            x=x, y=y, mode="lines+markers", name=method + (" *" if method == result.method else ""),
            line=dict(color=cycle_colour(i)), customdata=counts,
            hovertemplate="predicted %{x:.3f}<br>observed %{y:.3f}<br>%{customdata} prompts<extra></extra>",
        ))
    fig.add_trace(
        go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="perfectly calibrated", line=dict(dash="dot", color="grey"))
    )
    fig.update_xaxes(range=[0, 1.02])
    fig.update_yaxes(range=[0, 1.02])
    return fig


def plot_digit_confusion(result: DetectorResult, digit: Optional[str] = None, probe: str = "true",
                         normalise: bool = True) -> go.Figure:
    """Confusion matrix of one digit's slot probe: actual value (rows) vs predicted value (columns),
    titled with the digit and the probe's held-out accuracy.

    Args:
        result: The detector's result.
        digit: One of ``result.slot_names`` (``"tens"``, ``"answer[1]"``); ``None``: the first.
        probe: ``"true"`` (the true digit) or ``"output"`` (the digit the model wrote).
        normalise: Rows as fractions (else counts).

    Returns:
        The heatmap.

    Raises:
        ConfigError: an unknown ``digit`` or ``probe``.
    """
    if probe not in ("true", "output"):
        raise ConfigError(f"probe must be 'true' or 'output', got {probe!r}")
    names = result.slot_names
    digit = names[0] if digit is None else digit
    if digit not in names:
        raise ConfigError(f"unknown digit {digit!r}; this result's answer digits: {accepted(names)}")
    slot = names.index(digit)
    valid = result.slot_valid[:, slot]
    actual = (result.true_slots if probe == "true" else result.output_slots)[valid, slot]
    predicted = (result.pred_true_slots if probe == "true" else result.pred_output_slots)[valid, slot]
    values = sorted(set(actual.tolist()) | set(predicted.tolist()))
    index = {v: i for i, v in enumerate(values)}
    counts = np.zeros((len(values), len(values)))
    np.add.at(counts, ([index[v] for v in actual.tolist()], [index[v] for v in predicted.tolist()]), 1)
    z = counts / np.maximum(counts.sum(1, keepdims=True), 1) if normalise else counts
    what = "true answer" if probe == "true" else "model output"
    label = f"{digit} digit" if digit in PLACES else digit
    accuracy = result.slot_accuracy()[probe][slot]
    return heatmap(z, title=f"{what} probe, {label}: predicted vs actual (held-out accuracy {accuracy:.3f}, "
                            f"{int(valid.sum())} prompts)", x_labels=values, y_labels=values,
                   x_title="predicted value", y_title="actual value",
                   value_name="fraction of row" if normalise else "count", signed=False)


@draws(RepairResult)
def plot_repair(result: RepairResult) -> go.Figure:
    """Counts of what re-asking the flagged prompts did."""
    s = result.summary()
    return bars(
        {"flagged": s["flagged"], "errors flagged": s["errors_flagged"], "new answers accepted": s["accepted"],
         "errors fixed": s["fixed"], "correct broken": s["broken"]},
        title=f"Re-asking flagged prompts ({s['policy']}, accept {s['accept']}): accuracy "
              f"{s['accuracy_before']:.3f} → {s['accuracy_after']:.3f} (net {s['net']:+d})",
        y_title="prompts",
    )
