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
