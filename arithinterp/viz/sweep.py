"""Figures of a sweep: each builder takes an analysis's combined tidy table (``load_results``) and
returns a list of plotly figures, one per cell or one comparing cells.

Cells are labelled by the identity columns (``frame.attrs["cell_columns"]``: model, task and the
analysis's parameters) that vary across the table, so a sweep over sites reads ``site=attn_out``.
"""

from __future__ import annotations

from typing import Any, Optional

import plotly.graph_objects as go

from arithinterp.viz.base import bars, cycle_colour, figure, heatmap, layer_lines

_IDENTITY = ("cell", "model", "task", "analysis")


def _cell_columns(frame) -> list[str]:
    columns = frame.attrs.get("cell_columns") or ["model", "task"]
    return [c for c in columns if c in frame.columns]


def cell_labels(frame) -> dict[str, str]:
    """``{cell id: label}``, the label naming only what differs between cells (or the model/task)."""
    per_cell = frame.drop_duplicates("cell").set_index("cell")
    columns = _cell_columns(frame)
    varying = [c for c in columns if per_cell[c].astype(str).nunique() > 1] or [
        c for c in ("model", "task") if c in columns
    ]
    labels = {}
    for cid, row in per_cell.iterrows():
        parts = [str(row[c]) if c in ("model", "task") else f"{c}={row[c]}" for c in varying]
        labels[cid] = " · ".join(parts) or cid
    # two cells with the same visible label (e.g. equal params, other seeds) stay distinct
    seen: dict[str, int] = {}
    for cid in labels:
        seen[labels[cid]] = seen.get(labels[cid], 0) + 1
        if seen[labels[cid]] > 1:
            labels[cid] = f"{labels[cid]} [{cid[:6]}]"
    return labels


def _cells(frame):
    """``(label, rows)`` per cell, dropping columns a cell leaves empty."""
    labels = cell_labels(frame)
    for cid, rows in frame.groupby("cell", sort=False):
        yield labels[cid], rows.dropna(axis=1, how="all")


def plot_sweep_accuracy(frame) -> list[go.Figure]:
    """One bar per cell: greedy accuracy on the task."""
    labels = cell_labels(frame)
    values = {labels[c]: float(v) for c, v in frame.groupby("cell", sort=False)["accuracy"].mean().items()}
    fig = bars(values, title="Accuracy per cell", y_title="accuracy (fraction correct)")
    fig.update_yaxes(range=[0, 1.02])
    return [fig]


def _position_label(rows) -> list[str]:
    firsts = rows.drop_duplicates("position")
    if "token" in rows.columns:
        return [f"{p}: {t}" for p, t in zip(firsts["position"], firsts["token"])]
    return [str(p) for p in firsts["position"]]


GAP = "fraction of the clean–corrupt gap"  # (patched − corrupt) / (clean − corrupt): 0 as corrupt, 1 as clean


def _patch_values(rows, normalize: bool) -> tuple[Any, str, str]:
    """``(rows with mean / ci_low / ci_high to draw, the value's name, what the title says of it)``:
    as the fraction of the clean–corrupt gap where ``normalize`` and the table allows it, else the metric."""
    metric = rows["metric"].iloc[0] if "metric" in rows.columns else "effect"
    if "normalize" in rows.columns and bool(rows["normalize"].iloc[0]):
        return rows, GAP, f"{GAP}, normalised per pair by the analysis"
    if not normalize or not {"clean_baseline", "corrupt_baseline"} <= set(rows.columns):
        why = "" if not normalize else " (this table has no baselines to normalise by: rerun it to add them)"
        return rows, metric, f"raw {metric}{why}"
    clean, corrupt = float(rows["clean_baseline"].iloc[0]), float(rows["corrupt_baseline"].iloc[0])
    gap = clean - corrupt
    if gap == 0:
        return rows, metric, f"raw {metric} (clean and corrupt runs score alike: no gap to normalise by)"
    scaled = rows.copy()
    for column in ("mean", "ci_low", "ci_high"):
        if column in scaled.columns:
            scaled[column] = (scaled[column] - corrupt) / gap
    if gap < 0 and {"ci_low", "ci_high"} <= set(scaled.columns):  # a negative gap turns the interval round
        scaled[["ci_low", "ci_high"]] = scaled[["ci_high", "ci_low"]].to_numpy()
    return scaled, GAP, f"{GAP} (clean {clean:.3g}, corrupt {corrupt:.3g} {metric})"


def plot_sweep_patching(frame, normalize: bool = True) -> list[go.Figure]:
    """Per cell: a layer × position heatmap; with heads or neurons, one row per layer and unit and one
    column per position, or (cells that patch every position at once) a layer × unit heatmap; with
    neither, the effect over layers with its interval.

    Args:
        frame: The sweep's combined ``patching`` table.
        normalize: Draw each cell as the fraction of the clean–corrupt gap it restores, ``(patched −
            corrupt) / (clean − corrupt)`` with the unpatched runs' means (0: the corrupt run's metric,
            1: the clean run's), which puts cells of different sites and counterfactuals on one scale;
            ``False``: the raw metric. Cells the analysis normalised already are drawn as they are.

    Returns:
        One figure per cell, titled with what was patched and how, and what the colour is.
    """
    figs = []
    for label, rows in _cells(frame):
        rows, value_name, value_text = _patch_values(rows, normalize)
        site = rows["site"].iloc[0] if "site" in rows.columns else "?"
        method = rows["method"].iloc[0] if "method" in rows.columns else "exact"
        direction = rows["direction"].iloc[0] if "direction" in rows.columns else "denoise"
        every_position = "position" not in rows.columns  # per_position=False: one patch over all positions
        how = f"{direction}, every position at once" if every_position else direction
        title = f"{method.capitalize()} patching of {site} ({how}) · {label}<br><sub>colour: {value_text}</sub>"
        unit = next((u for u in ("head", "neuron") if u in rows.columns), None)
        layers = [int(layer) for layer in dict.fromkeys(rows["layer"])]
        if unit is not None:
            rows = rows.assign(**{unit: rows[unit].astype(int)})  # a combined table stores them as floats
        if unit is not None and every_position:
            table = rows.pivot_table(index="layer", columns=unit, values="mean", sort=False)
            figs.append(heatmap(table.values, title=title, x_labels=[int(u) for u in table.columns],
                                y_labels=[f"L{int(layer)}" for layer in table.index], x_title=unit, y_title="layer",
                                value_name=value_name))
        elif "position" in rows.columns:
            index = ["layer", unit] if unit is not None else ["layer"]
            table = rows.pivot_table(index=index, columns="position", values="mean", sort=False)
            table = table.reindex(columns=list(dict.fromkeys(rows["position"])))
            names = ([f"L{int(layer)} {unit[0].upper()}{int(u)}" for layer, u in table.index] if unit is not None
                     else [f"L{int(layer)}" for layer in table.index])
            figs.append(heatmap(table.values, title=title, x_labels=_position_label(rows), y_labels=names,
                                x_title="position: token", y_title=f"layer {unit}" if unit else "layer",
                                value_name=value_name))
        else:
            series = rows.groupby("layer", sort=False)
            bands = ({value_name: (series["ci_low"].mean().values, series["ci_high"].mean().values)}
                     if "ci_low" in rows.columns else None)
            figs.append(layer_lines({value_name: series["mean"].mean().values}, title=title, y_title=value_name,
                                    layers=layers, bands=bands))
    return figs


def plot_sweep_ablation(frame) -> list[go.Figure]:
    """Accuracy of the full and the ablated model, side by side for every cell."""
    labels = cell_labels(frame)
    fig = figure("Accuracy with components ablated", "cell", "accuracy (fraction correct)")
    for i, (name, rows) in enumerate([("full model", frame[frame["run"] == "full model"]),
                                      ("ablated", frame[frame["run"] != "full model"])]):
        fig.add_trace(go.Bar(x=[labels[c] for c in rows["cell"]], y=rows["accuracy"], name=name,
                             marker_color=cycle_colour(i),
                             hovertemplate=f"{name}<br>%{{x}}<br>accuracy %{{y:.4g}}<extra></extra>"))
    fig.update_layout(barmode="group")
    fig.update_yaxes(range=[0, 1.02])
    return [fig]


def plot_sweep_probes(frame) -> list[go.Figure]:
    """Per position: held-out probe score over layers, one line per cell, controls dashed."""
    labels = cell_labels(frame)
    figs = []
    for position, rows in frame.groupby("position", sort=False):
        series, bands = {}, {}
        for cid, cell_rows in rows.groupby("cell", sort=False):
            for source, part in cell_rows.groupby("source", sort=False):
                name = labels[cid] if source == "probe" else f"{labels[cid]} ({source} control)"
                series[name] = part["score"].values
                bands[name] = (part["ci_low"].values, part["ci_high"].values)
        layers = list(dict.fromkeys(rows["layer"]))
        metric = rows["metric"].iloc[0]
        fig = layer_lines(series, title=f"Probe score at position {position}", y_title=f"held-out {metric}",
                          layers=layers, bands=bands)
        fig.update_traces(line_dash="dash", selector=lambda trace: bool(trace.name) and "control)" in trace.name)
        figs.append(fig)
    return figs


def plot_sweep_columns(frame, value_columns: Optional[list] = None) -> list[go.Figure]:
    """For any analysis: one bar chart per numeric result column, its mean per cell."""
    labels = cell_labels(frame)
    identity = set(_IDENTITY) | set(_cell_columns(frame))
    numeric = [c for c in frame.columns if c not in identity and frame[c].dtype.kind in "fiu"]
    figs = []
    for column in (value_columns or numeric[:4]):
        means = frame.groupby("cell", sort=False)[column].mean()
        figs.append(bars({labels[c]: float(v) for c, v in means.items()}, title=f"{column} per cell (mean over rows)",
                         y_title=column))
    return figs


def plot_sweep_cells(frame, **layout) -> go.Figure:
    """Seconds each cell took this run, coloured by status (a :class:`SweepRun` table)."""
    colours = {"done": "#109618", "failed": "#dc3912", "pending": "#999999"}
    fig = figure("Sweep cells", "cell", "seconds (this run)", **layout)
    for status, rows in frame.groupby("status", sort=False):
        text = [
            f"{a} · {m} · {t} · {p}"
            for a, m, t, p in zip(rows["analysis"], rows["model"], rows["task"], rows["params"])
        ]
        fig.add_trace(go.Bar(x=rows["cell"], y=rows["seconds"].fillna(0.0), name=status,
                             marker_color=colours.get(status, "#3366cc"), text=text, textposition="none",
                             hovertemplate="%{text}<br>%{y:.3g} s<extra></extra>"))
    fig.update_xaxes(type="category")
    return fig
