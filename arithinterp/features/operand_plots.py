"""Operand plots: every transcoder feature's activity over a grid of ``a + b`` problems, and the labels
they give (Lindsey et al. 2025, "On the Biology of a Large Language Model", addition).

A feature's *operand plot* is its activation over the ``a × b`` grid at one position of the prompt
(its *role*: the operands' tokens, the final ``=``, the first answer token fed after it). Shapes
seen for addition: lookup-table features (one pair of operand units digits: a periodic grid of
dots), add-function features (one operand's units digit: stripes), sum features (the sum's units
digit: diagonal stripes; its range: a diagonal band) and operand-magnitude features.

:func:`operand_plots` reads the grid once for every layer and role and keeps each cell's active
features (TopK keeps ``k`` a row, so the plots are stored sparse: :class:`OperandPlots`);
:meth:`OperandPlots.grid` rebuilds one feature's plot. :func:`label_plots` labels features from
their plots with the neurons' calibrated classifier (the score threshold and a cell-shuffle test
at a false discovery rate, Nikankin et al. 2025): the operand families (range, residue, identical
operands), the lookup table, and the sum's families (range, residue, value, digit pattern) scored
on the activity itself, as an operand plot shows it, rather than on activation × logit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import pandas as pd
import torch
from arithinterp.progress import progress_bar

from arithinterp.checks import check_belongs
from arithinterp.engine import Read, run
from arithinterp.engine.steppers import read_last
from arithinterp import sites as site_lib
from arithinterp.errors import AnalysisError, ArithInterpError, ConfigError
from arithinterp.features.labels import LOOKUP_FAMILY, FeatureGridsResult, lookup_registry
from arithinterp.features.transcoder import Transcoders, transcoders_digest
from arithinterp.neurons import HeuristicTable, classify_maps
from arithinterp.results import Result, build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import HookedModel, IndexList, checked

#: The positions read by default: each operand's first and last token, the final token, and the
#: first answer token fed after the prompt (where a two-token answer's second token is predicted).
ROLES = ("a[0]", "a", "b[0]", "b", "final", "answer[0]")


@dataclasses.dataclass(frozen=True)
class OperandPlots(Result):
    """Transcoder features' activations over an operand grid, per layer and position role, sparse.

    Attributes:
        values (Float[Tensor, "cell role layer k"]): The ``k`` largest activations of each cell,
            role and layer (zeros where fewer fire); NaN where a cell has no such role (a fed answer
            token that predicts nothing: a one-token answer).
        features (Int[Tensor, "cell role layer k"]): Which feature each value is.
        a (Int[Tensor, "cell"]): The first operand of each cell.
        b (Int[Tensor, "cell"]): The second operand of each cell.
        answer (Int[Tensor, "cell"]): Each cell's answer.
        next_tokens (Int[Tensor, "cell role"]): The token each role's position predicts (the next
            one: an answer token after the final position), -1 where there is none.
        roles: The position specs read (:data:`ROLES`).
        layers: The transcoders' layers.
        n_features: Features per transcoder.
        op: The task's operator.
        meta: Provenance (the model's fingerprint, the prompts' prefix).
    """

    values: torch.Tensor
    features: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    answer: torch.Tensor
    next_tokens: torch.Tensor
    roles: list
    layers: list
    n_features: int
    op: str
    meta: dict

    _shapes = {"values": "cell role layer k", "features": "cell role layer k", "a": "cell", "b": "cell",
               "answer": "cell", "next_tokens": "cell role", "roles": "role", "layers": "layer"}

    def grid(self, layer: int, feature: int, role: str) -> tuple[torch.Tensor, list[int], list[int]]:
        """One feature's operand plot.

        Args:
            layer: The model layer.
            feature: The feature.
            role: One of :attr:`roles`.

        Returns:
            ``(plot, a_values, b_values)``: the activation Float[Tensor, "a b"] (NaN at cells not in
            the grid or without the role), and the operand values along each axis.

        Raises:
            ConfigError: A layer, feature or role these plots do not have.
        """
        maps, a_values, b_values = self.maps(layer, [feature], role)
        return maps[0], a_values, b_values

    def maps(self, layer: int, features: Sequence[int], role: str) -> tuple[torch.Tensor, list[int], list[int]]:
        """The operand plots of several features of one layer and role: ``[feature, a, b]``, as :meth:`grid`."""
        if layer not in self.layers:
            raise ConfigError(f"no plots of layer {layer}; these plots cover layers {self.layers}")
        if role not in self.roles:
            raise ConfigError(f"no plots at {role!r}; these plots cover {self.roles}")
        outside = [f for f in features if not 0 <= int(f) < self.n_features]
        if outside:
            raise ConfigError(f"features {outside[:5]} are outside 0..{self.n_features - 1}")
        li, ri = self.layers.index(layer), self.roles.index(role)
        values, index = self.values[:, ri, li], self.features[:, ri, li]  # [cell, k]
        chosen = torch.as_tensor(list(features), dtype=index.dtype)
        dense = ((index[:, :, None] == chosen[None, None, :]) * values[:, :, None].nan_to_num(0.0)).sum(1)  # [cell, n]
        dense[values[:, 0].isnan()] = float("nan")
        a_values, b_values = sorted(set(self.a.tolist())), sorted(set(self.b.tolist()))
        ia = torch.searchsorted(torch.tensor(a_values), self.a)
        ib = torch.searchsorted(torch.tensor(b_values), self.b)
        out = torch.full((len(chosen), len(a_values), len(b_values)), float("nan"))
        out[:, ia, ib] = dense.T.float()
        return out, a_values, b_values

    def active(self, layer: int, role: str, min_cells: int = 3) -> list[int]:
        """The features of ``layer`` that fire on at least ``min_cells`` cells at ``role``."""
        li, ri = self.layers.index(layer), self.roles.index(role)
        fired = self.features[:, ri, li][self.values[:, ri, li].nan_to_num(0.0) > 0]
        counts = torch.bincount(fired.long().reshape(-1), minlength=self.n_features)
        return (counts >= min_cells).nonzero().squeeze(1).tolist()

    def to_frame(self) -> pd.DataFrame:
        """One row per layer and role: how many features fire there on at least three cells."""
        return pd.DataFrame([dict(layer=layer, role=role, active_features=len(self.active(layer, role)))
                             for layer in self.layers for role in self.roles])

    def grids(self, layer: int, features: Sequence[int], role: str) -> FeatureGridsResult:
        """Some features' operand plots of one layer and role as a
        :class:`~arithinterp.features.FeatureGridsResult` (its ``plot()`` draws them)."""
        maps, a_values, b_values = self.maps(layer, features, role)
        return FeatureGridsResult(layer=int(layer), features=[int(f) for f in features], labels=[""] * len(features),
                                  a_values=a_values, b_values=b_values, maps=maps, meta=dict(self.meta, role=role))

    def plot(self, layer: Optional[int] = None, features: Optional[Sequence[int]] = None, role: str = "final",
             **kwargs: Any):
        """Operand plots of some features (default: the four firing on most cells at ``role`` of the
        last layer), one heatmap each (rows a, columns b)."""
        layer = self.layers[-1] if layer is None else layer
        if features is None:
            self.maps(layer, [], role)  # an unknown layer or role is refused before it is looked up
            li, ri = self.layers.index(layer), self.roles.index(role)
            fired = self.features[:, ri, li][self.values[:, ri, li].nan_to_num(0.0) > 0].long()
            features = torch.bincount(fired.reshape(-1), minlength=self.n_features).topk(4).indices.tolist()
        return self.grids(layer, features, role).plot(**kwargs)


def _role_index(prompts: PromptSet, roles: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's position of each role in the frame of its tokens followed by its first answer
    token ``[N, role]``, and whether the role predicts something (``[N, role]``: a fed answer token
    ``answer[j]`` predicts answer token ``j + 1`` only where the answer has more tokens)."""
    _, index = prompts.locate(list(roles), answers=1)
    valid = torch.ones_like(index, dtype=torch.bool)
    for r, role in enumerate(roles):
        if role.startswith("answer["):
            j = int(role[len("answer["):].split("]")[0])
            valid[:, r] = prompts.n_answer_tokens > j + 1
    return index, valid


@checked
def operand_plots(model: HookedModel, prompts: PromptSet, transcoders: Transcoders, *,
                  roles: Sequence[str] = ROLES, batch_size: Optional[int] = None,
                  progress: bool = True) -> OperandPlots:
    """Read every feature's activity over an operand grid, at every layer and role.

    Args:
        model: The hooked model.
        prompts: The grid: any set of ``(a, b)`` problems (a full grid, or a sample of one); its
            first answer token is fed after each prompt, so roles may name ``answer[0]``.
        transcoders: Transcoders reading ``mlp_in``.
        roles: Position specs (:meth:`PromptSet.locate`) to read.
        batch_size: Prompts per forward (default: a length group at once).
        progress: Show a progress bar.

    Returns:
        The plots, sparse (:class:`OperandPlots`).

    Raises:
        ConfigError: No roles, or a role named twice.
        SiteError: A role some prompt does not have.
        ModelMismatchError: Prompts or transcoders made for another model.
    """
    check_belongs(model, "operand_plots", prompts=prompts)
    transcoders.check_model(model)
    if transcoders.input_site != "mlp_in":
        raise AnalysisError(f"operand plots read transcoders from mlp_in; these read {transcoders.input_site}")
    roles = list(roles)
    if not roles or len(set(roles)) != len(roles):
        raise ConfigError(f"roles must name at least one position, each once; got {roles}")
    index, valid = _role_index(prompts, roles)
    answer0 = prompts.answer_tokens[:, :1].clamp_min(0)
    frame = torch.cat([prompts.tokens, answer0], 1)  # the left-padded prompts with the first answer token fed
    k, L = transcoders.k, len(transcoders.layers)
    values = torch.zeros(len(prompts), len(roles), L, k)
    features = torch.zeros(len(prompts), len(roles), L, k, dtype=torch.int16 if transcoders.n_features < 2**15
                           else torch.int32)
    names = [site_lib.hook_name("mlp_in", layer) for layer in transcoders.layers]
    groups = prompts.length_groups()
    for group in progress_bar(groups, desc="operand plots", disable=not progress):
        offset = prompts.offset(group)
        tokens = frame[group, offset:]
        first = int(index[group].min()) - offset  # the earliest role read
        n_last = tokens.shape[1] - first
        for start in range(0, len(group), batch_size or len(group)):
            rows = group[start : start + (batch_size or len(group))]
            part = tokens[start : start + len(rows)]
            read = read_last(model, part, names, n_last)
            if read is None:  # blocks that cannot be stepped: whole forwards
                got = run(model, part, reads=[Read("mlp_in", layer) for layer in transcoders.layers],
                          logits="none").reads
                read = {name: x[:, first:] for name, x in zip(names, got)}
            where = index[rows] - offset - first  # [n, role] into the read positions
            for li, (layer, name) in enumerate(zip(transcoders.layers, names)):
                x = read[name].gather(1, where[..., None].expand(-1, -1, read[name].shape[-1]))  # [n, role, d]
                acts = transcoders.encode(layer, x.float())
                top = acts.topk(k, dim=-1)
                values[rows, :, li] = top.values
                features[rows, :, li] = top.indices.to(features.dtype)
    values[~valid] = float("nan")
    # what each role's position predicts: the next token of the prompt followed by its answer
    fed = torch.cat([prompts.tokens, prompts.answer_tokens[:, :2]], 1)
    if fed.shape[1] < index.max() + 2:
        fed = torch.cat([fed, torch.full((len(fed), 1), -1, dtype=fed.dtype)], 1)
    next_tokens = fed.gather(1, index + 1).masked_fill(~valid, -1)
    return OperandPlots(values=values.half(), features=features, a=prompts.a.clone(), b=prompts.b.clone(),
                        answer=prompts.answer.clone(), next_tokens=next_tokens, roles=roles,
                        layers=list(transcoders.layers),
                        n_features=transcoders.n_features, op=prompts.op,
                        meta=build_meta(model, n_prompts=len(prompts), prefix=prompts.prefix,
                                        transcoders=transcoders_digest(transcoders)))


@checked
def activity_registry() -> Any:
    """The families an operand plot is labelled with: the operand families and the lookup table
    (as :func:`~arithinterp.features.labels.lookup_registry`), and the result families scored on
    the activity itself (an operand plot's sum features: diagonal stripes and bands).

    Returns:
        A new :class:`~arithinterp.neurons.HeuristicRegistry`.
    """
    from arithinterp.neurons import HeuristicRegistry
    from arithinterp.neurons import BUILTIN_FAMILIES

    def on_activity(generate: Any) -> Any:
        return lambda grid: [dataclasses.replace(h, map_kind="K") for h in generate(grid)]

    registry = HeuristicRegistry([dataclasses.replace(family, map_kind="K", generate=on_activity(family.generate))
                                  for family in BUILTIN_FAMILIES])
    registry.add_family(LOOKUP_FAMILY, "K", lookup_registry().families[LOOKUP_FAMILY].generate)
    return registry


@checked
def label_plots(plots: OperandPlots, layer: int, role: str, features: Optional[IndexList] = None, *,
                threshold: float = 0.6, fdr: float = 0.05, seed: int = 0) -> HeuristicTable:
    """Label features of one layer and role from their operand plots.

    Args:
        plots: The operand plots.
        layer: The model layer.
        role: One of the plots' roles.
        features: The features (default: every feature firing on at least three cells there).
        threshold: The score a label needs (Nikankin et al.'s 0.6).
        fdr: The false-discovery rate of the cell-shuffle test.
        seed: Seeds the shuffles.

    Returns:
        The labels as a :class:`~arithinterp.neurons.HeuristicTable` whose ``neuron`` column holds feature indices.

    Raises:
        AnalysisError: No feature fires on three cells there.
    """
    chosen = plots.active(layer, role) if features is None else [int(f) for f in features]
    if not chosen:
        raise AnalysisError(f"no feature of layer {layer} fires on three cells at {role!r}; nothing to label")
    maps, a_values, b_values = plots.maps(layer, chosen, role)
    return classify_maps(maps, None, a_values, b_values, plots.op, threshold=threshold, fdr=fdr,
                         registry=activity_registry(), progress=False,
                         layers=torch.full((len(chosen),), layer), neurons=torch.tensor(chosen), seed=seed,
                         meta=dict(role=role))


def graph_roles(prompt: PromptSet, roles: Sequence[str], n_tokens: int) -> dict[int, str]:
    """Which role each position of a graph over one prompt is (the prompt followed by as many of its
    answer tokens as the graph's ``n_tokens`` hold): ``{position: role}`` for the roles it has.

    Args:
        prompt: The one prompt.
        roles: Position specs (an :class:`OperandPlots`' roles).
        n_tokens: The graph's tokens.

    Returns:
        The roles by position (the first role named wins where two fall on one token).
    """
    fed = max(n_tokens - int(prompt.lengths[0]), 0)
    offset = prompt.tokens.shape[1] - int(prompt.lengths[0])
    found: dict[int, str] = {}
    for role in roles:
        try:
            _, index = prompt.locate([role], answers=fed)
        except ArithInterpError:  # a role this prompt does not have (an answer token not fed)
            continue
        found.setdefault(int(index[0, 0]) - offset, role)
    return found


@checked
def graph_feature_grids(graph: Any, plots: OperandPlots, prompt: PromptSet) -> list[FeatureGridsResult]:
    """Operand plots of the features an attribution graph keeps, each read at its own position's role,
    for the graph's viewer (``graph.show(grids=...)``): one :class:`~arithinterp.features.FeatureGridsResult`
    per layer and position, labelled with the graph's labels.

    Args:
        graph: An :class:`~arithinterp.features.AttributionGraph` of ``prompt``.
        plots: Operand plots of the graph's transcoders (:func:`operand_plots`).
        prompt: The one prompt the graph is of.

    Returns:
        The results, by layer and position (empty when no kept feature sits at a role's position).

    Raises:
        ConfigError: ``graph`` is not an attribution graph, or ``prompt`` is not one prompt.
    """
    if not all(hasattr(graph, name) for name in ("nodes", "tokens")):
        raise ConfigError(f"graph must be a features.AttributionGraph, got {type(graph).__name__}")
    if len(prompt) != 1:
        raise ConfigError(f"prompt must be the graph's one prompt; got a prompt set of {len(prompt)}")
    role_at = graph_roles(prompt, plots.roles, len(graph.tokens))
    chosen: dict[tuple[int, int], dict[int, str]] = {}
    for node in graph.nodes:
        if node["kind"] == "feature" and node.get("kept") and node["position"] in role_at:
            chosen.setdefault((int(node["layer"]), int(node["position"])), {})[int(node["feature"])] = str(
                node.get("label", "") or "")
    out = []
    for (layer, position), labels in sorted(chosen.items()):
        maps, a_values, b_values = plots.maps(layer, list(labels), role_at[position])
        out.append(FeatureGridsResult(layer=layer, features=list(labels), labels=list(labels.values()),
                                      a_values=a_values, b_values=b_values, maps=maps,
                                      meta=dict(plots.meta, position=position, role=role_at[position])))
    return out
