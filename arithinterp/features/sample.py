"""Attribution graphs over a sample of prompts: how often each feature is kept in the pruned
graph and its mean influence on the answer (Ameisen et al. 2025 read many prompts' graphs to
find the features a task reuses)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import pandas as pd
from tqdm.auto import tqdm

from arithinterp.errors import AnalysisError
from arithinterp.features.graph import attribution_graph
from arithinterp.features.transcoder import Transcoders
from arithinterp.results import Result, build_meta


@dataclasses.dataclass(frozen=True)
class GraphSample(Result):
    """Feature nodes of the graphs of ``prompts``: ``features`` one dict per (layer, feature,
    position counted from the end, ``-1`` the last) with ``active`` / ``kept`` (in how many graphs),
    ``sum_influence`` and ``label``; ``scores`` one dict per prompt (the graph's scores)."""

    prompts: list
    features: list
    scores: list
    meta: dict

    def to_frame(self) -> pd.DataFrame:
        """One row per feature and position: ``kept_fraction`` (of the prompts), ``active_fraction``,
        ``mean_influence`` (over all prompts, 0 where inactive), most often kept first."""
        frame = pd.DataFrame(self.features, columns=["layer", "feature", "position", "active", "kept",
                                                     "sum_influence", "label"])
        n = len(self.prompts)
        frame["kept_fraction"] = frame["kept"] / n
        frame["active_fraction"] = frame["active"] / n
        frame["mean_influence"] = frame["sum_influence"] / n
        frame = frame.drop(columns=["sum_influence"])
        return frame.sort_values(["kept_fraction", "mean_influence"], ascending=False).reset_index(drop=True)

    def score_frame(self) -> pd.DataFrame:
        """One row per prompt: its graph's replacement score, completeness, kept influence and nodes."""
        return pd.DataFrame([dict(prompt=p, **s) for p, s in zip(self.prompts, self.scores)])

    def plot(self, **kwargs: Any):
        from arithinterp.viz.features import plot_graph_sample

        return plot_graph_sample(self, **kwargs)


def graph_sample(model: Any, prompts: Sequence[str], transcoders: Transcoders, *, labels: Optional[dict] = None,
                 progress: bool = True, **graph: Any) -> GraphSample:
    """The :func:`~arithinterp.features.attribution_graph` of each of ``prompts`` (strings;
    ``graph`` goes to it, e.g. ``node_threshold``), aggregated per feature and position from the
    end. ``labels``: ``{(layer, feature): text}``."""
    prompts = list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise AnalysisError(f"prompts must be a non-empty list of strings, got {prompts[:3]!r}")
    seen: dict[tuple, dict] = {}
    scores = []
    for prompt in tqdm(prompts, desc="graphs", disable=None if progress else True):
        g = attribution_graph(model, prompt, transcoders, labels=labels, progress=False, **graph)
        T = len(g.tokens)
        scores.append({k: v for k, v in g.scores.items()})
        for node in g.nodes:
            if node["kind"] != "feature":
                continue
            key = (node["layer"], node["feature"], node["position"] - T)
            row = seen.setdefault(key, dict(layer=key[0], feature=key[1], position=key[2], active=0, kept=0,
                                            sum_influence=0.0, label=node["label"]))
            row["active"] += 1
            row["kept"] += int(node["kept"])
            row["sum_influence"] += float(node["influence"])
    meta = build_meta(model, n_prompts=len(prompts), **{k: v for k, v in graph.items() if isinstance(v, (int, float))})
    return GraphSample(prompts=prompts, features=list(seen.values()), scores=scores, meta=meta)
