"""Attribution graphs over a sample of prompts: how often each feature is kept in the pruned
graph and its mean influence on the answer (Ameisen et al. 2025 read many prompts' graphs to
find the features a task reuses)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import pandas as pd
import torch

from arithinterp.checks import check_belongs, check_fingerprint
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.features.graph import prompt_graph
from arithinterp.features.transcoder import Transcoders
from arithinterp.progress import progress_bar
from arithinterp.results import Result, build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import HookedModel, PositiveFiniteFloat, checked


@dataclasses.dataclass(frozen=True)
class GraphSample(Result):
    """Feature nodes of the graphs of several prompts.

    Attributes:
        prompts: The prompts done.
        features: One dict per (layer, feature, position counted from the end, ``-1`` the last)
            with ``active`` / ``kept`` (in how many graphs), ``sum_influence`` and ``label``.
        scores: One dict per prompt: the graph's scores.
        meta: Provenance, ``n_done`` of ``n_requested`` and why the work stopped.
    """

    prompts: list
    features: list
    scores: list
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"prompts": "prompt", "scores": "prompt"}

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
        return draw(self, **kwargs)


@checked
def graph_sample(model: HookedModel, prompts: PromptSet, transcoders: Transcoders, *, labels: Optional[dict] = None,
                 max_seconds: Optional[PositiveFiniteFloat] = None, resume: Optional[GraphSample] = None,
                 progress: bool = True, **graph: Any) -> GraphSample:
    """The :func:`~arithinterp.features.attribution_graph` of each of ``prompts`` (``graph`` goes to
    it, e.g. ``node_threshold``), aggregated per feature and position from the end. ``labels``:
    ``{(layer, feature): text}``.

    Every prompt is checked (as ``attribution_graph`` checks one) before the first graph. Graphs
    are slow on large models, so the work can stop early and go on later: with ``max_seconds`` no
    new graph starts once that much time has passed (the first always runs), and Ctrl-C
    (``KeyboardInterrupt``) stops after the graphs finished so far; either way the result holds the
    prompts done (``meta["n_done"]`` of ``meta["n_requested"]``, ``meta["stopped"]`` says why) and
    ``resume=`` that result continues with the rest.

    Args:
        model: The hooked model.
        prompts: The prompts (each analysed without its padding).
        transcoders: The transcoders.
        labels: ``{(layer, feature): text}``.
        max_seconds: No new graph starts once this much time has passed.
        resume: A partial result to continue.
        progress: Show a progress bar.
        **graph: Options of :func:`~arithinterp.features.attribution_graph` (``node_threshold``, ...).

    Returns:
        The aggregate over the prompts done.

    Raises:
        ConfigError: No prompts, or an option attribution_graph does not take.
        AnalysisError: ``resume`` holds graphs of other prompts.
        ModelMismatchError: Prompts or transcoders made for another model.
    """
    import time
    import warnings

    check_belongs(model, "features.graph_sample", prompts=prompts)
    if len(prompts) == 0:
        raise ConfigError("prompts is empty; give at least one prompt")
    texts = list(prompts.texts)
    unknown = sorted(set(graph) - set(inspect.signature(prompt_graph).parameters) - {"progress", "labels"})
    if unknown:
        raise ConfigError(f"graph_sample: unknown option(s) {unknown} for attribution_graph")
    transcoders.check_model(model)
    seen: dict[tuple, dict] = {}
    scores: list = []
    done = 0
    if resume is not None:
        if list(resume.prompts) != texts[: len(resume.prompts)]:
            raise AnalysisError("resume holds graphs of other prompts: its prompts must be the first of these")
        check_fingerprint(model, resume.meta.get("fingerprint"), "graph sample to resume", "graph_sample")
        done = len(resume.prompts)
        scores = [dict(s) for s in resume.scores]
        seen = {(row["layer"], row["feature"], row["position"]): dict(row) for row in resume.features}
    start, stopped = time.perf_counter(), None
    bar = progress_bar(total=len(prompts), initial=done, desc="graphs", disable=None if progress else True)
    try:
        for i in range(done, len(prompts)):
            if max_seconds is not None and done > 0 and time.perf_counter() - start > max_seconds:
                stopped = "max_seconds"
                break
            tokens = prompts.unpadded(torch.tensor([i]))[0]
            g = prompt_graph(model, tokens, transcoders, labels=labels, progress=False, **graph)
            T = len(g.tokens)
            for node in g.nodes:
                if node["kind"] != "feature":
                    continue
                key = (node["layer"], node["feature"], node["position"] - T)
                row = seen.setdefault(key, dict(layer=key[0], feature=key[1], position=key[2], active=0, kept=0,
                                                sum_influence=0.0, label=node["label"]))
                row["active"] += 1
                row["kept"] += int(node["kept"])
                row["sum_influence"] += float(node["influence"])
            scores.append({k: v for k, v in g.scores.items()})  # last: a prompt counts once all of it is in
            done += 1
            bar.update(1)
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        bar.close()
    if stopped is not None:
        if done == 0:
            raise AnalysisError(f"graph_sample stopped ({stopped}) before its first graph was finished")
        warnings.warn(f"graph_sample stopped ({stopped}) after {done} of {len(prompts)} prompts; pass the result as "
                      "resume= to go on with the rest", stacklevel=2)
    meta = build_meta(model, n_prompts=done, n_requested=len(prompts), n_done=done, stopped=stopped,
                      **{k: v for k, v in graph.items() if isinstance(v, (int, float))})
    return GraphSample(prompts=texts[:done], features=list(seen.values()), scores=scores, meta=meta)
