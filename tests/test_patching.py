"""Activation patching: identical numbers to TransformerLens, known results, planted signals, errors."""

from __future__ import annotations


import plotly.graph_objects as go
import pytest
import torch
from conftest import tiny_bridge

from arithinterp import patching
from arithinterp.errors import ArithInterpError, ConfigError, SiteError
from arithinterp.tasks import arithmetic

TL_FUNCTIONS = {
    "resid_pre": "get_act_patch_resid_pre",
    "attn_z": "get_act_patch_attn_head_out_by_pos",
    "mlp_out": "get_act_patch_mlp_out",
}


def _logit_diff(pairs):
    clean, corrupt = pairs.clean_answer_token, pairs.corrupt_answer_token

    def metric(logits):
        final = logits[:, -1]
        return final.gather(-1, clean[:, None])[:, 0] - final.gather(-1, corrupt[:, None])[:, 0]

    return metric


def _tl_values(model, pairs, site):
    from transformer_lens import patching as tl_patching

    _, cache = model.run_with_cache(pairs.clean.tokens)
    values = getattr(tl_patching, TL_FUNCTIONS[site])(model, pairs.corrupt.tokens, cache, _logit_diff(pairs), reduce="none").values
    return values.permute(-1, *range(values.ndim - 1))  # pairs first, like PatchResult.values


@pytest.fixture(scope="module")
def pairs(tiny_model):
    return arithmetic(tiny_model, a=range(10), b=range(10)).counterfactual(vary="a", seed=0)[:12]


@pytest.fixture(scope="module")
def few_shot(number_tokenizer):
    """A 3-layer model with a few-shot prefix: patches start mid-prompt and reuse earlier keys."""
    model = tiny_bridge(number_tokenizer, n_layers=3, n_ctx=32, seed=1)
    prompts = arithmetic(model, a=range(10), b=range(10), few_shot=2)
    return model, prompts.counterfactual(vary="b", seed=0)[:3]


@pytest.fixture(scope="module")
def few_shot_rotary(number_tokenizer):
    """A Llama-shaped TransformerLens-native model: rotary positions, grouped-query attention, gated
    MLP, RMSNorm and attention soft-capping, which the engine steps with its native key/value cache."""
    model = tiny_bridge(
        number_tokenizer, n_layers=3, n_ctx=32, seed=1, norm="RMS", n_key_value_heads=2, gated_mlp=True,
        act_fn="silu", positional_embedding_type="rotary", attn_scores_soft_cap=30.0,
    )
    prompts = arithmetic(model, a=range(10), b=range(10), few_shot=2)
    return model, prompts.counterfactual(vary="b", seed=0)[:3]


@pytest.fixture(scope="module")
def zoo():
    import arithinterp as ai
    from arithinterp.errors import ModelFileError

    try:
        model = ai.load_model("zoo:add-100")
    except ModelFileError:
        pytest.skip("zoo:add-100 is not shipped in this checkout")
    prompts = arithmetic(model, a=range(0, 100, 3), b=range(0, 100, 3))
    return model, prompts.correct_only(model).counterfactual(vary="a", seed=0)[:40]


# --- identical numbers to TransformerLens ------------------------------------------------------------


@pytest.mark.parametrize("engine", ["stepped", "hooks"])
@pytest.mark.parametrize("site", sorted(TL_FUNCTIONS))
def test_sweep_matches_transformer_lens(tiny_model, pairs, site, engine):
    ours = patching.activation_patching(tiny_model, pairs, site, engine=engine, progress=False)
    reference = _tl_values(tiny_model, pairs, site)
    assert ours.values.shape == reference.shape
    assert (ours.values - reference).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("site", sorted(TL_FUNCTIONS))
def test_sweep_matches_transformer_lens_on_zoo(zoo, site):
    model, zoo_pairs = zoo
    ours = patching.activation_patching(model, zoo_pairs, site, progress=False)
    assert ours.meta["engine"][0].startswith("stepped")
    assert (ours.values - _tl_values(model, zoo_pairs, site)).abs().max() <= 1e-4


@pytest.mark.parametrize("model_name", ["few_shot", "few_shot_rotary"])
@pytest.mark.parametrize("site", patching.PATCHING_SITES)
def test_stepped_blocks_equal_whole_forwards_for_every_site(request, model_name, site):
    """The fast path (start at the patched layer and position, reuse keys, only the read positions
    through the last block) changes no number."""
    model, fs_pairs = request.getfixturevalue(model_name)
    units = dict(neurons=[7, 100]) if site in ("mlp_pre", "mlp_post") else {}
    for kwargs in (dict(layers=[0, 2]), dict(per_position=False), dict(positions=["a", "final", 4], layers=[1])):
        kwargs = {**kwargs, **units}
        fast = patching.activation_patching(model, fs_pairs, site, engine="stepped", batch_cells=3, progress=False, **kwargs)
        slow = patching.activation_patching(model, fs_pairs, site, engine="hooks", progress=False, **kwargs)
        assert "keys/values reused" in fast.meta["engine"][0], fast.meta["engine"]
        assert fast.values.shape == slow.values.shape
        assert (fast.values - slow.values).abs().max() <= 1e-4, kwargs


def test_cells_before_the_changed_token_are_no_ops(few_shot):
    """Positions before the varied operand carry identical activations: patching them does nothing."""
    model, fs_pairs = few_shot
    result = patching.activation_patching(model, fs_pairs, "resid_pre", positions=list(range(5)), progress=False)
    assert torch.equal(result.values, result.corrupt_baseline[:, None, None].expand_as(result.values))
    assert result.meta["cells_run"] == 0


def test_a_residual_patch_that_makes_the_source_run_is_not_run(few_shot):
    """At layer 0 the prompts differ at the varied operand alone: patching it there gives the clean run."""
    model, fs_pairs = few_shot
    result = patching.activation_patching(model, fs_pairs, "resid_pre", layers=[0], positions=["b"], progress=False)
    assert result.meta["cells_run"] == 0
    assert torch.equal(result.values[:, 0, 0], result.clean_baseline)


# --- known results ---------------------------------------------------------------------------------


def _known_results(model, pairs):
    """Both cells on both engines: stepping recognises both as the source run; whole forwards run
    the first and recognise the second from the tokens alone (the last block's read position)."""
    last = model.cfg.n_layers - 1
    values = []
    for engine in ("stepped", "hooks"):
        operand = patching.activation_patching(model, pairs, "resid_pre", layers=[0], positions=["a"], normalize=True, engine=engine, progress=False)
        final = patching.activation_patching(model, pairs, "resid_post", layers=[last], positions=["final"], normalize=True, engine=engine, progress=False)
        values += [operand.mean.item(), final.mean.item()]
    assert operand.meta["cells_run"] == 1 and final.meta["cells_run"] == 0  # on whole forwards
    return values


def test_known_results_on_a_random_model(tiny_model, pairs):
    for value in _known_results(tiny_model, pairs):
        assert value == pytest.approx(1.0, abs=1e-4)


def test_known_results_on_zoo(zoo):
    model, zoo_pairs = zoo
    for value in _known_results(model, zoo_pairs):
        assert value == pytest.approx(1.0, abs=1e-4)
    # elsewhere at layer 0 nothing differs between the prompts, so nothing is restored
    layer0 = patching.activation_patching(model, zoo_pairs, "resid_pre", layers=[0], normalize=True, progress=False)
    others = [i for i, p in enumerate(layer0.positions) if int(p) != int(zoo_pairs.clean.positions["a"][0])]
    assert layer0.mean[0, others].abs().max() <= 1e-4


def test_noise_direction_reaches_the_corrupt_run(tiny_model, pairs):
    last = tiny_model.cfg.n_layers - 1
    result = patching.activation_patching(tiny_model, pairs, "resid_post", layers=[last], positions=["final"], direction="noise", normalize=True, progress=False)
    assert result.mean.item() == pytest.approx(0.0, abs=1e-4)


# --- metrics and statistics ------------------------------------------------------------------------


def test_metric_choices_agree_with_their_definitions(tiny_model, pairs):
    last = tiny_model.cfg.n_layers - 1
    kwargs = dict(layers=[last], positions=["final"], progress=False)
    custom = patching.activation_patching(tiny_model, pairs, "resid_post", metric=lambda logits, batch: logits[:, 5] - logits[:, 7], **kwargs)
    with torch.inference_mode():
        clean_logits = tiny_model(pairs.clean.tokens)[:, -1]
    assert torch.allclose(custom.values.flatten(), clean_logits[:, 5] - clean_logits[:, 7], atol=1e-4)
    prob = patching.activation_patching(tiny_model, pairs, "resid_post", metric="prob", **kwargs)
    expected = clean_logits.softmax(-1).gather(-1, pairs.clean_answer_token[:, None])[:, 0]
    assert torch.allclose(prob.values.flatten(), expected, atol=1e-5)
    ie = patching.activation_patching(tiny_model, pairs, "resid_post", metric="ie", **kwargs)
    with torch.inference_mode():
        corrupt_probs = tiny_model(pairs.corrupt.tokens)[:, -1].softmax(-1)
    clean_probs = clean_logits.softmax(-1)
    r, r_prime = pairs.corrupt_answer_token[:, None], pairs.clean_answer_token[:, None]
    expected_ie = 0.5 * (
        (clean_probs.gather(-1, r_prime) - corrupt_probs.gather(-1, r_prime)) / corrupt_probs.gather(-1, r_prime)
        + (corrupt_probs.gather(-1, r) - clean_probs.gather(-1, r)) / clean_probs.gather(-1, r)
    )[:, 0]
    assert torch.allclose(ie.values.flatten(), expected_ie, rtol=1e-3, atol=1e-4)
    assert ie.corrupt_baseline.abs().max() <= 1e-6  # the unpatched base run has no indirect effect


def test_summary_statistics():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(400, 3, generator=generator) + torch.tensor([0.0, 1.0, -2.0])
    mean, sem, low, high = patching.summarize(values, seed=0)
    assert torch.allclose(mean, values.mean(0))
    assert torch.allclose(sem, values.std(0) / 20, rtol=1e-4)
    assert (low < mean).all() and (mean < high).all()
    # a 95% interval is about ±1.96 standard errors wide
    assert torch.allclose((high - low) / (2 * sem), torch.full((3,), 1.96), atol=0.25)
    assert all(torch.equal(a, b) for a, b in zip(patching.summarize(values, seed=0), (mean, sem, low, high)))


# --- attribution -----------------------------------------------------------------------------------


def test_attribution_is_exact_where_the_metric_is_linear(number_tokenizer):
    """Without a final norm the logit difference is linear in the last residual stream."""
    model = tiny_bridge(number_tokenizer, norm=None)
    linear_pairs = arithmetic(model, a=range(10), b=range(10)).counterfactual(vary="a", seed=0)[:16]
    last = model.cfg.n_layers - 1
    kwargs = dict(layers=[last], positions=["final"], progress=False)
    approx = patching.attribute(model, linear_pairs, "resid_post", **kwargs)
    exact = patching.activation_patching(model, linear_pairs, "resid_post", **kwargs)
    assert (approx.values - exact.values).abs().max() <= 1e-4


def test_attribution_tracks_exact_patching(tiny_model, pairs):
    comparison = patching.attribution_vs_exact(tiny_model, pairs, ["resid_pre", "attn_z", "mlp_post"], neurons=[1, 2, 3], progress=False)
    assert comparison.sites == ["resid_pre", "attn_z", "mlp_post"]
    # a random model is far from linear, but per pair and cell the first-order estimate holds up
    assert min(comparison.pair_correlation) > 0.9
    # control: the same estimates against shuffled exact values correlate far less
    exact = torch.tensor(comparison.exact[1])
    shuffled = exact[torch.randperm(len(exact), generator=torch.Generator().manual_seed(0))]
    assert abs(patching.attribution._pearson(shuffled, torch.tensor(comparison.approx[1]))) < comparison.correlation[1] - 0.3
    assert comparison.plot().data and len(comparison.to_frame()) == sum(len(c) for c in comparison.cells)


def test_compare_leaves_the_results_it_compares_unchanged(tiny_model, pairs):
    exact = patching.activation_patching(tiny_model, pairs, "resid_pre", progress=False)
    approx = patching.attribute(tiny_model, pairs, "resid_pre", progress=False)
    before = (dict(exact.meta), dict(approx.meta))
    comparison = patching.compare(exact, approx)
    assert (exact.meta, approx.meta) == before
    assert comparison.correlation[0] == pytest.approx(patching.attribution._pearson(exact.mean, approx.mean))


def test_integrated_gradients_completeness(tiny_model, pairs):
    """IG over the input interpolation sums to the full swap of the first residual stream."""
    kwargs = dict(layers=[0], per_position=False, progress=False)
    ig = patching.attribute(tiny_model, pairs[:6], "resid_pre", method="integrated-gradients", ig_steps=20, **kwargs)
    exact = patching.activation_patching(tiny_model, pairs[:6], "resid_pre", **kwargs)
    assert (ig.values - exact.values).abs().max() <= 0.03 * exact.values.abs().max()


def test_attribution_on_a_frozen_model_at_every_layer(number_tokenizer, tiny_model, pairs):
    """Users load models with requires_grad=False: gradients are taken at the engine's reads, at every
    layer including 0 (integrated gradients at resid_pre 0 too), and no flag is changed."""
    frozen = tiny_bridge(number_tokenizer)  # the same seed: the same weights as tiny_model
    frozen.requires_grad_(False)
    flags = [p.requires_grad for p in tiny_model.parameters()]
    sites = ["resid_pre", "resid_mid", "attn_z", "mlp_post"]
    for method in ("attribution", "integrated-gradients"):
        kwargs = dict(method=method, ig_steps=4, neurons=[1, 2, 3], progress=False)
        got, reference = (patching.attribute_sites(frozen, pairs, sites, **kwargs),
                          patching.attribute_sites(tiny_model, pairs, sites, **kwargs))
        for site in sites:
            assert got[site].layers == [0, 1]
            assert torch.allclose(got[site].values, reference[site].values, atol=1e-5), (method, site)
        # layer 0 gets a real gradient: the estimates there move away from the base run's metric
        estimate = got["resid_pre"].values[:, 0] - got["resid_pre"].corrupt_baseline[:, None]
        assert estimate.abs().max() > 1e-2
    assert not any(p.requires_grad for p in frozen.parameters())
    assert [p.requires_grad for p in tiny_model.parameters()] == flags
    assert all(p.grad is None for p in (*frozen.parameters(), *tiny_model.parameters()))
    # completeness of integrated gradients over the first residual stream holds on the frozen model
    kwargs = dict(layers=[0], per_position=False, progress=False)
    ig = patching.attribute(frozen, pairs[:6], "resid_pre", method="integrated-gradients", ig_steps=20, **kwargs)
    exact = patching.activation_patching(frozen, pairs[:6], "resid_pre", **kwargs)
    assert (ig.values - exact.values).abs().max() <= 0.03 * exact.values.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gradients_and_direct_effects_on_rotary_families(family, number_tokenizer, tmp_path):
    """A frozen Llama (rotary, grouped-query, gated MLP) or Gemma 2 (scaled embedding, soft-capped
    logits) folder: integrated gradients at resid_pre 0 are complete, and the last MLP's direct
    effect is its total effect (the final norm and soft-cap are the model's own)."""
    import arithinterp as ai
    from hf_families import save_family

    model = ai.load_model(str(save_family(family, number_tokenizer, tmp_path / family)))
    model.requires_grad_(False)
    family_pairs = arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4), few_shot=1).counterfactual(vary="a", seed=0)[:6]
    kwargs = dict(layers=[0], per_position=False, progress=False)
    ig = patching.attribute(model, family_pairs, "resid_pre", method="integrated-gradients", ig_steps=16, **kwargs)
    exact = patching.activation_patching(model, family_pairs, "resid_pre", **kwargs)
    assert (ig.values - exact.values).abs().max() <= 0.03 * exact.values.abs().max()
    effects = patching.direct_effect(model, family_pairs, ["embed", "attn0", "mlp1"], progress=False)
    assert torch.allclose(effects.direct[:, 2], effects.total[:, 2], atol=1e-4)
    assert effects.direct[:, 2].abs().max() > 1e-2


# --- direct effect, ablation, faithfulness ---------------------------------------------------------


def test_direct_effects_plus_remainder_reproduce_the_total(tiny_model, pairs):
    effects = patching.direct_effect(tiny_model, pairs, progress=False)
    with torch.inference_mode():
        clean, corrupt = (tiny_model(t)[:, -1] for t in (pairs.clean.tokens, pairs.corrupt.tokens))
    metric = lambda logits: _logit_diff(pairs)(logits[:, None])  # noqa: E731
    assert torch.allclose(effects.total_change, metric(corrupt) - metric(clean), atol=1e-4)
    assert torch.allclose(effects.direct.sum(1) + effects.remainder, effects.total_change, atol=1e-5)
    # the last MLP has no downstream component: its direct and total effects coincide
    last_mlp = effects.components.index(f"mlp{tiny_model.cfg.n_layers - 1}")
    assert torch.allclose(effects.direct[:, last_mlp], effects.total[:, last_mlp], atol=1e-4)
    assert len(effects.to_frame()) == len(effects.components) and effects.plot().data


def test_direct_effects_are_the_whole_story_without_a_final_norm(number_tokenizer):
    model = tiny_bridge(number_tokenizer, norm=None)
    linear_pairs = arithmetic(model, a=range(10), b=range(10)).counterfactual(vary="a", seed=0)[:16]
    effects = patching.direct_effect(model, linear_pairs, progress=False)
    assert effects.remainder.abs().max() <= 1e-4


def test_mean_ablation_of_an_activation_shared_by_all_prompts_changes_nothing(tiny_model):
    prompts = arithmetic(tiny_model, a=range(10), b=range(10))
    result = patching.ablate(tiny_model, prompts, ["mlp0@0", "L1H2@0", "attn0@0"], ablation="mean")  # position 0 is BOS
    assert torch.allclose(result.logprob_after, result.logprob_before, atol=1e-5)
    changed = patching.ablate(tiny_model, prompts, ["mlp0", "attn1"], ablation="zero")
    assert (changed.logprob_after - changed.logprob_before).abs().max() > 1e-3
    again = patching.ablate(tiny_model, prompts, ["mlp0", "L1N3"], ablation="resample", seed=3)
    assert torch.equal(again.logprob_after, patching.ablate(tiny_model, prompts, ["mlp0", "L1N3"], ablation="resample", seed=3).logprob_after)
    assert len(result.to_frame()) == 2 and result.plot().data


def test_the_ablation_is_one_keyword_and_one_result_field(tiny_model):
    prompts = arithmetic(tiny_model, a=range(10), b=range(10))
    result = patching.ablate(tiny_model, prompts, ["mlp0", "attn1"], ablation="zero")
    assert result.ablation == "zero" and "zero-ablated" in result.to_frame()["run"].tolist()
    with pytest.raises(ConfigError, match="mode"):
        patching.ablate(tiny_model, prompts, ["mlp0", "attn1"], mode="zero")
    faithful = patching.component_faithfulness(tiny_model, prompts, ["mlp0", "attn1"], ablation="zero")
    assert faithful.ablation == "zero"
    with pytest.raises(ConfigError, match="accepted: 'zero', 'mean', 'resample'"):
        patching.ablate(tiny_model, prompts, ["mlp0"], ablation="half")


def test_mean_ablation_is_the_engines_mean_over_every_prompt(tiny_digit_model):
    """Prompts of two lengths: the mean is taken per position counted from the prompt's end, over every
    prompt that has that position (engine.mean_activation), not per length group."""
    from arithinterp import engine

    prompts = arithmetic(tiny_digit_model, a=range(5, 15), b=range(3))  # one- and two-digit a
    groups = prompts.length_groups()
    assert len(groups) == 2
    result = patching.ablate(tiny_digit_model, prompts, ["mlp0"], ablation="mean")
    N, T = prompts.tokens.shape
    acts = torch.zeros(N, T, tiny_digit_model.cfg.d_model)
    for group in groups:
        tokens = prompts.unpadded(group)
        acts[group, T - tokens.shape[1] :] = engine.run(tiny_digit_model, tokens, reads=[engine.Read("mlp_out", 0)]).reads[0]

    def logprob(mean_of):
        out = torch.empty(N)
        for group in groups:
            tokens = prompts.unpadded(group)
            value = mean_of(group)[-tokens.shape[1] :]
            logits = engine.run(tiny_digit_model, tokens, [engine.Write("mlp_out", 0, value=value)]).logits
            out[group] = logits.log_softmax(-1).gather(-1, prompts.answer_tokens[group, :1])[:, 0]
        return out

    pooled = engine.mean_activation(acts, prompts.lengths)
    assert torch.allclose(result.logprob_after, logprob(lambda group: pooled), atol=1e-5)
    per_group = logprob(lambda group: acts[group].mean(0))  # the definition patching used before
    assert (result.logprob_after - per_group).abs().max() > 1e-3


def test_teacher_forced_ablation_scores_every_answer_digit(tiny_digit_model):
    """Full-answer scoring feeds the answer digits; an ablation at digit k's position leaves the
    digits before it exactly as they were (causal attention) and changes digit k."""
    prompts = arithmetic(tiny_digit_model, a=range(10, 40, 3), b=range(50, 90, 7), answer_digits=3).with_scoring("full-answer")
    result = patching.ablate(tiny_digit_model, prompts, ["attn0@answer[1]", "mlp0@answer[1]"], ablation="zero")
    assert result.token_correct_before.shape == (len(prompts), 3) and result.scoring == "full-answer"
    assert torch.allclose(result.logprob_before, prompts.answer_logprob(tiny_digit_model), atol=1e-4)
    assert torch.equal(result.token_correct_after[:, :2], result.token_correct_before[:, :2])
    assert not torch.allclose(result.logprob_after, result.logprob_before, atol=1e-3)
    assert torch.equal(result.correct_after, result.token_correct_after.all(1))
    assert list(result.to_frame().columns[-3:]) == ["token_0_accuracy", "token_1_accuracy", "token_2_accuracy"]
    first = patching.ablate(tiny_digit_model, prompts.with_scoring("first-token"), ["attn0@final"], ablation="zero")
    assert first.token_correct_before.shape == (len(prompts), 1)
    with pytest.raises(SiteError, match="full-answer"):
        patching.ablate(tiny_digit_model, prompts.with_scoring("first-token"), ["attn0@answer[1]"])
    # one position vocabulary: answer[k] is answer token k, whatever reads or ablates it
    with pytest.raises(ConfigError, match=r"the position that predicts answer token 2 is '@answer\[1\]'"):
        patching.ablate(tiny_digit_model, prompts, ["attn0@answer2"])


@pytest.mark.slow
def test_add_3digit_digits_are_computed_by_layer_0_heads():
    """The per-head staircase (Quirke & Barez): a layer-0 head carries the units digit, a layer-1 head does not."""
    import arithinterp as ai
    from arithinterp.errors import ModelFileError
    from arithinterp.models import zoo as zoo_lib

    try:
        model = ai.load_model("zoo:add-3digit")
    except ModelFileError:
        pytest.skip("zoo:add-3digit is not shipped in this checkout")
    prompts = zoo_lib.held_out_prompts(model, zoo_lib.get_entry("add-3digit"), limit=500)
    result = patching.digit_ablation(model, prompts, heads=["L0H0", "L1H2"], progress=False)
    assert result.drop[0, 3] > 0.4 and result.drop[1, 3] < 0.05  # units digit
    units = patching.ablate(model, prompts.with_scoring("full-answer"), ["L0H0@answer[2]"])
    assert result.accuracy[0, 3] == pytest.approx(units.token_correct_after[:, 3].float().mean().item())


def test_digit_ablation_shapes_and_input_checks(tiny_model, tiny_digit_model):
    prompts = arithmetic(tiny_digit_model, a=range(10, 30, 3), b=range(50, 70, 7), answer_digits=3)
    result = patching.digit_ablation(tiny_digit_model, prompts, progress=False)
    n_heads = tiny_digit_model.cfg.n_layers * tiny_digit_model.cfg.n_heads
    assert result.accuracy.shape == (n_heads, 3) and result.heads[0] == "L0H0"
    full = patching.ablate(tiny_digit_model, prompts.with_scoring("full-answer"), ["L0H0@final"])
    assert torch.allclose(result.baseline, full.token_correct_before.float().mean(0))
    assert len(result.to_frame()) == n_heads * 3 and result.plot().data
    with pytest.raises(ArithInterpError, match="single tokens"):
        patching.digit_ablation(tiny_model, arithmetic(tiny_model, a=range(5), b=range(5)), progress=False)
    with pytest.raises(ConfigError, match="@position"):
        patching.digit_ablation(tiny_digit_model, prompts, heads=["L0H1@final"], progress=False)
    with pytest.raises(SiteError, match="out of range"):
        patching.digit_ablation(tiny_digit_model, prompts, heads=["L9H0"], progress=False)


def _close_scores(fast, slow):
    """Per-prompt (correct, log-probability) scores equal: the same argmaxes, log-probabilities
    within 1e-5 of their scale."""
    assert torch.equal(fast[..., 0], slow[..., 0])
    assert ((fast[..., 1] - slow[..., 1]).abs() / slow[..., 1].abs().clamp(min=1)).max() <= 1e-5


@pytest.mark.parametrize("mode", ["mean", "zero", "resample"])
def test_stepped_digit_ablation_equals_one_forward_per_cell(tiny_digit_model, mode):
    """Each layer's heads stacked per answer position and resumed there score every prompt's
    answer tokens as one whole forward per head and position does; ablating changes them."""
    from arithinterp.patching.components import parse_components
    from arithinterp.patching.digits import digit_scores

    prompts = arithmetic(tiny_digit_model, a=range(10, 60, 3), b=range(50, 99, 7), answer_digits=3)
    parsed = parse_components(tiny_digit_model, ["L0H0", "L0H3", "L1H1", "L1H2"], ("head",))
    base_fast, fast, used = digit_scores(tiny_digit_model, prompts, parsed, mode, seed=1, engine="stepped")
    base_slow, slow, reference = digit_scores(tiny_digit_model, prompts, parsed, mode, seed=1, engine="hooks")
    assert (used, reference) == ("stepped", "hooks")
    _close_scores(base_fast, base_slow)
    _close_scores(fast, slow)
    assert (fast[..., 1] - base_fast[..., 1].T[None]).abs().amax((1, 2)).min() > 1e-3  # every head moves a digit
    result = patching.digit_ablation(tiny_digit_model, prompts, heads=["L0H0", "L1H1"], ablation=mode, seed=1,
                                     progress=False)
    assert result.meta["engine"] == "stepped" and torch.equal(result.accuracy, slow[[0, 2], ..., 0].mean(-1))


def test_stepped_digit_ablation_on_zoo_add_3digit():
    import arithinterp as ai
    from arithinterp.errors import ModelFileError
    from arithinterp.models import zoo as zoo_lib
    from arithinterp.patching.components import parse_components
    from arithinterp.patching.digits import digit_scores

    try:
        model = ai.load_model("zoo:add-3digit")
    except ModelFileError:
        pytest.skip("zoo:add-3digit is not shipped in this checkout")
    prompts = zoo_lib.held_out_prompts(model, zoo_lib.get_entry("add-3digit"), limit=60)
    parsed = parse_components(model, [f"L{l}H{h}" for l in range(2) for h in range(4)], ("head",))
    fast = digit_scores(model, prompts, parsed, "mean", 0, engine="stepped")
    slow = digit_scores(model, prompts, parsed, "mean", 0, engine="hooks")
    _close_scores(fast[0], slow[0])
    _close_scores(fast[1], slow[1])
    with pytest.raises(ConfigError, match="engine"):
        patching.digit_ablation(model, prompts, engine="fast", progress=False)


def test_faithfulness_bounds(tiny_model):
    prompts = arithmetic(tiny_model, a=range(10), b=range(10))
    everything = patching.component_faithfulness(tiny_model, prompts, patching.default_components(tiny_model)[1:])
    assert everything.faithfulness == pytest.approx(1.0, abs=1e-6)
    nothing = patching.component_faithfulness(tiny_model, prompts, [])
    assert nothing.faithfulness == pytest.approx(0.0, abs=1e-6)
    assert len(nothing.to_frame()) == 3 and nothing.plot().data


def test_zoo_needs_its_mlps(zoo):
    model, zoo_pairs = zoo
    prompts = zoo_pairs.clean
    ablated = patching.ablate(model, prompts, ["mlp0"], ablation="mean")
    assert ablated.accuracy_before == 1.0 and ablated.accuracy_after < 0.2
    assert patching.component_faithfulness(model, prompts, ["attn0", "attn1", "mlp0", "mlp1"]).faithfulness == pytest.approx(1.0, abs=1e-6)


def test_attribution_tracks_exact_patching_on_zoo(zoo):
    model, zoo_pairs = zoo
    comparison = patching.attribution_vs_exact(model, zoo_pairs, ["resid_pre", "attn_out", "attn_z"], progress=False)
    assert min(comparison.correlation) > 0.8
    assert comparison.meta["n_pairs"] == len(zoo_pairs)


# --- half precision --------------------------------------------------------------------------------


def _every_analysis(model, digit_model):
    """Each patching analysis on small inputs: {name: float32 tensor}."""
    pairs = arithmetic(model, a=range(10), b=range(10)).counterfactual(vary="a", seed=0)[:12]
    prompts = arithmetic(model, a=range(10), b=range(10))
    digits = arithmetic(digit_model, a=range(10, 30, 3), b=range(50, 70, 7), answer_digits=3)
    out = {f"sweep {site}": patching.activation_patching(model, pairs, site, neurons=[1, 2] if site == "mlp_post" else None, progress=False).values
           for site in ("resid_pre", "attn_z", "mlp_post")}
    out["sweep attn_out, whole forwards"] = patching.activation_patching(model, pairs, "attn_out", engine="hooks", progress=False).values
    attributed = patching.attribute_sites(model, pairs, ["resid_pre", "attn_z", "mlp_post"], neurons=[1, 2], progress=False)
    out.update({f"attribute {site}": attributed[site].values for site in attributed.sites})
    out["integrated gradients"] = patching.attribute(model, pairs, "resid_pre", method="integrated-gradients", ig_steps=4, progress=False).values
    out["ablate"] = patching.ablate(model, prompts, ["mlp0", "L1H2@final"]).logprob_after
    faithful = patching.component_faithfulness(model, prompts, ["mlp0", "attn1@final"])
    out["faithfulness"] = torch.tensor([faithful.metric_full, faithful.metric_circuit, faithful.metric_empty])
    out["direct effect"] = patching.direct_effect(model, pairs, progress=False).direct
    out["digit ablation"] = patching.digit_ablation(digit_model, digits, heads=["L0H0", "L1H1"], progress=False).accuracy
    out["ablate per digit"] = patching.ablate(digit_model, digits.with_scoring("full-answer"), ["L0H0@answer[0]"]).logprob_after
    return out


@pytest.fixture(scope="module")
def float32_analyses(tiny_model, tiny_digit_model):
    return _every_analysis(tiny_model, tiny_digit_model)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_every_analysis_runs_in_half_precision(number_tokenizer, digit_tokenizer, float32_analyses, dtype, tolerance):
    """Half-precision copies give the float32 numbers within the dtype's precision (metrics in float32)."""
    model, digit_model = tiny_bridge(number_tokenizer).to(dtype), tiny_bridge(digit_tokenizer).to(dtype)
    assert next(model.parameters()).dtype == dtype
    got = _every_analysis(model, digit_model)
    for name, reference in float32_analyses.items():
        assert got[name].dtype == torch.float32, name
        assert got[name].shape == reference.shape, name
        assert (got[name] - reference).abs().max() <= tolerance * reference.abs().max(), name


def test_zoo_in_bfloat16(zoo):
    import arithinterp as ai

    model, zoo_pairs = zoo
    half = ai.load_model("zoo:add-100", dtype="bfloat16")
    for site in ("resid_pre", "mlp_out"):
        exact, approx = (patching.activation_patching(m, zoo_pairs, site, normalize=True, progress=False) for m in (model, half))
        assert (approx.mean - exact.mean).abs().max() <= 0.05
        assert approx.meta["engine"][0].startswith("stepped")
    attributed = patching.attribute(half, zoo_pairs, "resid_pre", normalize=True, progress=False)
    assert (attributed.mean - patching.attribute(model, zoo_pairs, "resid_pre", normalize=True, progress=False).mean).abs().max() <= 0.05
    ablated = patching.ablate(half, zoo_pairs.clean, ["mlp0"], ablation="mean")
    assert ablated.accuracy_before == 1.0 and ablated.accuracy_after < 0.2


# --- results ---------------------------------------------------------------------------------------


def test_result_frame_plot_and_round_trip(tiny_model, pairs, tmp_path):
    result = patching.activation_patching(tiny_model, pairs, "resid_pre", progress=False)
    frame = result.to_frame()
    assert len(frame) == result.mean.numel() and {"layer", "position", "token", "mean", "ci_low"} <= set(frame.columns)
    figure = result.plot()
    assert isinstance(figure, go.Figure) and isinstance(figure.data[0], go.Heatmap)
    assert figure.data[0].x[1].endswith(pairs.clean.str_tokens(0)[1])  # token strings on the position axis
    heads = patching.activation_patching(tiny_model, pairs, "attn_z", per_position=False, progress=False)
    assert heads.axes == ["layer", "head"] and list(heads.plot().data[0].y) == ["L0", "L1"]
    by_position = patching.activation_patching(tiny_model, pairs, "attn_z", positions=["a", "final"], progress=False)
    assert len(by_position.plot().data[0].y) == tiny_model.cfg.n_layers * tiny_model.cfg.n_heads
    loaded = type(result).load(result.save(tmp_path / "patch"))
    assert torch.equal(loaded.values, result.values) and loaded.positions == result.positions and loaded.axes == result.axes


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(site="resid_pre_typo"), SiteError, "accepted sites"),
        (dict(site="resid_pre", layers=[7]), SiteError, "0..1"),
        (dict(site="resid_pre", metric="accuracy"), ConfigError, "logit_diff"),
        (dict(site="resid_pre", direction="sideways"), ConfigError, "denoise"),
        (dict(site="resid_pre", engine="gpu"), ConfigError, "stepped"),
        (dict(site="resid_pre", positions=["c"]), SiteError, "final"),
        (dict(site="resid_pre", heads=[0]), SiteError, "heads apply"),
        (dict(site="attn_z", heads=[9]), SiteError, "0..3"),
        (dict(site="embed"), SiteError, "cannot be patched"),
    ],
)
def test_bad_sweep_input_is_explained(tiny_model, pairs, kwargs, error, words):
    with pytest.raises(error, match=words):
        patching.activation_patching(tiny_model, pairs, progress=False, **kwargs)


def test_other_bad_input_is_explained(tiny_model, pairs):
    with pytest.raises(ArithInterpError, match="empty"):
        patching.activation_patching(tiny_model, pairs[[]], "resid_pre", progress=False)
    for old in ("guess", "integrated_gradients"):  # one spelling: lower case, words joined by hyphens
        with pytest.raises(ConfigError, match="'attribution', 'integrated-gradients'"):
            patching.attribute(tiny_model, pairs, "resid_pre", method=old, progress=False)
    with pytest.raises(ConfigError, match="accepted forms"):
        patching.ablate(tiny_model, pairs.clean, ["mlp"])
    with pytest.raises(SiteError, match="0..1"):
        patching.direct_effect(tiny_model, pairs, ["attn5"], progress=False)
    with pytest.raises(ConfigError, match="resample"):
        patching.ablate(tiny_model, pairs.clean, ["mlp0"], ablation="shuffle")
    same = type(pairs)(pairs.clean, pairs.clean)
    with pytest.raises(ArithInterpError, match="same mean"):  # nothing to find where nothing differs
        patching.activation_patching(tiny_model, same, "resid_pre", normalize=True, progress=False)


def test_a_model_with_nan_weights_is_refused_not_reported_as_nan(number_tokenizer, pairs):
    """Non-finite logits in the base runs raise instead of filling every cell with NaN."""
    from arithinterp.errors import AnalysisError

    model = tiny_bridge(number_tokenizer, seed=3)
    with torch.no_grad():
        next(p for name, p in model.named_parameters() if "mlp" in name and p.ndim == 2)[0, 0] = float("nan")
    for engine in ("stepped", "hooks"):
        with pytest.raises(AnalysisError, match="not finite"):
            patching.activation_patching(model, pairs, "resid_pre", engine=engine, progress=False)
    with pytest.raises(AnalysisError, match="not finite"):
        patching.attribute(model, pairs, site="resid_pre", progress=False)


def test_total_effects_are_each_components_own_patch(tiny_model, pairs):
    """direct_effect runs one sweep per site (heads per layer): each total is the component's own sweep."""
    components = ["embed", "attn0", "mlp1", "L1H0", "L1H1", "L0H1"]
    effects = patching.direct_effect(tiny_model, pairs, components, progress=False)
    for i, name in enumerate(components):
        known = {"embed": ("resid_pre", 0, None), "attn0": ("attn_out", 0, None), "mlp1": ("mlp_out", 1, None)}
        site, layer, heads = known[name] if name in known else ("attn_z", int(name[1]), [int(name[3])])
        own = patching.activation_patching(tiny_model, pairs, site, layers=[layer], heads=heads, per_position=False,
                                           direction="noise", progress=False)
        assert torch.allclose(effects.total[:, i], own.values.reshape(-1) - own.clean_baseline, atol=1e-5), name
