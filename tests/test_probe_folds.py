"""Cross-validation folds of probe sweeps: grouped by operand pair when pairs repeat.

Planted leakage: each (a, b) pair appears several times (as when prompt sets with different
few-shot prefixes are pooled) with nearly the same activation, and the label is a random lookup
per pair — nothing a probe could learn that carries over to an unseen pair. Folds that put copies
of one pair on both sides score it far above chance; folds grouped by pair score it at chance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arithinterp import probes
from arithinterp.activations import Activations
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.tasks import concat, prompts_for_pairs

N_PAIRS, COPIES, D, CLASSES = 40, 5, 64, 4


@pytest.fixture(scope="module")
def leaky(tiny_model):
    """Activations of 40 distinct pairs, each seen 5 times (5 few-shot prefixes), and a label
    drawn at random per pair."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 90, (N_PAIRS,), generator=g).tolist()
    b = torch.randint(0, 90, (N_PAIRS,), generator=g).tolist()
    parts = [prompts_for_pairs(tiny_model, "+", a, b, "{a}+{b}=", few_shot=k, seed=k) for k in range(COPIES)]
    prompts = concat(parts)
    pair_code = torch.randn(N_PAIRS, D, generator=g)  # what one pair looks like, whatever its prefix
    X = pair_code.repeat(COPIES, 1) + 0.1 * torch.randn(N_PAIRS * COPIES, D, generator=g)
    lookup = torch.randint(0, CLASSES, (N_PAIRS,), generator=g)
    acts = Activations(data={"resid_post": X[:, None, None]}, layers=[0], positions=["final"], prompts=prompts)
    return dict(acts=acts, label=lookup.repeat(COPIES), prompts=prompts)


def test_repeated_pairs_are_grouped_by_default_and_the_leak_scores_at_chance(leaky):
    default = probes.probe_layers(leaky["acts"], leaky["label"], progress=False)
    ungrouped = probes.probe_layers(leaky["acts"], leaky["label"], groups=None, progress=False)
    assert ungrouped.mean[0, 0] > 0.9  # the leak: copies of a pair on both sides of a fold
    low, high = default.ci
    assert float(default.mean[0, 0]) < default.chance + 0.15 and low[0, 0] <= default.chance
    assert "pair" in default.fold_scheme and default.meta["folds"]["n_groups"] == N_PAIRS
    assert ungrouped.meta["folds"]["groups"] is None and "pair" not in ungrouped.fold_scheme
    # no test fold shares a pair with its training folds
    assert default.meta["folds"]["largest_group"] == COPIES


def test_distinct_pairs_keep_plain_folds(tiny_model):
    prompts = prompts_for_pairs(tiny_model, "+", list(range(60)), [3] * 60, "{a}+{b}=")
    X = torch.randn(60, 1, 1, 8, generator=torch.Generator().manual_seed(1))
    acts = Activations(data={"resid_post": X}, layers=[0], positions=["final"], prompts=prompts)
    result = probes.probe_layers(acts, "a_units", progress=False)
    assert result.meta["folds"]["groups"] is None and "no pair repeats" in result.fold_scheme


@pytest.mark.slow
def test_groups_by_a_named_label_or_an_array(leaky):
    by_a = probes.probe_layers(leaky["acts"], leaky["label"], groups="a", progress=False)
    a_values = leaky["prompts"].a
    assert by_a.meta["folds"]["groups"] == "a" and by_a.meta["folds"]["n_groups"] == len(a_values.unique())
    prompts = leaky["prompts"]
    pair_ids = np.unique((prompts.a * 1000 + prompts.b).numpy(), return_inverse=True)[1]  # (a, b) in sorted order
    by_array = probes.probe_layers(leaky["acts"], leaky["label"], groups=pair_ids, progress=False)
    by_pair = probes.probe_layers(leaky["acts"], leaky["label"], groups="pair", progress=False)
    assert by_array.meta["folds"]["groups"] == "custom"
    assert torch.equal(by_array.fold_scores, by_pair.fold_scores)  # the same groups, the same folds


def test_bad_groups_are_rejected(leaky):
    with pytest.raises(ConfigError, match="unknown label 'nope'"):
        probes.probe_layers(leaky["acts"], leaky["label"], groups="nope", progress=False)
    with pytest.raises(AnalysisError, match="one group per prompt"):
        probes.probe_layers(leaky["acts"], leaky["label"], groups=[0, 1, 2], progress=False)
    with pytest.raises(AnalysisError, match="3 groups"):
        probes.probe_layers(leaky["acts"], leaky["label"], groups=np.arange(N_PAIRS * COPIES) % 3, progress=False)
    bare = Activations(data=leaky["acts"].data, layers=[0], positions=["final"])
    with pytest.raises(AnalysisError, match="prompts"):
        probes.probe_layers(bare, leaky["label"], groups="pair", progress=False)


@pytest.mark.slow
def test_sweep_takes_an_estimator_and_clones_it(leaky):
    from sklearn.linear_model import LogisticRegression

    from arithinterp.probes import LogisticProbe

    estimator = LogisticRegression(C=0.5, max_iter=500)
    result = probes.probe_layers(leaky["acts"], leaky["label"], estimator=estimator, groups=None, progress=False)
    assert not hasattr(estimator, "coef_")  # cloned, never fitted in place
    assert result.kind == "LogisticRegression" and result.metric == "accuracy"
    assert result.mean[0, 0] > 0.9 and result.directions.shape == (1, 1, CLASSES, D)
    assert result.meta["probe"]["C"] == 0.5
    ours = probes.probe_layers(leaky["acts"], leaky["label"], estimator=LogisticProbe(C=0.5), groups=None, progress=False)
    shortcut = probes.probe_layers(leaky["acts"], leaky["label"], kind="logistic", C=0.5, groups=None, progress=False)
    assert torch.allclose(ours.fold_scores, shortcut.fold_scores)
    with pytest.raises(ConfigError, match="estimator"):
        probes.probe_layers(leaky["acts"], leaky["label"], estimator=LogisticProbe(), C=2.0, progress=False)
    with pytest.raises(ConfigError, match="fit"):
        probes.probe_layers(leaky["acts"], leaky["label"], estimator="logistic", progress=False)


def test_a_binary_sklearn_classifier_keeps_one_direction_towards_its_second_class(leaky):
    from sklearn.linear_model import LogisticRegression

    binary = (leaky["label"] >= 2).long()
    result = probes.probe_layers(leaky["acts"], binary, estimator=LogisticRegression(max_iter=500), groups=None, progress=False)
    assert result.directions.shape == (1, 1, 1, D) and result.classes == [1]
