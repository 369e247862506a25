"""Testing labels by intervention: swap one labelled supernode for another and see whether the answer
moves as the labels say (Lindsey et al. 2025's validation of supernodes), beside random-feature controls.

A label *determines* the next token at a role when nearly every grid problem it holds on has the
same token there (``result mod 10 = 5`` at the position that predicts the units digit determines
``5``). For a held-out problem whose model answers ``t`` at that position, the **swap** zeroes the
features labelled for ``t`` (every layer, that position) and sets the features labelled for
another token ``t'`` to their typical activity where their label holds (their mean activation over
those grid cells); the label predicts the answer becomes ``t'``. The **control** zeroes as many
features active on the problem, drawn at random from outside both groups, and sets as many random
features, also from outside them, to the same activities. Everything runs on the real model, the
MLPs' own outputs kept and only the features' decoded change added
(:mod:`~arithinterp.features.interventions`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd
import torch
from arithinterp.progress import progress_bar

from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.engine import Read, Write, run
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.features.operand_plots import OperandPlots, activity_registry, label_plots
from arithinterp.features.transcoder import Transcoders
from arithinterp.results import PROBABILITY, Result, build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import HookedModel, PositiveInt, Probability, Seed, checked


def feature_settings(transcoders: Transcoders, settings: dict[int, torch.Tensor]) -> list[Write]:
    """Engine interventions that set features at each prompt's final position.

    Args:
        transcoders: The transcoders.
        settings: ``{layer: values [batch, feature]}``: the value each feature is set to, NaN to
            leave it as it is.

    Returns:
        Two :class:`~arithinterp.engine.Write` s per layer: one seeing ``mlp_in``, one adding the
        change of the features' decoded output to ``mlp_out`` (the MLP's own output kept).
    """
    out = []
    for layer, values in settings.items():
        i = transcoders.index(layer)
        seen: dict[str, torch.Tensor] = {}

        def look(x: torch.Tensor, seen: dict = seen) -> torch.Tensor:
            seen["x"] = x
            return x

        def change(mlp_out: torch.Tensor, seen: dict = seen, values: torch.Tensor = values, i: int = i,
                   layer: int = layer) -> torch.Tensor:
            acts = transcoders.encode(layer, seen["x"][:, -1])  # [B, F]
            wanted = values.to(acts.dtype)
            change = torch.where(wanted.isnan(), torch.zeros_like(acts), wanted - acts)
            delta = change @ transcoders.W_dec[i].to(acts.dtype)
            edited = mlp_out.clone()
            edited[:, -1] += delta.to(mlp_out.dtype)
            return edited

        out += [Write("mlp_in", layer, value=look), Write("mlp_out", layer, value=change)]
    return out


@dataclasses.dataclass(frozen=True)
class SwapResult(Result):
    """Labelled supernodes swapped on held-out problems (:func:`swap_test`).

    Attributes:
        role: The position swapped at and read.
        before (Int[Tensor, "prompt"]): The model's top token there, nothing changed.
        target (Int[Tensor, "prompt"]): The token the swapped-in group's labels determine.
        after (Int[Tensor, "prompt"]): The top token with the groups swapped.
        control (Int[Tensor, "prompt draw"]): The top token with random features changed instead.
        n_removed (Int[Tensor, "prompt"]): Features zeroed (the answer's group).
        n_added (Int[Tensor, "prompt"]): Features set (the target's group).
        as_predicted: The share of prompts whose answer became the target.
        as_predicted_control: The same share for the random draws.
        changed: The share whose answer changed at all.
        changed_control: The same for the random draws.
        groups: ``{token text: n features}`` of the labelled groups found.
        meta: Provenance.
    """

    role: str
    before: torch.Tensor
    target: torch.Tensor
    after: torch.Tensor
    control: torch.Tensor
    n_removed: torch.Tensor
    n_added: torch.Tensor
    as_predicted: float
    as_predicted_control: float
    changed: float
    changed_control: float
    groups: dict
    meta: dict

    _shapes = {"before": "prompt", "target": "prompt", "after": "prompt", "control": "prompt draw",
               "n_removed": "prompt", "n_added": "prompt"}
    _legal = {name: PROBABILITY for name in ("as_predicted", "as_predicted_control", "changed", "changed_control")}

    def to_frame(self) -> pd.DataFrame:
        """One row per prompt: the answer before, the target, after the swap, and how often a
        random draw gave the target."""
        return pd.DataFrame(dict(prompt=list(range(len(self.before))), before=self.before.tolist(),
                                 target=self.target.tolist(), after=self.after.tolist(),
                                 as_predicted=(self.after == self.target).tolist(),
                                 control_as_predicted=(self.control == self.target[:, None]).float().mean(1).tolist(),
                                 n_removed=self.n_removed.tolist(), n_added=self.n_added.tolist()))

    def plot(self, **kwargs: Any):
        return draw(self, **kwargs)


def token_groups(plots: OperandPlots, transcoders: Transcoders, role: str, *, min_agreement: float = 0.9,
                 threshold: float = 0.6, fdr: float = 0.05,
                 seed: int = 0) -> dict[int, list[tuple[int, int, float]]]:
    """The labelled features of every layer at ``role``, grouped by the next token their labels
    determine.

    Args:
        plots: The operand plots.
        transcoders: The transcoders they were read with.
        role: The role.
        min_agreement: The share of a label's grid cells that must have one next token.
        threshold: The classifier's score threshold.
        fdr: Its false-discovery rate.
        seed: Its shuffles' seed.

    Returns:
        ``{token: [(layer, feature, activity)]}``: each feature with its mean activation over the
        grid cells where its label holds.
    """
    r = plots.roles.index(role)
    next_tokens = plots.next_tokens[:, r]
    from arithinterp.neurons import build_heuristics

    a_values, b_values = sorted(set(plots.a.tolist())), sorted(set(plots.b.tolist()))
    built = build_heuristics(a_values, b_values, plots.op, registry=activity_registry())
    registry = {h.name: h for h in built.heuristics}
    result = plots.answer
    groups: dict[int, list[tuple[int, int, float]]] = {}
    for layer in plots.layers:
        if not plots.active(layer, role):
            continue
        frame = label_plots(plots, layer, role, threshold=threshold, fdr=fdr, seed=seed).to_frame()
        labelled = pd.DataFrame(frame[frame["label"]])
        table = labelled.sort_values(by="score", ascending=False).drop_duplicates("neuron")
        if table.empty:
            continue
        maps, a_values, b_values = plots.maps(layer, table["neuron"].tolist(), role)
        for row, (feature, name) in enumerate(zip(table["neuron"].tolist(), table["heuristic"].tolist())):
            holds = registry[name].mask(plots.a, plots.b, result) & (next_tokens >= 0)
            if int(holds.sum()) == 0:
                continue
            tokens, counts = next_tokens[holds].unique(return_counts=True)
            if float(counts.max()) < min_agreement * float(holds.sum()):
                continue  # the label does not decide the next token
            token = int(tokens[counts.argmax()])
            ia = torch.searchsorted(torch.tensor(a_values), plots.a[holds])
            ib = torch.searchsorted(torch.tensor(b_values), plots.b[holds])
            activity = float(maps[row, ia, ib].nan_to_num(0.0).mean())
            groups.setdefault(token, []).append((int(layer), int(feature), activity))
    return groups


@checked
def swap_test(model: HookedModel, prompts: PromptSet, transcoders: Transcoders, plots: OperandPlots, *,
              role: str = "final", n_random: PositiveInt = 10, min_agreement: Probability = 0.9,
              seed: Seed = 0, progress: bool = True) -> SwapResult:
    """Swap the labelled supernode of each problem's answer for another's, beside random controls.

    Args:
        model: The hooked model.
        prompts: Held-out problems (not in the plots' grid, ideally under another few-shot prefix).
        transcoders: The transcoders.
        plots: Operand plots of those transcoders, with ``role`` among their roles.
        role: The position to swap at: ``"final"`` (predicting the answer's first token) or
            ``"answer[j]"`` (predicting token ``j + 1``, the answer's tokens up to it fed).
        n_random: Random draws of the control per problem.
        min_agreement: The share of a label's grid cells that must share one next token.
        seed: Seeds the targets and the control's draws.
        progress: Show a progress bar.

    Returns:
        The swaps' outcomes beside the controls' (a :class:`SwapResult`).

    Raises:
        AnalysisError: Fewer than two tokens have a labelled group at ``role``.
        ConfigError: A role the plots do not have, or not ``"final"`` / ``"answer[j]"``.
    """
    check_belongs(model, "swap_test", prompts=prompts)
    transcoders.check_model(model)
    if role not in plots.roles:
        raise ConfigError(f"role {role!r} is not among the plots' roles {plots.roles}")
    if role == "final":
        fed = 0
    elif role.startswith("answer[") and role.endswith("]") and role[7:-1].isdigit():
        fed = int(role[7:-1]) + 1
    else:
        raise ConfigError(f"role must be 'final' or 'answer[j]' (a position that predicts an answer token), "
                          f"got {role!r}")
    groups = token_groups(plots, transcoders, role, min_agreement=min_agreement, seed=seed)
    if len(groups) < 2:
        raise AnalysisError(f"{len(groups)} token(s) have a labelled group at {role!r}; a swap needs two")
    keep = prompts.n_answer_tokens > fed  # problems whose answer has a token at this role
    if not bool(keep.any()):
        raise AnalysisError(f"no prompt's answer has a token after {role!r}")
    prompts = prompts[keep.nonzero().squeeze(1)]
    generator = torch.Generator().manual_seed(seed)
    F = transcoders.n_features
    n = len(prompts)
    before, target, after = (torch.full((n,), -1, dtype=torch.long) for _ in range(3))
    control = torch.full((n, n_random), -1, dtype=torch.long)
    n_removed, n_added = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    tokens_all = [prompts.unpadded(torch.tensor([i]))[0] for i in range(n)]
    for i in progress_bar(range(n), desc="swap test", disable=not progress):
        tokens = torch.cat([tokens_all[i], prompts.answer_tokens[i, :fed]])[None]
        layers = list(transcoders.layers)
        out = run(model, tokens, reads=[Read("mlp_in", layer, positions=-1) for layer in layers])
        assert out.logits is not None
        t = int(out.logits.argmax(-1))
        before[i] = t
        others = [token for token in groups if token != t]
        if t not in groups or not others:
            continue
        active = {layer: (transcoders.encode(layer, x.float())[0] > 0).nonzero().squeeze(1).tolist()
                  for layer, x in zip(layers, out.reads)}  # the features firing at the role on this problem
        t_new = others[int(torch.randint(len(others), (1,), generator=generator))]
        target[i] = t_new
        removed, added = groups[t], groups[t_new]
        n_removed[i], n_added[i] = len(removed), len(added)
        settings: dict[int, torch.Tensor] = {}
        for layer, feature, _ in removed:
            settings.setdefault(layer, torch.full((1, F), float("nan")))[0, feature] = 0.0
        for layer, feature, activity in added:
            settings.setdefault(layer, torch.full((1, F), float("nan")))[0, feature] = activity
        swapped = run(model, tokens, feature_settings(transcoders, settings)).logits
        assert swapped is not None
        after[i] = int(swapped.argmax(-1))
        used = {(layer, feature) for layer, feature, _ in removed + added}
        for trial in range(n_random):  # as many features of the same layers, from outside both groups
            random: dict[int, torch.Tensor] = {}
            for layer, _, _ in removed:  # zeroed: drawn from those firing there on this problem
                pool = [f for f in active[layer] if (layer, f) not in used] or [
                    f for f in range(F) if (layer, f) not in used]
                feature = pool[int(torch.randint(len(pool), (1,), generator=generator))]
                random.setdefault(layer, torch.full((1, F), float("nan")))[0, feature] = 0.0
            for layer, _, activity in added:  # set to the same activities
                while (layer, feature := int(torch.randint(F, (1,), generator=generator))) in used:
                    pass
                random.setdefault(layer, torch.full((1, F), float("nan")))[0, feature] = activity
            logits = run(model, tokens, feature_settings(transcoders, random)).logits
            assert logits is not None
            control[i, trial] = int(logits.argmax(-1))
    tested = target >= 0
    if not bool(tested.any()):
        raise AnalysisError(f"no prompt's answer at {role!r} has a labelled group to swap out")
    hit = (after == target)[tested].float()
    hit_control = (control == target[:, None])[tested].float()
    changed = (after != before)[tested].float()
    changed_control = (control != before[:, None])[tested].float()
    names = {token: str(model.to_string(torch.tensor([token]))) for token in groups}
    return SwapResult(role=role, before=before, target=target, after=after, control=control, n_removed=n_removed,
                      n_added=n_added, as_predicted=float(hit.mean()), as_predicted_control=float(hit_control.mean()),
                      changed=float(changed.mean()), changed_control=float(changed_control.mean()),
                      groups={names[token]: len(members) for token, members in sorted(groups.items())},
                      meta=build_meta(model, n_prompts=n, n_tested=int(tested.sum()), n_random=n_random,
                                      min_agreement=min_agreement, seed=seed))
