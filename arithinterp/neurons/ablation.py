"""Ablation: ablate heuristic neurons and compare accuracy on associated prompts against other
prompts or a same-size random control.

One module past 600 lines on purpose: the ablation of heuristic neurons, its prompt groups and its
same-size random control are one experiment.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Sequence, Union

import pandas as pd
import torch

from arithinterp.checks import check_belongs, integers
from arithinterp import engine
from arithinterp import sites as site_lib
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.intervals import bootstrap_means
from arithinterp.engine.ablations import DEFAULT_STACK_BYTES
from arithinterp.engine.budget import memory_budget
from arithinterp.neurons.final_reads import check_engine, check_prompts, final_position_batches, mean_final_activation
from arithinterp.neurons.table import HeuristicTable
from arithinterp.progress import progress_bar
from arithinterp.results import NON_NEGATIVE, POSITIVE, PROBABILITY, Result, build_meta
from arithinterp.types import HookedModel, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

NEURON_ABLATIONS = ("mean", "zero")
PROMPT_REFERENCES = ("answer", "model")  # what ablate_for_prompt compares each ablated run with
PROMPT_CONTROLS = ("table", "layer", "other-prompt")  # what ablate_for_prompt ablates as its control


# --- results -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HeuristicAblationResult(Result):
    """Accuracy after ablating each heuristic's neurons, on associated vs other prompts.

    Attributes:
        heuristics: The ablated heuristics' names.
        families: Their families.
        n_neurons (Int[Tensor, "heuristic"]): The neurons each labels.
        n_associated (Int[Tensor, "heuristic"]): The prompts whose (a, b, result) satisfy it.
        n_other (Int[Tensor, "heuristic"]): The other prompts.
        associated_before (Float[Tensor, "heuristic"]): Accuracy on associated prompts, nothing ablated.
        associated_after (Float[Tensor, "heuristic"]): Accuracy on associated prompts with the
            heuristic's neurons ablated.
        other_before (Float[Tensor, "heuristic"]): Accuracy on the other prompts, nothing ablated.
        other_after (Float[Tensor, "heuristic"]): Accuracy on the other prompts, neurons ablated.
        ablation: ``"mean"`` or ``"zero"``.
        meta: Provenance, the prompt count and the table's threshold.
    """

    heuristics: list
    families: list
    n_neurons: torch.Tensor
    n_associated: torch.Tensor
    n_other: torch.Tensor
    associated_before: torch.Tensor
    associated_after: torch.Tensor
    other_before: torch.Tensor
    other_after: torch.Tensor
    ablation: str
    meta: dict = dataclasses.field(default_factory=dict)

    # what load checks: the axes fields share and the values they may take
    _shapes = {"heuristics": "heuristic", "families": "heuristic", "n_neurons": "heuristic",
               "n_associated": "heuristic", "n_other": "heuristic", "associated_before": "heuristic",
               "associated_after": "heuristic", "other_before": "heuristic", "other_after": "heuristic"}
    _legal = {"n_neurons": NON_NEGATIVE, "n_associated": NON_NEGATIVE, "n_other": NON_NEGATIVE,
              "associated_before": PROBABILITY, "associated_after": PROBABILITY, "other_before": PROBABILITY,
              "other_after": PROBABILITY, "ablation": NEURON_ABLATIONS}

    def headline(self) -> dict:
        """The mean drops in accuracy on the prompts each heuristic is about and on the others
        (:meth:`summary`).

        Returns:
            ``heuristics``, ``associated_drop`` and ``other_drop``.
        """
        found = self.summary()
        return {key: found[key] for key in ("heuristics", "associated_drop", "other_drop")}

    def summary(self) -> dict[str, float]:
        """Mean accuracy (over heuristics) remaining on associated and other prompts, and drops.

        Returns:
            ``heuristics`` (those with associated prompts), ``associated_before``,
            ``associated_after``, ``other_before``, ``other_after``, ``associated_drop``, ``other_drop``.
        """
        ok = self.n_associated > 0
        return dict(
            heuristics=int(ok.sum()),
            associated_before=float(self.associated_before[ok].mean()),
            associated_after=float(self.associated_after[ok].mean()),
            other_before=float(self.other_before[ok].mean()),
            other_after=float(self.other_after[ok].mean()),
            associated_drop=float((self.associated_before - self.associated_after)[ok].mean()),
            other_drop=float((self.other_before - self.other_after)[ok].mean()),
        )

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            dict(
                heuristic=self.heuristics,
                family=self.families,
                n_neurons=self.n_neurons.numpy(),
                n_associated=self.n_associated.numpy(),
                n_other=self.n_other.numpy(),
                associated_before=self.associated_before.numpy(),
                associated_after=self.associated_after.numpy(),
                other_before=self.other_before.numpy(),
                other_after=self.other_after.numpy(),
            )
        )

    def plot(self, **kwargs):
        return draw(self, **kwargs)


@dataclasses.dataclass(frozen=True)
class PromptAblationResult(Result):
    """Per-prompt ablation of each prompt's own heuristic neurons vs a random control.

    Attributes:
        ks: The numbers of neurons ablated per layer.
        heuristic_correct (Float[Tensor, "k"]): The fraction of prompts still answered (their
            ``reference`` answer still produced) with their own heuristic neurons ablated.
        control_correct (Float[Tensor, "k"]): The same with as many random neurons ablated.
        n_ablated (Float[Tensor, "k"]): The mean number of neurons ablated per prompt in the
            heuristic arm.
        baseline: The fraction answered with nothing ablated.
        n_prompts: The number of prompts.
        ablation: ``"mean"`` or ``"zero"``.
        meta: Provenance, ``rank_by``, ``control``, the seed, the bootstrap settings and the table's threshold.
        n_control (Float[Tensor, "k"] | None): The mean number ablated per prompt in the control
            arm: ``n_ablated`` unless the control's pool ran short for some prompts.
        heuristic_per_prompt (Bool[Tensor, "k prompt"] | None): Whether each prompt is still
            answered in the heuristic arm.
        control_per_prompt (Bool[Tensor, "k prompt"] | None): The same in the control arm.
        baseline_per_prompt (Bool[Tensor, "prompt"] | None): The same with nothing ablated.
        heuristic_ci (Float[Tensor, "2 k"] | None): The 95% percentile-bootstrap interval of
            ``heuristic_correct`` over prompts.
        control_ci (Float[Tensor, "2 k"] | None): That of ``control_correct``.
        difference (Float[Tensor, "k"] | None): ``control_correct - heuristic_correct``: the
            share of prompts the prompt's own neurons break beyond what as many random ones break.
        difference_ci (Float[Tensor, "2 k"] | None): Its paired interval (both arms resampled over
            the same prompts).
        reference: What "answered" means: ``"answer"`` (the task's answer) or ``"model"`` (the
            model's own unablated greedy answer, so ``baseline`` is 1).
    """

    ks: list
    heuristic_correct: torch.Tensor
    control_correct: torch.Tensor
    n_ablated: torch.Tensor
    baseline: float
    n_prompts: int
    ablation: str
    meta: dict = dataclasses.field(default_factory=dict)
    n_control: Optional[torch.Tensor] = None
    heuristic_per_prompt: Optional[torch.Tensor] = None
    control_per_prompt: Optional[torch.Tensor] = None
    baseline_per_prompt: Optional[torch.Tensor] = None
    heuristic_ci: Optional[torch.Tensor] = None
    control_ci: Optional[torch.Tensor] = None
    difference: Optional[torch.Tensor] = None
    difference_ci: Optional[torch.Tensor] = None
    reference: str = "answer"

    # what load checks: the axes fields share and the values they may take
    _shapes = {"ks": "k", "heuristic_correct": "k", "control_correct": "k", "n_ablated": "k", "n_control": "k",
               "heuristic_per_prompt": "k prompt", "control_per_prompt": "k prompt", "baseline_per_prompt": "prompt",
               "heuristic_ci": "2 k", "control_ci": "2 k", "difference": "k", "difference_ci": "2 k"}
    _legal = {"ks": POSITIVE, "heuristic_correct": PROBABILITY, "control_correct": PROBABILITY,
              "n_ablated": NON_NEGATIVE, "n_control": NON_NEGATIVE, "baseline": PROBABILITY,
              "n_prompts": NON_NEGATIVE, "ablation": NEURON_ABLATIONS, "heuristic_ci": PROBABILITY,
              "control_ci": PROBABILITY, "reference": PROMPT_REFERENCES}

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for i, k in enumerate(self.ks):
            for arm, values, ci, sizes in (("heuristic", self.heuristic_correct, self.heuristic_ci, self.n_ablated),
                                           ("control", self.control_correct, self.control_ci, self.n_control)):
                low, high = (float(ci[0, i]), float(ci[1, i])) if ci is not None else (float("nan"),) * 2
                size = sizes if sizes is not None else self.n_ablated
                rows.append(dict(k=k, arm=arm, correct=float(values[i]), ci_low=low, ci_high=high,
                                 n_ablated=float(size[i])))
        return pd.DataFrame(rows)

    def comparison(self) -> pd.DataFrame:
        """One row per ``k``: both arms with their intervals and the paired difference.

        Returns:
            Columns ``k``, ``n_ablated``, ``n_control``, ``heuristic`` (with ``heuristic_low`` /
            ``heuristic_high``), ``control`` (with its interval), ``difference`` = control −
            heuristic (with its paired interval) and ``distinct``: whether that interval excludes 0.

        Raises:
            AnalysisError: The result predates per-prompt outcomes (no intervals to compare).
        """
        if self.difference is None or self.difference_ci is None or self.heuristic_ci is None \
                or self.control_ci is None:
            raise AnalysisError("this result has no per-prompt outcomes (saved by an older version); run "
                                "ablate_for_prompt again for intervals")
        n_control = self.n_control if self.n_control is not None else self.n_ablated
        low, high = self.difference_ci
        return pd.DataFrame(dict(
            k=self.ks, n_ablated=self.n_ablated.numpy(), n_control=n_control.numpy(),
            heuristic=self.heuristic_correct.numpy(), heuristic_low=self.heuristic_ci[0].numpy(),
            heuristic_high=self.heuristic_ci[1].numpy(), control=self.control_correct.numpy(),
            control_low=self.control_ci[0].numpy(), control_high=self.control_ci[1].numpy(),
            difference=self.difference.numpy(), difference_low=low.numpy(), difference_high=high.numpy(),
            distinct=((low > 0) | (high < 0)).numpy(),
        ))

    def plot(self, **kwargs):
        return draw(self, **kwargs)


# --- ablations -----------------------------------------------------------------------------------


def _check_ablation(ablation: str) -> None:
    if ablation not in NEURON_ABLATIONS:
        raise ConfigError(f"unknown ablation {ablation!r}; accepted: {accepted(NEURON_ABLATIONS)}")


def _replacement(model, prompts, layers: list[int], ablation: str, batch_size: int,
                 choice: str = "hooks") -> torch.Tensor:
    """What an ablated neuron is set to, ``[L, d_mlp]``: its mean ablation value at the final
    position (:func:`~arithinterp.neurons.final_reads.mean_final_activation`, the engine's one
    definition, over ``prompts``), or 0. Unless ``choice`` is ``"hooks"`` the activations come
    from stepped base runs where the model allows (:func:`_stepped_mean`)."""
    if ablation == "zero":
        return torch.zeros(len(layers), int(model.cfg.d_mlp))
    stepped = None if choice == "hooks" else _stepped_mean(model, prompts, layers, batch_size)
    return stepped if stepped is not None else mean_final_activation(model, prompts, layers, batch_size)


def _stepped_mean(model, prompts, layers: list[int], batch_size: int) -> Optional[torch.Tensor]:
    """:func:`~arithinterp.neurons.final_reads.mean_final_activation` from stepped base runs
    (:func:`arithinterp.engine.steppers.read_last`): the last block runs the final position only and
    the first tokens the prompts share are computed once, where a whole forward computes every
    position. ``None`` when a batch cannot be read that way (padded rows, blocks that cannot be
    stepped): the caller then runs whole forwards. The same batches as the ablations that follow."""
    from arithinterp.engine.steppers import read_last

    names = [site_lib.hook_name("mlp_post", layer) for layer in layers]
    mean = engine.RunningMean()
    for _, tokens, final in final_position_batches(prompts, batch_size):
        if bool((final != tokens.shape[1] - 1).any()):
            return None
        reads = read_last(model, tokens, names, 1, only_if_shared=False)
        if reads is None:
            return None
        mean.add(torch.stack([reads[name][:, 0].float().cpu() for name in names], 1)[:, None])
    return mean.value()[0]


def _correct(
    model, prompts, masks: dict[int, torch.Tensor], replacement: dict[int, torch.Tensor], batch_size: int,
    answers: torch.Tensor,
) -> torch.Tensor:
    """Whether each prompt produces ``answers`` (``[P, K]`` tokens, ``-1`` past the end) with
    neurons ablated at the final position.

    ``masks[layer]`` is ``[d_mlp]`` (same for every prompt) or ``[P, d_mlp]`` bool. With
    ``prompts.scoring == "full-answer"`` every answer token is checked teacher-forced (equal to
    greedy exact match); otherwise the first answer token. The ablations are
    :class:`~arithinterp.engine.Write` s run by :func:`arithinterp.engine.run`.
    """
    correct = torch.zeros(len(prompts), dtype=torch.bool)
    full = getattr(prompts, "scoring", "first-token") == "full-answer" and answers.shape[1] > 1
    for idx, tokens, final in final_position_batches(prompts, batch_size):
        rows = torch.arange(len(idx))
        answer = answers[idx]
        ablations = []
        for layer, mask in masks.items():
            m = mask[idx] if mask.ndim == 2 else mask[None].expand(len(idx), -1)

            def ablate(current, m=m, value=replacement[layer]):  # [B, d_mlp] at the final position
                return torch.where(m.to(current.device), value.to(current.device, current.dtype)[None], current)

            ablations.append(engine.Write("mlp_post", layer, final, value=ablate))
        if full:
            extra = answer[:, :-1].clamp(min=0)
            k = answer.shape[1]
            # each answer token is predicted at the prompt's final position and the k - 1 fed after it
            ends = bool((final == tokens.shape[1] - 1).all())
            logits = engine.run(model, torch.cat([tokens, extra], dim=1), ablations, logits=k if ends else "all").logits
            assert logits is not None  # asked for
            steps = torch.arange(k)
            at = final[:, None] + steps[None] - (tokens.shape[1] - 1 if ends else 0)
            predicted = logits[rows[:, None], at].argmax(-1).cpu()
            correct[idx] = ((predicted == answer) | (answer < 0)).all(1)
        else:
            logits = engine.run(model, tokens, ablations).logits  # the final position: the prompt's last token
            assert logits is not None
            correct[idx] = logits.argmax(-1).cpu() == answer[:, 0]
    return correct


def _correct_many(
    model, prompts, cells: Sequence[dict[int, torch.Tensor]], replacement: dict[int, torch.Tensor], batch_size: int,
    choice: str = "auto", answers: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`_correct` of every cell's masks, ``[len(cells), P]`` bool; ``answers`` defaults to
    the prompts' answer tokens.

    ``choice="hooks"`` (or a model whose blocks cannot be stepped, under ``"auto"``) runs
    :func:`_correct` cell by cell, whole forwards; otherwise each batch of prompts runs once and
    the cells are stacked from their lowest ablated layer at the final position
    (:class:`arithinterp.engine.AblationRunner`), the earlier positions' keys and values reused.
    """
    answers = prompts.answer_tokens if answers is None else answers
    first = next(iter(final_position_batches(prompts, 1)))[1]
    stepper = None if choice == "hooks" else engine.stepper_for(model, first, choice, warn=False)[0]
    if stepper is None:
        return torch.stack([_correct(model, prompts, masks, replacement, batch_size, answers)
                            for masks in cells]) if cells else torch.zeros(0, len(prompts), dtype=torch.bool)
    correct = torch.zeros(len(cells), len(prompts), dtype=torch.bool)
    full = getattr(prompts, "scoring", "first-token") == "full-answer" and answers.shape[1] > 1
    for idx, tokens, final in final_position_batches(prompts, batch_size):
        answer = answers[idx]
        n_answer = answer.shape[1] if full else 1
        if full:
            tokens = torch.cat([tokens, answer[:, :-1].clamp(min=0)], dim=1)
        T = tokens.shape[1]
        n_last = T - int(final.min())  # from the earliest final position on: every answer token's logits
        step = (final - (T - n_last))[:, None] + torch.arange(n_answer)[None]  # [B, n_answer] among those
        stepper, _ = engine.stepper_for(model, tokens, choice, warn=False)
        runner = engine.AblationRunner(model, stepper, tokens, n_last=n_last)
        stacked = [[engine.Ablation("mlp_post", layer, final, mask[idx] if mask.ndim == 2 else mask[None].expand(
            len(idx), -1), replacement[layer]) for layer, mask in masks.items()] for masks in cells]

        def right(logits, step=step, answer=answer[:, :n_answer]):  # [c, B, n_last, V] -> [c, B]
            rows = torch.arange(logits.shape[1], device=logits.device)
            predicted = logits[:, rows[:, None], step.to(logits.device)].argmax(-1).cpu()
            return ((predicted == answer) | (answer < 0)).all(-1)

        correct[:, idx] = runner.run(stacked, n_last=n_last, score=right,
                                     max_memory=min(memory_budget(model), DEFAULT_STACK_BYTES))
    return correct


def _association(table: HeuristicTable, prompts, names: Sequence[str]) -> torch.Tensor:
    """``[P, len(names)]`` bool: prompt's (a, b, result) satisfies each heuristic."""
    result = prompts.answer  # the task's result, reduced mod the modulus when there is one
    return torch.stack([table.heuristic(n).mask(prompts.a, prompts.b, result) for n in names], dim=1)


def _check_table(model, table) -> None:
    if not isinstance(table, HeuristicTable):
        raise AnalysisError(
            f"table must be a HeuristicTable (from classify / classify_maps), got {type(table).__name__}"
        )
    site_lib.check_layers(model, "mlp_post", sorted(set(table.layer.tolist())))


@checked
def ablate_heuristic(
    model: HookedModel,
    prompts: PromptSet,
    table: HeuristicTable,
    heuristic: Union[str, Sequence[str], None] = None,
    *,
    ablation: str = "mean",
    min_neurons: int = 1,
    batch_size: PositiveInt = 512,
    engine: str = "auto",
    progress: bool = True,
) -> HeuristicAblationResult:
    """Ablate the neurons of each heuristic; accuracy on associated vs other prompts (Nikankin et al. 2025).

    A prompt is associated with a heuristic when its (a, b, result) satisfies it. Neurons are
    ablated at the final position by setting ``mlp_post`` to its mean ablation value
    (``ablation="mean"``: :func:`arithinterp.engine.mean_activation` over ``prompts`` at the final
    position, i.e. the mean over all of them) or to zero (``"zero"``).

    Args:
        model: the hooked model.
        prompts: the prompts to score.
        table: the classification (:func:`classify`) whose neurons are ablated.
        heuristic: a name, a list of names, or ``None`` for every heuristic that labels at least
            ``min_neurons`` neurons.
        ablation: ``"mean"`` or ``"zero"``.
        min_neurons: with ``heuristic=None``, the fewest neurons a heuristic must label.
        batch_size: prompts per forward.
        engine: ``"auto"`` (the heuristics stacked and resumed from their lowest ablated layer at the
            final position, each batch of prompts run once, where the model's blocks can be stepped;
            else whole forwards), ``"stepped"`` (refuse to fall back) or ``"hooks"`` (one whole
            forward per heuristic and batch, the reference).
        progress: show a progress bar.

    Returns:
        Per heuristic, the accuracy on associated and other prompts before and after.

    Raises:
        ConfigError: An unknown ablation or engine, or an unknown heuristic name.
        AnalysisError: No heuristic labels ``min_neurons`` neurons, or a table of another model.
        ModelMismatchError: The prompts or table belong to another model.
    """
    check_belongs(model, "neurons.ablate_heuristic", prompts=prompts, table=table)
    check_prompts(prompts)
    _check_table(model, table)
    _check_ablation(ablation)
    check_engine(engine)
    if heuristic is None:
        counts = table.labels.sum(0)
        names = [n for n, c in zip(table.names, counts.tolist()) if c >= min_neurons]
        if not names:
            raise AnalysisError(f"no heuristic labels {min_neurons} or more neurons in this table")
    else:
        names = [heuristic] if isinstance(heuristic, str) else list(heuristic)
        for n in names:
            table.index(n)
    layers = sorted(set(table.layer.tolist()))
    fill = _replacement(model, prompts, layers, ablation, batch_size, engine)
    replacement = {l: fill[i] for i, l in enumerate(layers)}
    associated = _association(table, prompts, names)
    d_mlp = int(model.cfg.d_mlp)
    rows = dict(
        n_neurons=[],
        n_associated=[],
        n_other=[],
        associated_before=[],
        associated_after=[],
        other_before=[],
        other_after=[],
    )
    cells = []  # the neurons of each heuristic, per layer
    for name in names:
        members = table.neurons_of(name)
        masks = {}
        for l in layers:
            chosen = table.neuron[members][table.layer[members] == l]
            if chosen.numel():
                masks[l] = torch.zeros(d_mlp, dtype=torch.bool).index_fill_(0, chosen, True)
        cells.append(masks)
    # nothing ablated first; a heuristic without neurons leaves the run as it is
    results = _correct_many(model, prompts, [{}] + [masks for masks in cells if masks], replacement, batch_size,
                            engine)
    before, runs = results[0], iter(results[1:])
    for j, name in enumerate(progress_bar(names, desc="ablate heuristics", disable=not progress)):
        members = table.neurons_of(name)
        after = next(runs) if cells[j] else before
        assoc = associated[:, j]
        rows["n_neurons"].append(len(members))
        rows["n_associated"].append(int(assoc.sum()))
        rows["n_other"].append(int((~assoc).sum()))
        for arm, sel in (("associated", assoc), ("other", ~assoc)):
            rows[f"{arm}_before"].append(float(before[sel].float().mean()) if sel.any() else float("nan"))
            rows[f"{arm}_after"].append(float(after[sel].float().mean()) if sel.any() else float("nan"))
    return HeuristicAblationResult(
        heuristics=names,
        families=[table.families[table.index(n)] for n in names],
        **{k: torch.tensor(v, dtype=torch.long if k.startswith("n_") else torch.float32) for k, v in rows.items()},
        ablation=ablation,
        meta=build_meta(model, n_prompts=len(prompts), threshold=table.threshold),
    )


@checked
def ablate_for_prompt(
    model: HookedModel,
    prompts: PromptSet,
    table: HeuristicTable,
    k: Union[int, Sequence[int]] = (1, 2, 5, 10, 20),
    *,
    ablation: str = "mean",
    rank_by: str = "score",
    reference: str = "answer",
    control: str = "table",
    seed: int = 0,
    n_boot: int = 1000,
    batch_size: PositiveInt = 512,
    engine: str = "auto",
    progress: bool = True,
) -> PromptAblationResult:
    """For each prompt, ablate the neurons whose heuristics it satisfies, vs a random control.

    Per prompt and layer, up to ``k`` of the table's neurons with a heuristic the prompt
    satisfies are ablated (the best first by ``rank_by``: ``"score"`` — the neuron's mean score
    over its labels the prompt satisfies — or ``"importance"``). The control ablates, for the same
    prompt and layer, the same number of neurons not associated with the prompt: drawn at random
    (seeded) from the table's other neurons of that layer (``control="table"``, the default: as
    important as the ablated ones, so the comparison isolates the association) or from any neuron
    of the layer (``"layer"``: mostly unimportant neurons, a weaker control); or (``"other-prompt"``)
    the neurons the same rule picks for another prompt with a different result (a seeded partner),
    less the prompt's own: heuristic neurons chosen as carefully, for the wrong prompt. Where the
    pool holds fewer neurons than the heuristic arm ablates, the control ablates the whole pool and
    ``n_control`` says so. Follows Nikankin et al. 2025.

    A prompt is *answered* when the run produces its reference answer: the task's answer
    (``reference="answer"``; on correctly answered prompts the kept share is the accuracy kept) or
    the model's own greedy answer with nothing ablated (``"model"``: what a model that answers
    nothing right, e.g. a random-init control, still produces). With ``prompts.scoring ==
    "full-answer"`` every answer token is checked teacher-forced (greedy exact match); otherwise the
    first answer token. The neurons are ablated at the final position, where the table read them.

    Both arms' shares carry 95% percentile-bootstrap intervals over prompts, and their difference
    (control − heuristic) a paired one (:meth:`PromptAblationResult.comparison`).

    Args:
        model: The hooked model.
        prompts: The prompts to score.
        table: The classification whose neurons are ablated.
        k: Neurons ablated per prompt and layer, one number or several.
        ablation: ``"mean"`` or ``"zero"``.
        rank_by: ``"score"`` or ``"importance"``.
        reference: ``"answer"`` or ``"model"``.
        control: ``"table"``, ``"layer"`` or ``"other-prompt"``: what the control ablates.
        seed: Seeds the control's draw and the bootstrap.
        n_boot: Bootstrap resamples, at least 100.
        batch_size: Prompts per forward.
        engine: As in :func:`ablate_heuristic` (every ``k`` and arm stacked; ``"hooks"`` the reference).
        progress: Show a progress bar.

    Returns:
        The share of prompts still answered in both arms for each ``k``, per prompt and with intervals.

    Raises:
        ConfigError: An unknown ablation, engine, ``rank_by``, ``reference`` or ``control``, a
            ``k`` below 1, ``n_boot`` below 100, or ``rank_by="importance"`` without importance scores.
        AnalysisError: No neuron in the table has a label, or (``control="other-prompt"``) a prompt
            has no partner with another result.
        ModelMismatchError: The prompts or table belong to another model.
    """
    check_belongs(model, "neurons.ablate_for_prompt", prompts=prompts, table=table)
    check_prompts(prompts)
    _check_table(model, table)
    _check_ablation(ablation)
    check_engine(engine)
    for name, value, options in (("rank_by", rank_by, ("score", "importance")), ("reference", reference,
                                 PROMPT_REFERENCES), ("control", control, PROMPT_CONTROLS)):
        if value not in options:
            raise ConfigError(f"unknown {name} {value!r}; accepted: {accepted(options)}")
    ks = integers("k", k, ConfigError)
    if not ks or any(x < 1 for x in ks):
        raise ConfigError(f"k must be a positive integer or a list of them, got {k!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 100:
        raise ConfigError(f"n_boot must be an integer ≥ 100 (bootstrap resamples over prompts), got {n_boot!r}")
    if rank_by == "importance" and torch.isnan(table.importance).all():
        raise ConfigError("rank_by='importance' needs a table with importance scores (classify with top_k)")
    labelled = table.labels
    used = torch.nonzero(labelled.any(0)).flatten()
    names = [table.names[i] for i in used.tolist()]
    if not names:
        raise AnalysisError("no neuron in this table has a heuristic label; nothing to ablate")
    sat = _association(table, prompts, names).float()  # [P, H']
    lab = labelled[:, used].float()  # [N, H']
    assoc = (sat @ lab.T) > 0  # [P, N]
    if rank_by == "score":
        # mean score of the neuron's labels that the prompt satisfies (a matmul, no [P, N, H] tensor)
        priority = (sat @ (lab * table.best_scores[:, used]).T) / (sat @ lab.T).clamp(min=1)
    else:
        priority = table.importance[None].expand(len(prompts), -1)
    answers = prompts.answer_tokens
    if reference == "model":  # the model's own greedy answer, padded like the task's
        answers = torch.where(answers >= 0, prompts.evaluate(model, progress=False).generated_tokens, -1)
    generator = torch.Generator().manual_seed(seed)
    partner = _partners(prompts.answer, generator) if control == "other-prompt" else None
    layers = sorted(set(table.layer.tolist()))
    fill = _replacement(model, prompts, layers, ablation, batch_size, engine)
    replacement = {l: fill[i] for i, l in enumerate(layers)}
    d_mlp = int(model.cfg.d_mlp)
    P = len(prompts)
    cells, sizes, control_sizes = [{}], [], []  # nothing ablated, then each k's heuristic and control masks
    for kk in progress_bar(ks, desc="ablate per prompt", disable=not progress):
        masks_h, masks_c, total, total_c = {}, {}, torch.zeros(P), torch.zeros(P)
        for l in layers:
            cols = torch.nonzero(table.layer == l).flatten()
            a = assoc[:, cols]
            pri = torch.where(a, priority[:, cols], torch.tensor(float("-inf")))
            count = a.sum(1).clamp(max=kk)
            masks_h[l] = _scatter_mask(_first(pri, count) & a, table.neuron[cols], d_mlp)
            if partner is not None:  # the partner's neurons by the same rule, none of the prompt's own
                pool = a[partner] & ~a
                pick = _first(torch.where(pool, priority[partner][:, cols], torch.tensor(float("-inf"))),
                              torch.minimum(count, pool.sum(1))) & pool
                masks_c[l] = _scatter_mask(pick, table.neuron[cols], d_mlp)
            else:  # the table's other neurons of this layer, or every neuron of it not associated
                pool = _scatter_mask(~a, table.neuron[cols], d_mlp) if control == "table" else ~_scatter_mask(
                    a, table.neuron[cols], d_mlp)
                noise = torch.where(pool, torch.rand(P, d_mlp, generator=generator), torch.tensor(-1.0))
                masks_c[l] = _first(noise, torch.minimum(count, pool.sum(1))) & pool
            total += count
            total_c += masks_c[l].sum(1)
        cells += [masks_h, masks_c]
        sizes.append(float(total.mean()))
        control_sizes.append(float(total_c.mean()))
    kept = _correct_many(model, prompts, cells, replacement, batch_size, engine, answers)  # [cells, P]
    heuristic, control_kept = kept[1::2].clone(), kept[2::2].clone()
    # one set of resamples for every row, so the difference's interval is paired
    rows = torch.cat([heuristic, control_kept, control_kept.float() - heuristic.float()]).float()
    boot = bootstrap_means(rows, n_boot, seed)  # [n_boot, 3k]
    low, high = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=boot.dtype), dim=0).float()
    n = len(ks)
    means = rows.mean(1)
    return PromptAblationResult(
        ks=ks,
        heuristic_correct=means[:n].clone(),
        control_correct=means[n : 2 * n].clone(),
        n_ablated=torch.tensor(sizes),
        baseline=float(kept[0].float().mean()),
        n_prompts=P,
        ablation=ablation,
        n_control=torch.tensor(control_sizes),
        heuristic_per_prompt=heuristic,
        control_per_prompt=control_kept,
        baseline_per_prompt=kept[0].clone(),
        heuristic_ci=torch.stack([low[:n], high[:n]]),
        control_ci=torch.stack([low[n : 2 * n], high[n : 2 * n]]),
        difference=means[2 * n :].clone(),
        difference_ci=torch.stack([low[2 * n :], high[2 * n :]]),
        reference=reference,
        meta=build_meta(model, n_prompts=P, rank_by=rank_by, control=control, reference=reference, seed=seed,
                        n_boot=n_boot, threshold=table.threshold, interval="95% percentile bootstrap over prompts"),
    )


def _partners(results: torch.Tensor, generator: torch.Generator, tries: int = 64) -> torch.Tensor:
    """A random partner ``[P]`` for every prompt, one whose result differs (redrawn up to ``tries`` times).

    Raises:
        AnalysisError: A prompt finds no partner with another result (e.g. every result is the same).
    """
    P = len(results)
    partner = torch.randint(P, (P,), generator=generator)
    for _ in range(tries):
        same = results[partner] == results
        if not same.any():
            return partner
        partner[same] = torch.randint(P, (int(same.sum()),), generator=generator)
    raise AnalysisError(f"control='other-prompt' needs, for every prompt, another prompt with a different result; "
                        f"{int((results[partner] == results).sum())} of {P} found none in {tries} draws")


def _first(priority: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``[P, n]`` bool: the ``count[p]`` highest-priority entries of each row."""
    order = torch.argsort(priority, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(priority.shape[1]).expand_as(order))
    return rank < count[:, None]


def _scatter_mask(pick: torch.Tensor, neuron: torch.Tensor, d_mlp: int) -> torch.Tensor:
    """Per-prompt picks over a layer's table neurons → ``[P, d_mlp]`` bool."""
    out = torch.zeros(pick.shape[0], d_mlp, dtype=torch.bool)
    out[:, neuron] = pick
    return out
