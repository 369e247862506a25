"""The logit lens: each layer's residual stream read through the model's own end."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import arithinterp as ai
from arithinterp.errors import SiteError
from arithinterp.lens import LogitLensResult, logit_lens
from arithinterp.tasks import arithmetic, prompts_for_pairs


def test_each_layer_is_unembedded_as_the_model_ends_and_the_last_layer_is_its_output(tiny_model):
    prompts = arithmetic(tiny_model, "+", range(10, 14), range(20, 23), "{a}+{b}=")
    result = logit_lens(tiny_model, prompts, positions=["b", "final"], progress=False)
    assert result.probability.shape == result.rank.shape == (12, 2, 2) and result.layers == [0, 1]
    _, cache = tiny_model.run_with_cache(prompts.tokens)
    answer = prompts.answer_tokens[:, 0]
    rows = torch.arange(len(prompts))
    for li, layer in enumerate(result.layers):
        for pi, name in enumerate(result.positions):
            resid = cache[f"blocks.{layer}.hook_resid_post"][rows, prompts.positions[name]]
            logits = tiny_model.unembed(tiny_model.ln_final(resid[:, None]))[:, 0]
            expected = logits.softmax(-1)[rows, answer]
            assert torch.allclose(result.probability[:, li, pi], expected, atol=1e-5), (layer, name)
            ranks = (logits > logits[rows, answer][:, None]).sum(-1).float()
            assert torch.equal(result.rank[:, li, pi], ranks)
    own = tiny_model(prompts.tokens)[:, -1].softmax(-1)[rows, answer]
    assert torch.allclose(result.probability[:, -1, -1], own, atol=1e-5)  # the last layer: the model's output


def test_the_answer_is_read_where_the_model_has_it_and_not_when_the_answers_are_shuffled():
    """On the trained zoo model the answer is the lens's top token at the last layer's final position;
    scored against shuffled answers (a control), it almost never is."""
    model = ai.load_model("zoo:add-100")
    prompts = arithmetic(model, "+", range(0, 100, 7), range(0, 100, 9), "{a}+{b}=")
    found = logit_lens(model, prompts, progress=False)
    assert found.headline()["last_layer_top1"] > 0.95 and found.headline()["top1_from_layer"] == 1
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))
    shuffled = dataclasses.replace(prompts, answer_tokens=prompts.answer_tokens[order])
    keep = prompts.answer_tokens[order, 0] != prompts.answer_tokens[:, 0]
    control = logit_lens(model, shuffled, progress=False)
    assert float((control.rank[keep, -1, 0] == 0).float().mean()) < 0.05
    frame = found.to_frame()
    assert list(frame.columns) == ["layer", "position", "token", "mean_probability", "median_rank", "top1",
                                   "n_prompts"]
    assert frame["top1"].iloc[-1] == pytest.approx(found.headline()["last_layer_top1"])


def test_at_and_after_the_final_token_the_next_answer_token_is_scored(tiny_digit_model):
    prompts = prompts_for_pairs(tiny_digit_model, "+", [123, 4], [7, 8], "{a}+{b}=")  # answers 130 and 12
    result = logit_lens(tiny_digit_model, prompts, positions=["b", "final", "answer[0]", "answer[1]"], progress=False)
    answers = prompts.answer_tokens
    assert torch.equal(result.answer_tokens[0], torch.stack([answers[0, 0], answers[0, 0], answers[0, 1],
                                                             answers[0, 2]]))
    assert result.answer_tokens[1, 3] == -1  # "12" has no third token to predict after its second
    assert result.probability[1, :, 3].isnan().all() and result.to_frame()["n_prompts"].tolist()[-1] == 1
    assert result.tokens == ["7", "=", "1", "3"]


def test_bad_layers_and_positions_are_refused_and_all_positions_are_drawn(tiny_model):
    prompts = arithmetic(tiny_model, "+", range(3), range(3))
    with pytest.raises(SiteError, match="out of range"):
        logit_lens(tiny_model, prompts, layers=[5], progress=False)
    with pytest.raises(SiteError, match="unknown position"):
        logit_lens(tiny_model, prompts, positions="c", progress=False)
    with pytest.raises(SiteError, match="empty"):
        logit_lens(tiny_model, prompts[[]], progress=False)
    result = logit_lens(tiny_model, prompts, positions="all", progress=False)
    figure = result.plot()
    assert isinstance(result, LogitLensResult) and figure.data[0].type == "heatmap" and len(figure.data[0].y) == 2
    assert figure.data[0].x[-1] == f"{prompts.tokens.shape[1] - 1}: ="
