"""Resumed interchange runs (``engine.interchange``) give what whole forwards give.

On a random-weight Gemma 3 folder (QK-norm, post-norms, sliding and global layers, a final norm)
with few-shot prompts, at every vector site, at the first, a middle and the last layer: the
logits of the teacher-forced answer positions with an interchange applied, the activations read
on the way, and the gradient of a loss in the interchange's own parameters.
"""

from __future__ import annotations

import pytest
import torch
from hf_families import save_family

import arithinterp as ai
from arithinterp import engine
from arithinterp.engine.interchange import SITES, resumed_runs
from arithinterp.errors import AnalysisError, SiteError

K = 2  # answer tokens: the sums 20..78 are two digits


@pytest.fixture(scope="module")
def gemma3(digit_tokenizer, tmp_path_factory):
    model = ai.load_model(str(save_family("gemma3", digit_tokenizer, tmp_path_factory.mktemp("gemma3"), n_layers=4)))
    prompts = ai.tasks.arithmetic(model, op="+", a=range(10, 40), b=range(10, 40), template="{a}+{b}=", few_shot=2)
    prompts = prompts[torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))[:12].tolist()]
    # base prompts fed with a teacher-forced two-digit answer; a prompt twice, with another answer
    tokens = torch.cat([prompts.tokens, prompts.answer_tokens[:, :1]], dim=1)
    tokens = torch.cat([tokens, tokens[:1]])
    tokens[-1, -1] = tokens[0, -1] + 1
    return model, tokens


def _swap(weight: torch.Tensor):
    def swap(base, source):  # the first two coordinates of the source, through a parameter
        out = base.clone()
        out[..., :2] = source[..., :2] * weight
        return out
    return swap


def _intervention(model, site, layer, positions, source, weight):
    units = [1] if site == "attn_z" else None
    return engine.Write(site, layer, positions=positions, units=units, value=_swap(weight),
                               source=source.unsqueeze(-2) if site == "attn_z" else source)


@pytest.mark.slow
@pytest.mark.parametrize("site", SITES)
def test_resumed_interchanges_equal_whole_forwards(gemma3, site):
    model, tokens = gemma3
    N, T = tokens.shape
    final = T - K  # the prompt's last token ("="), where the first answer token is predicted
    for layer in (0, 2, 3):
        runs = resumed_runs(model, tokens, site, layer, final, K, read_positions=torch.full((N,), final),
                            batch_size=5)
        assert runs is not None, f"{site} L{layer}: the model's blocks step exactly, so the runs resume"
        read = engine.run(model, tokens, reads=[engine.Read(site, layer, positions=final)], logits="none").reads[0]
        kept = runs.base_reads(torch.arange(N))
        assert kept.shape == read.shape and torch.allclose(kept, read, atol=1e-5)
        read = read[:, 1] if site == "attn_z" else read  # head 1's output
        rows = torch.tensor([0, 3, 5, 12, 0])  # a prompt twice, and the one with another answer
        source = read[torch.tensor([7, 1, 2, 4, 9])]
        positions = torch.full((len(rows),), final)
        weight = torch.tensor(1.5, requires_grad=True)
        iv = _intervention(model, site, layer, positions, source, weight)
        full = engine.run(model, tokens[rows], [iv], logits="all", train=True).logits
        assert full is not None
        full = full[:, -K:]
        with torch.enable_grad():
            got = runs.logits(rows, [iv])
        assert got.shape == full.shape
        scale = float(full.detach().abs().max())
        assert float((got - full).detach().abs().max()) <= 1e-5 * scale, f"{site} L{layer}"
        assert torch.equal(got.argmax(-1), full.argmax(-1))
        # the interchange moved the logits, and the loss's gradient in its parameter is the same
        unpatched = runs.logits(rows)
        assert float((unpatched - got).detach().abs().max()) > 1e-4 * scale
        targets = full.argmax(-1).flip(0)
        (g_full,) = torch.autograd.grad(torch.nn.functional.cross_entropy(full.flatten(0, 1), targets.flatten()),
                                        [weight])
        (g_got,) = torch.autograd.grad(torch.nn.functional.cross_entropy(got.flatten(0, 1), targets.flatten()),
                                       [weight])
        assert float(g_full.abs()) > 0 and torch.allclose(g_got, g_full, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())


def test_resumed_runs_check_their_input(gemma3):
    model, tokens = gemma3
    T = tokens.shape[1]
    with pytest.raises(AnalysisError, match="start must be an int"):
        resumed_runs(model, tokens, "resid_post", 1, T - 1, K)  # the first scored position is T - 2
    with pytest.raises(SiteError, match="not one"):
        resumed_runs(model, tokens, "pattern", 1, 0, K)
    with pytest.raises(AnalysisError, match="read positions must lie at start"):
        resumed_runs(model, tokens, "resid_post", 1, T - K, K, read_positions=torch.zeros(len(tokens), dtype=torch.int))
    assert resumed_runs(model, tokens, "resid_post", 1, T - K, K, engine="hooks") is None  # whole forwards asked for
    runs = resumed_runs(model, tokens, "resid_post", 1, T - K, K)
    assert runs is not None
    early = engine.Write("resid_post", 1, positions=torch.zeros(2, dtype=torch.long), value=0.0)
    with pytest.raises(AnalysisError, match="before the runs' start"):
        runs.logits(torch.tensor([0, 1]), [early])
    elsewhere = engine.Write("resid_post", 2, positions=torch.full((2,), T - K), value=0.0)
    with pytest.raises(AnalysisError, match="needs runs of its own"):
        runs.logits(torch.tensor([0, 1]), [elsewhere])
