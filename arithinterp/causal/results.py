"""The result types of causal-variable analyses (``to_frame`` / ``plot`` / ``save`` / ``load``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch

from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError
from arithinterp.results import DISTINCT, MEASURED_PROBABILITY, NON_NEGATIVE, POSITIVE, PROBABILITY, SITE, Result


@dataclass(frozen=True)
class DASResult(Result):
    """One fit at one site, layer and position.

    Attributes:
        variable: The interchanged variable.
        site: The site (``"attn_z[3]"`` for a head).
        layer: The block.
        position: The position, or positions joined by ``+``.
        method: ``"das"`` or ``"boundless"``.
        k: Dimensions interchanged (the learned boundary for Boundless DAS).
        iia: The fitted method's held-out interchange intervention accuracy.
        train_iia: Its accuracy on the training pairs.
        chance: The dataset's chance IIA.
        scores: ``scores[name]``: ``iia`` (held-out), its 95% Wilson interval ``low`` / ``high``, the
            mean ``logit_diff`` (and ``logit_diff_sem``), ``n`` pairs and ``k`` dimensions, for the
            fitted method, ``"none"`` (no intervention) and each baseline.
        basis (Float[Tensor, "d k"]): The learned subspace (``[position, d, k]``, one per position,
            with ``per_position``).
        history: The training loss per step.
        meta: Provenance and the fit's settings.
    """

    variable: str
    site: str
    layer: int
    position: str
    method: str
    k: int
    iia: float
    train_iia: float
    chance: float
    scores: dict
    basis: torch.Tensor
    history: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    # what load checks: the axes fields share and the values they may take
    _shapes = {"basis": "d k", "k": "k"}
    _legal = {"layer": NON_NEGATIVE, "k": POSITIVE, "iia": MEASURED_PROBABILITY, "train_iia": MEASURED_PROBABILITY,
              "chance": MEASURED_PROBABILITY, "site": SITE}

    def to_frame(self) -> pd.DataFrame:
        rows = [dict(variable=self.variable, site=self.site, layer=self.layer, position=self.position,
                     intervention=name, k=s["k"], iia=s["iia"], iia_low=s["low"], iia_high=s["high"],
                     logit_diff=s["logit_diff"], logit_diff_sem=s["logit_diff_sem"], n_pairs=s["n"],
                     chance=self.chance)
                for name, s in self.scores.items()]
        return pd.DataFrame(rows)

    def plot(self, **kwargs):
        return draw(self, **kwargs)


@dataclass(frozen=True)
class DASLayersResult(Result):
    """DAS at every layer × position (:func:`~arithinterp.causal.das_layers`).

    Attributes:
        variable: The interchanged variable.
        site: The site.
        layers: The layers.
        positions: The positions.
        k: Dimensions interchanged.
        iia (Float[Tensor, "layer position"]): Held-out IIA (NaN where no held-out pair is reachable).
        low (Float[Tensor, "layer position"]): Its 95% Wilson interval's low end.
        high (Float[Tensor, "layer position"]): Its high end.
        random_iia (Float[Tensor, "layer position"]): A random rotation's held-out IIA.
        logit_diff (Float[Tensor, "layer position"]): The mean logit difference.
        chance: The dataset's chance IIA.
        tokens: Each position's label with its token (``"final: ="``).
        meta: Provenance, the fits' settings and ``n_test_per_cell``.
    """

    variable: str
    site: str
    layers: list
    positions: list
    k: int
    iia: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    random_iia: torch.Tensor
    logit_diff: torch.Tensor
    chance: float
    tokens: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    # what load checks: the axes fields share and the values they may take
    _shapes = {"iia": "layer position", "low": "layer position", "high": "layer position",
               "random_iia": "layer position", "logit_diff": "layer position", "layers": "layer",
               "positions": "position", "tokens": "position"}
    _legal = {"layers": [NON_NEGATIVE, DISTINCT], "positions": DISTINCT, "k": POSITIVE, "iia": PROBABILITY,
              "low": PROBABILITY, "high": PROBABILITY, "random_iia": PROBABILITY, "chance": PROBABILITY}

    def headline(self) -> dict:
        """The best cell's IIA (:meth:`best`) and chance.

        Returns:
            ``best_layer``, ``best_position``, ``best_iia`` and ``chance`` (``{}`` when no cell has a score).
        """
        if not bool(torch.isfinite(self.iia).any()):
            return {}
        layer, position, iia = self.best()
        return dict(best_layer=layer, best_position=position, best_iia=iia, chance=self.chance)

    def best(self) -> tuple[int, str, float]:
        """The best cell (cells without a score, NaN, are passed over).

        Returns:
            ``(layer, position, iia)``.

        Raises:
            AnalysisError: No cell has a score: there is no best one.
        """
        if not bool(torch.isfinite(self.iia).any()):
            raise AnalysisError(f"no cell of these fits has a score (all {self.iia.numel()} are NaN: no held-out pair "
                                "reachable from any of its positions), so none is best")
        flat = int(torch.argmax(torch.nan_to_num(self.iia, nan=-1.0)))
        i, j = divmod(flat, self.iia.shape[1])
        return int(self.layers[i]), str(self.positions[j]), float(self.iia[i, j])

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for i, layer in enumerate(self.layers):
            for j, position in enumerate(self.positions):
                rows.append(dict(variable=self.variable, site=self.site, layer=int(layer), position=str(position),
                                 k=self.k, iia=float(self.iia[i, j]), iia_low=float(self.low[i, j]),
                                 iia_high=float(self.high[i, j]), random_iia=float(self.random_iia[i, j]),
                                 logit_diff=float(self.logit_diff[i, j]), chance=self.chance))
        return pd.DataFrame(rows)

    def plot(self, **kwargs):
        return draw(self, **kwargs)


@dataclass(frozen=True)
class ReadableUsedResult(Result):
    """Per variable and layer: probe accuracy (grouped folds, with its interval and shuffled-label
    control), DAS IIA and random-rotation IIA (held-out, with intervals): "readable" against "used".

    Attributes:
        site: The site.
        position: The position.
        k: Dimensions interchanged.
        rows: One dict per variable and layer: the probe's accuracy, interval and control, and the
            DAS and random-rotation IIA with intervals.
        meta: Provenance and the settings.
    """

    site: str
    position: str
    k: int
    rows: list
    meta: dict = field(default_factory=dict)

    # what load checks: the axes fields share and the values they may take
    _legal = {"k": POSITIVE}

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)

    def plot(self, **kwargs):
        return draw(self, **kwargs)
