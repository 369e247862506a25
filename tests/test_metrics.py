import pytest
import torch

from arithinterp import metrics
from arithinterp.errors import AnalysisError


def test_logit_diff_prob_logprob():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 1.0]])
    good, bad = torch.tensor([0, 1]), torch.tensor([2, 0])
    assert metrics.logit_diff(logits, good, bad).tolist() == [3.0, 3.0]
    p = metrics.prob(logits, good)
    assert torch.allclose(p, logits.softmax(-1)[[0, 1], [0, 1]])
    assert torch.allclose(metrics.logprob(logits, good), p.log())


def test_stolfo_ie_known_values():
    # patching moves all the mass from the clean answer r to the counterfactual r'
    ie = metrics.stolfo_ie(torch.tensor([0.8]), torch.tensor([0.2]), torch.tensor([0.1]), torch.tensor([0.7]))
    assert ie.item() == pytest.approx(0.5 * ((0.7 - 0.1) / 0.1 + (0.8 - 0.2) / 0.2))
    # no change -> no effect
    same = metrics.stolfo_ie(torch.tensor([0.5]), torch.tensor([0.5]), torch.tensor([0.3]), torch.tensor([0.3]))
    assert same.item() == 0.0


def test_metrics_validate_shapes():
    with pytest.raises(AnalysisError, match=r"\[batch, d_vocab\]"):
        metrics.logit_diff(torch.zeros(3), torch.zeros(3), torch.zeros(3))
    with pytest.raises(AnalysisError, match="token ids"):
        metrics.prob(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(AnalysisError, match="empty"):
        metrics.accuracy(torch.tensor([]), torch.tensor([]))
    assert metrics.accuracy(torch.tensor([1, 2, 3]), torch.tensor([1, 0, 3])) == pytest.approx(2 / 3)


def test_metrics_score_stacked_runs_and_are_what_patching_scores_with():
    # [runs, batch, vocab]: the patching and circuit analyses score many stacked runs at once
    from arithinterp.metrics import MetricContext, metric_fn

    logits = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(0))
    good, bad = torch.tensor([0, 1, 2, 3]), torch.tensor([6, 5, 4, 3])
    stacked = metrics.logit_diff(logits, good, bad)
    assert stacked.shape == (3, 4)
    assert torch.equal(stacked[1], metrics.logit_diff(logits[1], good, bad))
    ctx = MetricContext(good, bad, bad, good, pairs=None)
    assert torch.equal(metric_fn("logit_diff")(logits, ctx), stacked)
    assert torch.equal(metric_fn("prob")(logits, ctx), metrics.prob(logits, good))
    assert torch.equal(metric_fn("logprob")(logits, ctx), metrics.logprob(logits, good))
    expected = logits.softmax(-1).gather(-1, good.expand(3, 4)[..., None])[..., 0]
    assert torch.allclose(metrics.prob(logits, good), expected)
    with pytest.raises(AnalysisError, match=r"token ids must be \[batch\]=4"):
        metrics.logit(logits, torch.tensor([0, 1]))
