"""The classification result: which heuristics each neuron implements (:class:`HeuristicTable`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import pandas as pd
import torch

from arithinterp.drawing import draw
from arithinterp.errors import ConfigError, SiteError, accepted
from arithinterp.outputs import writes
from arithinterp.neurons.registry import HeuristicRegistry
from arithinterp.neurons.rules import Grid, Heuristic, apply_op
from arithinterp.results import NON_NEGATIVE, PROBABILITY, Result


@dataclasses.dataclass(frozen=True)
class HeuristicTable(Result):
    """Which heuristics each neuron implements (Nikankin et al. 2025, "Arithmetic Without Algorithms").

    A neuron implements a heuristic when its score reaches ``threshold`` and its q-value is
    ≤ ``fdr`` (``fdr=None``: the threshold alone).

    Attributes:
        layer (Int[Tensor, "neuron"]): Each row's layer.
        neuron (Int[Tensor, "neuron"]): Each row's neuron index in its layer.
        names: The heuristics' names.
        families: Each heuristic's family.
        map_kinds: The map each is scored on (``"K"`` operand heuristics, ``"KV"`` result heuristics).
        scores (Float[Tensor, "neuron heuristic"]): Each neuron's top-k score for each heuristic.
        bottom_scores (Float[Tensor, "neuron heuristic"]): The bottom-k scores (gated MLPs; empty
            otherwise); the better side counts.
        importance (Float[Tensor, "neuron"]): The attribution scores (NaN if not computed).
        threshold: The score a label needs.
        op: The operator of the prompts.
        modulus: Their modulus, or ``None``.
        a_values: The first operand's grid values.
        b_values: The second operand's grid values.
        legal (Bool[Tensor, "a b"]): The grid cells used.
        meta: Provenance; ``meta["control"]`` states the rule and what it labels on cell-shuffled maps.
        p_values (Float[Tensor, "neuron heuristic"]): The exact cell-shuffle p-values of the deciding scores.
        q_values (Float[Tensor, "neuron heuristic"]): Their Benjamini–Hochberg adjustment over the table.
        fdr: The false-discovery rate, or ``None``.
        registry: The :class:`HeuristicRegistry` the table was scored with (not saved).
    """

    layer: torch.Tensor
    neuron: torch.Tensor
    names: list
    families: list
    map_kinds: list
    scores: torch.Tensor
    bottom_scores: torch.Tensor
    importance: torch.Tensor
    threshold: float
    op: str
    modulus: Optional[int]
    a_values: list
    b_values: list
    legal: torch.Tensor
    meta: dict = dataclasses.field(default_factory=dict)
    p_values: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))
    q_values: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))
    fdr: Optional[float] = None
    registry: Optional[HeuristicRegistry] = dataclasses.field(default=None, compare=False, repr=False)

    # what load checks: the axes fields share and the values they may take
    _shapes = {"layer": "neuron", "neuron": "neuron", "names": "heuristic", "families": "heuristic",
               "map_kinds": "heuristic", "scores": "neuron heuristic", "importance": "neuron", "a_values": "a",
               "b_values": "b", "legal": "a b", "p_values": "neuron heuristic", "q_values": "neuron heuristic"}
    _legal = {"layer": NON_NEGATIVE, "neuron": NON_NEGATIVE, "threshold": PROBABILITY, "p_values": PROBABILITY,
              "q_values": PROBABILITY, "fdr": PROBABILITY}

    @writes
    def save(self, path, *, overwrite: bool = False, extra_files=None):
        """Write the table to a directory (the registry's predicates are code and are not saved: pass
        the registry again to :meth:`heuristic` after :meth:`load` for custom ones).

        Args:
            path: The directory.
            overwrite: Replace a different saved result there.

        Returns:
            The directory.
        """
        return Result.save(dataclasses.replace(self, registry=None), path, overwrite=overwrite,
                           extra_files=extra_files)

    @property
    def best_scores(self) -> torch.Tensor:
        """``[N, H]``: the score that decides the label (top-k, or the better of top/bottom)."""
        if self.bottom_scores.numel():
            return torch.maximum(self.scores, self.bottom_scores)
        return self.scores

    @property
    def significant(self) -> torch.Tensor:
        """``[N, H]`` bool: the score beats the cell-shuffle null at the table's ``fdr`` (all
        True when ``fdr`` is None)."""
        if self.fdr is None or not self.q_values.numel():
            return torch.ones_like(self.scores, dtype=torch.bool)
        return self.q_values <= self.fdr

    @property
    def labels(self) -> torch.Tensor:
        """``[N, H]`` bool: neuron implements heuristic (score ≥ threshold and significant)."""
        return (self.best_scores >= self.threshold) & self.significant

    @property
    def classified(self) -> torch.Tensor:
        """``[N]`` bool: neuron implements at least one heuristic."""
        return self.labels.any(1)

    def neuron_labels(self, index: int) -> list[str]:
        """The heuristics one neuron implements.

        Args:
            index: A row of the table.

        Returns:
            Their names, best score first.

        Raises:
            SiteError: ``index`` is out of range.
        """
        if not 0 <= index < len(self.layer):
            raise SiteError(
                f"row {index} is out of range; the table has {len(self.layer)} neurons (0..{len(self.layer) - 1})"
            )
        row = self.best_scores[index]
        hits = torch.nonzero(self.labels[index]).flatten()
        return [self.names[i] for i in hits[torch.argsort(row[hits], descending=True)].tolist()]

    def neurons_of(self, heuristic: str) -> torch.Tensor:
        """The neurons labelled with a heuristic.

        Args:
            heuristic: A heuristic name.

        Returns:
            Int[Tensor, "k"]: Their rows.

        Raises:
            ConfigError: An unknown heuristic.
        """
        return torch.nonzero(self.labels[:, self.index(heuristic)]).flatten()

    def index(self, heuristic: str) -> int:
        """The column of a heuristic.

        Args:
            heuristic: A heuristic name.

        Returns:
            Its index into :attr:`names`.

        Raises:
            ConfigError: An unknown heuristic; the message suggests close names.
        """
        if heuristic not in self.names:
            close = [n for n in self.names if heuristic.split(" ")[0] in n][:8]
            raise ConfigError(
                f"unknown heuristic {heuristic!r}; this table scores {len(self.names)} heuristics"
                + (f", e.g. {accepted(close)}" if close else f", e.g. {accepted(self.names[:8])}")
            )
        return self.names.index(heuristic)

    def coverage(self) -> dict[int, float]:
        """Fraction of the table's (important) neurons with at least one label, per layer."""
        return {
            int(layer): float(self.classified[self.layer == layer].float().mean())
            for layer in torch.unique(self.layer).tolist()
        }

    def histogram(self) -> pd.DataFrame:
        """Heuristic types per layer: neurons with at least one label of each family.

        Columns ``layer, family, neurons, labels`` (a neuron with several labels of one family
        counts once in ``neurons``, once per label in ``labels``).
        """
        labels = self.labels
        families = sorted(set(self.families), key=self.families.index)
        rows = []
        for layer in torch.unique(self.layer).tolist():
            in_layer = labels[self.layer == layer]
            for family in families:
                cols = [i for i, f in enumerate(self.families) if f == family]
                sub = in_layer[:, cols]
                rows.append(dict(layer=int(layer), family=family, neurons=int(sub.any(1).sum()), labels=int(sub.sum())))
        return pd.DataFrame(rows, columns=["layer", "family", "neurons", "labels"])

    def heuristic(self, name: str, registry: Optional[HeuristicRegistry] = None) -> Heuristic:
        """The :class:`Heuristic` object behind a column.

        Args:
            name: A heuristic name.
            registry: The registry to rebuild it from (default: the one the table was scored with,
                or the built-in families for a loaded table).

        Returns:
            The heuristic, over the table's grid.

        Raises:
            ConfigError: An unknown name, a registry of another type, or one without the heuristic.
        """
        index = self.index(name)
        registry = registry if registry is not None else (self.registry or HeuristicRegistry())
        if not isinstance(registry, HeuristicRegistry):
            raise ConfigError(f"registry must be a HeuristicRegistry, got {type(registry).__name__}")
        legal = self.legal.bool()
        A, B = torch.meshgrid(torch.tensor(self.a_values), torch.tensor(self.b_values), indexing="ij")
        result, _ = apply_op(A, B, self.op, self.modulus)
        grid = Grid(
            A[legal], B[legal], result[legal], tuple(self.a_values), tuple(self.b_values), self.op, self.modulus
        )
        found = registry.find(name, self.families[index], grid)
        if found is None:
            raise ConfigError(
                f"heuristic {name!r} (family {self.families[index]!r}) is not in the registry given; pass "
                "registry= the HeuristicRegistry the table was classified with"
            )
        return found

    def to_frame(self, labelled_only: bool = False) -> pd.DataFrame:
        """One row per (neuron, heuristic): layer, neuron, heuristic, family, map_kind, score,
        top_score, p_value / q_value (the cell-shuffle test, NaN for tables without it), label.

        Args:
            labelled_only: Keep the rows whose label is True.

        Returns:
            The table as a DataFrame.
        """
        best = self.best_scores
        N, H = best.shape
        missing = torch.full((N * H,), float("nan"))
        p = self.p_values.flatten() if self.p_values.numel() else missing
        q = self.q_values.flatten() if self.q_values.numel() else missing
        frame = pd.DataFrame(
            dict(
                layer=self.layer.repeat_interleave(H).numpy(),
                neuron=self.neuron.repeat_interleave(H).numpy(),
                heuristic=np.tile(np.array(self.names, dtype=object), N),
                family=np.tile(np.array(self.families, dtype=object), N),
                map_kind=np.tile(np.array(self.map_kinds, dtype=object), N),
                score=best.flatten().numpy(),
                top_score=self.scores.flatten().numpy(),
                p_value=p.numpy(),
                q_value=q.numpy(),
                label=self.labels.flatten().numpy(),
                importance=self.importance.repeat_interleave(H).numpy(),
            )
        )
        return frame.loc[frame["label"]].reset_index(drop=True) if labelled_only else frame

    def plot(self, kind: str = "counts", **kwargs):
        """Draw the table.

        Args:
            kind: ``"counts"`` (heuristic types per layer), ``"coverage"`` or ``"scores"`` (heatmap).
            **kwargs: Options of :func:`arithinterp.viz.neurons.plot_heuristic_table`.

        Returns:
            The plotly figure.
        """
        return draw(self, kind=kind, **kwargs)
