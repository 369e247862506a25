"""Labelled supernodes: an attribution graph's features grouped by what they compute.

Lindsey et al. 2025 read graphs at the level of *supernodes*, features grouped by hand under a
label ("_6 + _9", "sum ends in 5", "~36"). Here the grouping is automatic, in two steps:

1. **By label** (:func:`label_graph`): each kept feature is labelled from its operand plot at its
   own position's role (:mod:`~arithinterp.features.operand_plots`); features sharing their
   leading label and role form one supernode.
2. **By attribution profile** (as ADAG, Arora et al. 2026, groups features automatically): an
   unlabelled feature joins the labelled supernode at its role whose members act most like it —
   the cosine of its outgoing edges to the graph's kept nodes with theirs at least
   ``min_similarity`` — and the unlabelled features left over are grouped among themselves the
   same way.

:func:`supernodes` returns the groups with the share of the features' influence each holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import pandas as pd
import torch

from arithinterp.errors import ConfigError
from arithinterp.features.graph import AttributionGraph
from arithinterp.features.operand_plots import OperandPlots, graph_roles, label_plots
from arithinterp.tasks import PromptSet
from arithinterp.types import PositiveProbability, checked


@dataclasses.dataclass(frozen=True)
class Supernode:
    """Features of a graph grouped as one node.

    Attributes:
        name: What the group is, e.g. ``"result mod 10 = 5 @ answer[0]"``.
        label: The shared label, or ``""`` for a group of unlabelled features.
        role: The position role its features sit at (``"final"``), or ``""`` where none applies.
        members: The graph's node indices.
        influence: The members' influence on the answer, summed.
        by_label: How many members carry the label themselves (the rest joined by profile).
        labelled_influence: The influence of those members.
    """

    name: str
    label: str
    role: str
    members: list
    influence: float
    by_label: int
    labelled_influence: float

    def as_dict(self) -> dict[str, Any]:
        """The supernode as plain data (the viewer's and the report's)."""
        return dataclasses.asdict(self)


@checked
def label_graph(graph: AttributionGraph, plots: OperandPlots, prompt: PromptSet, *, threshold: float = 0.6,
                fdr: float = 0.05, kept_only: bool = True) -> dict[tuple[int, int, int], str]:
    """Label a graph's features from their operand plots at their own positions' roles.

    Args:
        graph: The attribution graph of ``prompt`` (optionally followed by answer tokens).
        plots: Operand plots of the graph's transcoders (:func:`~arithinterp.features.operand_plots.operand_plots`).
        prompt: The one prompt the graph is of.
        threshold: The score a label needs.
        fdr: The cell-shuffle test's false-discovery rate.
        kept_only: Label only the features the pruned graph keeps.

    Returns:
        ``{(layer, feature, position): label}`` for the features that get one (the best-scoring).

    Raises:
        ConfigError: A prompt set of more or fewer than one prompt.
    """
    if len(prompt) != 1:
        raise ConfigError(f"label_graph labels the graph of one prompt; got a prompt set of {len(prompt)}")
    role_at = graph_roles(prompt, plots.roles, len(graph.tokens))
    wanted: dict[tuple[int, str], list[int]] = {}
    for node in graph.nodes:
        if node["kind"] == "feature" and (node["kept"] or not kept_only) and node["position"] in role_at:
            wanted.setdefault((node["layer"], role_at[node["position"]]), []).append(node["feature"])
    best: dict[tuple[int, int, str], tuple[float, str]] = {}
    for (layer, role), features in wanted.items():
        table = label_plots(plots, layer, role, sorted(set(features)), threshold=threshold, fdr=fdr).to_frame()
        labelled = table[table["label"]]
        for feature, score, name in zip(labelled["neuron"], labelled["score"], labelled["heuristic"]):
            key = (layer, int(feature), role)
            if key not in best or float(score) > best[key][0]:
                best[key] = (float(score), str(name))
    out = {}
    for node in graph.nodes:
        if node["kind"] == "feature" and node["position"] in role_at:
            key = (node["layer"], node["feature"], role_at[node["position"]])
            if key in best:
                out[(node["layer"], node["feature"], node["position"])] = best[key][1]
    return out


def _profiles(graph: AttributionGraph, members: list[int], kept: torch.Tensor) -> torch.Tensor:
    """Each node's outgoing edges to the kept nodes, unit length ``[len(members), n_kept]``."""
    out = graph.edges[:, members][kept].T.double()
    return out / out.norm(dim=1, keepdim=True).clamp_min(1e-30)


@checked
def supernodes(graph: AttributionGraph, labels: dict, prompt: Optional[PromptSet] = None,
               plots: Optional[OperandPlots] = None, *, min_similarity: PositiveProbability = 0.9,
               kept_only: bool = True) -> list[Supernode]:
    """Group a graph's features into supernodes by label, then by attribution profile.

    Args:
        graph: The attribution graph.
        labels: ``{(layer, feature, position): label}`` (:func:`label_graph`).
        prompt: The graph's prompt, to name each group's role (with ``plots``).
        plots: The operand plots the labels came from (their roles).
        min_similarity: The cosine of outgoing edge profiles at which an unlabelled feature joins a
            group.
        kept_only: Group only the features the pruned graph keeps.

    Returns:
        The supernodes, most influential first.
    """
    role_at = graph_roles(prompt, plots.roles, len(graph.tokens)) if prompt is not None and plots else {}
    kept = torch.tensor([bool(node["kept"]) for node in graph.nodes])
    features = [i for i, node in enumerate(graph.nodes)
                if node["kind"] == "feature" and (node["kept"] or not kept_only)]
    groups: dict[tuple[str, int | str], list[int]] = {}
    unlabelled = []
    for i in features:
        node = graph.nodes[i]
        label = labels.get((node["layer"], node["feature"], node["position"]))
        where = role_at.get(node["position"]) or node["position"]
        if isinstance(label, str) and label:
            groups.setdefault((label, where), []).append(i)
        else:
            unlabelled.append(i)
    direct = {key: list(members) for key, members in groups.items()}
    if unlabelled and groups:  # join the labelled group at the same place that acts most alike
        keys = list(groups)
        centres = torch.stack([_profiles(graph, groups[key], kept).mean(0) for key in keys])
        centres = centres / centres.norm(dim=1, keepdim=True).clamp_min(1e-30)
        similarity = _profiles(graph, unlabelled, kept) @ centres.T  # [unlabelled, group]
        left = []
        for row, i in enumerate(unlabelled):
            where = role_at.get(graph.nodes[i]["position"]) or graph.nodes[i]["position"]
            same_place = torch.tensor([key[1] == where for key in keys])
            score = similarity[row].masked_fill(~same_place, -2.0)
            best = int(score.argmax())
            if float(score[best]) >= min_similarity:
                groups[keys[best]].append(i)
            else:
                left.append(i)
        unlabelled = left
    # the unlabelled features left: grouped greedily among themselves by profile
    rest: list[list[int]] = []
    if unlabelled:
        profiles = _profiles(graph, unlabelled, kept)
        order = sorted(range(len(unlabelled)), key=lambda r: -graph.nodes[unlabelled[r]]["influence"])
        assigned = torch.full((len(unlabelled),), -1)
        for r in order:
            if int(assigned[r]) >= 0:
                continue
            close = ((profiles @ profiles[r]) >= min_similarity) & (assigned < 0)
            assigned[close] = len(rest)
            rest.append([unlabelled[j] for j in close.nonzero().squeeze(1).tolist()])
    out = []
    for (label, where), members in groups.items():
        role = where if isinstance(where, str) else ""
        place = role or f"position {where}"
        out.append(Supernode(name=f"{label} @ {place}", label=label, role=role, members=sorted(members),
                             influence=float(sum(graph.nodes[i]["influence"] for i in members)),
                             by_label=len(direct[(label, where)]),
                             labelled_influence=float(sum(graph.nodes[i]["influence"]
                                                          for i in direct[(label, where)]))))
    for members in rest:
        first = graph.nodes[members[0]]
        where = role_at.get(first["position"], "")
        name = (f"L{first['layer']} feature {first['feature']}" if len(members) == 1  # named by its first
                else f"{len(members)} unlabelled features alike with L{first['layer']} feature {first['feature']}")
        out.append(Supernode(name=f"{name} @ {where or 'position ' + str(first['position'])}", label="", role=where,
                             members=sorted(members), by_label=0, labelled_influence=0.0,
                             influence=float(sum(graph.nodes[i]["influence"] for i in members))))
    return sorted(out, key=lambda s: -s.influence)


@checked
def labelled_share(groups: list[Supernode], *, direct: bool = False) -> float:
    """The share of the grouped features' influence held by labelled supernodes.

    Args:
        groups: The supernodes of one graph.
        direct: Count only members that carry the label themselves (not those joined by profile).

    Returns:
        A share in [0, 1] (0 for a graph without features).
    """
    total = sum(group.influence for group in groups)
    if total <= 0:
        return 0.0
    held = sum(group.labelled_influence if direct else group.influence for group in groups if group.label)
    return held / total


def supernode_frame(groups: list[Supernode]) -> pd.DataFrame:
    """One row per supernode: name, label, role, members, influence, share of the features' influence."""
    total = sum(group.influence for group in groups) or 1.0
    return pd.DataFrame([dict(name=g.name, label=g.label, role=g.role, n_members=len(g.members),
                              by_label=g.by_label, influence=g.influence, share=g.influence / total)
                         for g in groups])
