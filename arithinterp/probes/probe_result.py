"""What a probe sweep finds: :class:`ProbeResult`, held-out scores over layers x positions with controls."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, accepted
from arithinterp.intervals import clip_interval
from arithinterp.probes.cross_validation import confidence_interval
from arithinterp.probes.estimators import PROBE_KINDS
from arithinterp.results import NON_NEGATIVE, PROBABILITY, Result

CONTROLS = ("shuffled", "random-init")


def _key(control: str) -> str:
    """A control's name in a column or key (``"random-init"`` → ``random_init_score``)."""
    return control.replace("-", "_")


@dataclass(frozen=True)
class ProbeResult(Result):
    """Held-out probe scores over layers × positions, with controls and fitted directions.

    ``fold_scores`` [L, P, folds] (accuracy, or R² for ridge), ``control_scores``
    [C, L, P, folds] for each name in ``controls`` (same folds), ``directions`` [L, P, k, d] of
    probes fitted on all prompts (``None`` for MLP probes), ``classes`` the label of each
    direction row. ``chance`` is the majority-class accuracy (0 for R²). ``fold_scheme`` says
    how the folds were made (``meta["folds"]`` has the numbers): grouped by operand pair when a
    pair repeats, so a probe cannot score by recognising a pair it was trained on.
    """

    fold_scores: torch.Tensor
    control_scores: torch.Tensor
    directions: Optional[torch.Tensor]
    layers: list
    positions: list
    controls: list
    classes: list
    site: str
    target: str
    kind: str
    metric: str
    chance: float
    meta: dict
    fold_scheme: str = ""

    # what load checks: the axes fields share and the values they may take
    _shapes = {"fold_scores": "layer position fold", "control_scores": "control layer position fold",
               "directions": "layer position ...", "layers": "layer", "positions": "position", "controls": "control"}
    _legal = {"kind": PROBE_KINDS, "controls": CONTROLS, "layers": NON_NEGATIVE, "chance": PROBABILITY}

    @property
    def mean(self) -> torch.Tensor:
        """Mean held-out score [L, P]."""
        return self.fold_scores.mean(-1)

    @property
    def ci(self) -> tuple[torch.Tensor, torch.Tensor]:
        """95% CI of the mean score across folds, ``(low, high)`` each [L, P], kept inside the
        metric's range (an accuracy interval never leaves [0, 1], an R² one never passes 1)."""
        return clip_interval(*confidence_interval(self.fold_scores), self.metric)

    @property
    def control_mean(self) -> torch.Tensor:
        """[C, L, P]."""
        return self.control_scores.mean(-1)

    @property
    def control_ci(self) -> tuple[torch.Tensor, torch.Tensor]:
        """95% CI of each control's mean score, ``(low, high)`` each [C, L, P], clipped like :attr:`ci`."""
        return clip_interval(*confidence_interval(self.control_scores), self.metric)

    def beats_controls(self) -> torch.Tensor:
        """Where the probe's CI lies above chance and above every control's CI (a finding; with
        the ``"random-init"`` control, one the training put there).

        Returns:
            BoolTensor [L, P].
        """
        low, _ = self.ci
        beats = low > self.chance
        if self.controls:
            beats &= (low[None] > self.control_ci[1]).all(0)
        return beats

    def finding(self) -> dict:
        """The probe's finding in words and numbers, with its controls.

        The cell reported is the one with the largest margin of the probe's lower CI bound over
        chance and every control's upper bound (the best-scoring cell when none beats them).
        ``verdict`` is ``"finding"`` (above chance, the shuffled labels and a random-init model
        of the same architecture on the same prompts: readable *because of training*),
        ``"no random-init control"`` (above chance and the controls that were run, but a
        random-init model may read it too: the input may already show it) or ``"no signal"``.
        ``text`` quotes the score, its interval, chance and each control's score and interval.

        Returns:
            ``layer``, ``position``, ``score``, ``ci_low``, ``ci_high``, ``chance``, ``metric``, each
            control's score and upper bound, ``verdict`` and ``text``.
        """
        low, high = self.ci
        c_low, c_high = self.control_ci
        floor = torch.full_like(low, self.chance)
        if self.controls:
            floor = torch.maximum(floor, c_high.max(0).values)
        beats = self.beats_controls()
        margin = torch.where(beats, low - floor, torch.full_like(low, -math.inf))
        flat = int(margin.flatten().argmax()) if bool(beats.any()) else int(self.mean.flatten().argmax())
        li, pi = divmod(flat, self.mean.shape[1])
        name = "held-out accuracy" if self.metric == "accuracy" else "held-out R²"
        quoted = (f"{name} {float(self.mean[li, pi]):.2f} (95% CI {float(low[li, pi]):.2f} to "
                  f"{float(high[li, pi]):.2f}) at layer {self.layers[li]}, position '{self.positions[pi]}'")
        context = [f"chance {self.chance:.2f}" if self.metric == "accuracy" else "chance 0"]
        labels = {"shuffled": "shuffled labels", "random-init": "a random-init model of the same architecture"}
        out: dict[str, Any] = dict(layer=self.layers[li], position=self.positions[pi], score=float(self.mean[li, pi]),
                                   ci_low=float(low[li, pi]), ci_high=float(high[li, pi]), chance=self.chance,
                                   metric=self.metric)
        for c, control in enumerate(self.controls):
            score = float(self.control_mean[c, li, pi])
            context.append(f"{labels.get(control, control)} {score:.2f} (95% CI {float(c_low[c, li, pi]):.2f} to "
                           f"{float(c_high[c, li, pi]):.2f})")
            out[f"{_key(control)}_score"] = score
            out[f"{_key(control)}_ci_high"] = float(c_high[c, li, pi])
        if not bool(beats[li, pi]):
            verdict = "no signal"
            text = f"'{self.target}': no signal above chance and the controls ({quoted}; {'; '.join(context)})."
        elif "random-init" not in self.controls:
            verdict = "no random-init control"
            text = (f"'{self.target}' is readable above chance and the controls that were run, but with no random-init "
                    f"control it may be in the input rather than computed: {quoted}; {'; '.join(context)}.")
        else:
            verdict = "finding"
            text = (f"'{self.target}' is readable, above chance and a random-init model (so the training put it "
                    f"there): {quoted}; {'; '.join(context)}.")
        return dict(out, verdict=verdict, text=text)

    def headline(self) -> dict:
        """What :meth:`finding` reports: the verdict and the cell it rests on, with chance.

        Returns:
            ``verdict``, ``layer``, ``position``, ``score`` and ``chance``.
        """
        found = self.finding()
        return {key: found[key] for key in ("verdict", "layer", "position", "score", "chance")}

    @property
    def selectivity(self) -> torch.Tensor:
        """Real minus control mean score [C, L, P]."""
        return self.mean[None] - self.control_mean

    def control(self, name: str = "shuffled") -> torch.Tensor:
        """Mean score of control ``name`` [L, P].

        Args:
            name: A control that was run.

        Returns:
            [L, P].

        Raises:
            AnalysisError: the control was not run.
        """
        if name not in self.controls:
            raise AnalysisError(f"control {name!r} was not run; run controls: {accepted(self.controls)}")
        return self.control_mean[self.controls.index(name)]

    def best(self) -> dict:
        """The layer and position with the highest mean held-out score, with its CI (clipped), chance,
        the controls, selectivity and whether it beats them (:meth:`beats_controls`; the sentence
        a reader should see is :meth:`finding`).

        Returns:
            The cell's numbers by name.
        """
        mean = self.mean
        flat = int(mean.flatten().argmax())
        li, pi = divmod(flat, mean.shape[1])
        low, high = self.ci
        out = dict(layer=self.layers[li], position=self.positions[pi], score=float(mean[li, pi]),
                   ci_low=float(low[li, pi]), ci_high=float(high[li, pi]), metric=self.metric, chance=self.chance,
                   beats_controls=bool(self.beats_controls()[li, pi]))
        for c, name in enumerate(self.controls):
            out[f"{_key(name)}_score"] = float(self.control_mean[c, li, pi])
            out[f"selectivity_{_key(name)}"] = float(self.selectivity[c, li, pi])
        return out

    def to_frame(self):
        """One row per layer × position × probe (``"probe"`` or a control); intervals clipped to the
        metric's range; ``beats_controls`` on probe rows (see :meth:`beats_controls`).

        Returns:
            A pandas DataFrame.
        """
        import pandas as pd

        rows = []
        sources = [("probe", self.fold_scores)] + [(c, self.control_scores[i]) for i, c in enumerate(self.controls)]
        beats = self.beats_controls()
        for source, scores in sources:
            mean, (low, high) = scores.mean(-1), clip_interval(*confidence_interval(scores), self.metric)
            for li, layer in enumerate(self.layers):
                for pi, position in enumerate(self.positions):
                    row = dict(site=self.site, target=self.target, kind=self.kind, source=source, layer=layer,
                               position=position, metric=self.metric, score=float(mean[li, pi]),
                               ci_low=float(low[li, pi]), ci_high=float(high[li, pi]),
                               n_folds=scores.shape[-1], folds=self.fold_scheme, chance=self.chance)
                    if source == "probe":
                        for c, name in enumerate(self.controls):
                            row[f"selectivity_{_key(name)}"] = float(self.selectivity[c, li, pi])
                        row["beats_controls"] = bool(beats[li, pi])
                    rows.append(row)
        return pd.DataFrame(rows)

    def plot(self, position: Optional[str] = None, **kwargs):
        """Score over layers with 95% CI bands, the controls and chance (see ``viz.probes``).

        Args:
            position: The position drawn (default: every position).
            **kwargs: Passed to :func:`arithinterp.viz.probes.plot_probe_layers`.

        Returns:
            A plotly Figure.
        """
        return draw(self, position=position, **kwargs)
