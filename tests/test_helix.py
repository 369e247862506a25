"""Helix bases, fits with held-out R², period search, the causal patch test and neuron fits."""

import dataclasses
import math
import re

import pytest
import torch

from arithinterp import helix as hx
from arithinterp.errors import AnalysisError, ConfigError, SiteError

torch.set_num_threads(1)

PERIODS = (2, 5, 10, 100)
CANDIDATES = (2, 3, 4, 5, 7, 10, 20, 25, 50, 100)


def planted_helix(values, periods=PERIODS, d=256, noise=0.02, seed=0, linear=True):
    """Activations [n, d]: a helix of ``values`` (random coefficients, periods plus linear term)
    embedded in ``d`` dimensions by a random rotation, plus an offset and Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    design = hx.helix_basis(torch.as_tensor(values).double(), periods, linear=linear)[:, :-1]
    coef = torch.randn(design.shape[1], d, generator=g, dtype=torch.float64)
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    offset = torch.randn(d, generator=g, dtype=torch.float64)
    return (design @ coef) @ rotation + offset + noise * torch.randn(len(design), d, generator=g, dtype=torch.float64)


# --- basis ---------------------------------------------------------------------------------------


def test_basis_columns_for_each_kind():
    x = torch.arange(100)
    helix, labels = hx.basis(x, "helix", PERIODS)
    assert helix.shape == (100, 10) and labels[:2] == ["cos(2πx/2)", "sin(2πx/2)"]
    assert labels[-2:] == ["x/99", "1"] and torch.allclose(helix[:, -2], x.double() / 99.0)
    circle, labels = hx.basis(x, "circle", PERIODS)
    assert circle.shape == (100, 9) and "x/99" not in labels
    poly, labels = hx.basis(x, "poly", PERIODS)
    assert poly.shape == (100, 10) and labels[1] == "(x/99)^2"  # as many parameters as the helix
    assert hx.helix_basis(x, PERIODS, constant=False).shape == (100, 9)


def test_non_integer_periods_are_periodic():
    x = torch.arange(0, 113 * 3, dtype=torch.float64)
    columns = hx.helix_basis(x, [113 / 14], linear=False, constant=False)
    assert torch.allclose(columns[:113], columns[113:226], atol=1e-9)  # period 113/14 repeats every 113
    assert not torch.allclose(columns[:8], columns[8:16], atol=1e-3)  # ... and not every 8


def test_several_variables_share_one_constant():
    values = torch.stack([torch.arange(10), torch.arange(10) * 2], 1)
    matrix, labels = hx.basis(values, "helix", (5,), names=["a", "b"])
    assert labels == ["cos(2πa/5)", "sin(2πa/5)", "a/9", "cos(2πb/5)", "sin(2πb/5)", "b/18", "1"]
    assert matrix.shape == (10, 7)


def test_basis_validates_input():
    with pytest.raises(ConfigError, match="helix"):
        hx.basis(torch.arange(5), "spiral")
    with pytest.raises(ConfigError, match="periods must be numbers from 2"):
        hx.basis(torch.arange(5), "helix", (0, 5))


# --- planted helix -------------------------------------------------------------------------------


@pytest.mark.slow
def test_planted_helix_is_recovered_as_the_best_period_subset():
    values = torch.arange(100).repeat(2)
    acts = planted_helix(values)
    search = hx.search_periods(acts, values, CANDIDATES, sizes=[3, 4, 5], progress=False)
    assert search.criterion == "held-out R²"
    assert search.best[1] == [2.0, 5.0, 10.0, 100.0]  # the best subset of size 4 is the planted one
    assert float(search.best_scores[1]) >= 0.95
    assert float(search.best_scores[1]) > float(search.best_scores[0]) + 0.05  # every planted period matters
    assert len(search.subsets) == 120 + 210 + 252
    assert search.to_frame().best_of_size.sum() == 3


def test_planted_helix_fit_and_shuffled_control():
    values = torch.arange(100).repeat(2)
    acts = planted_helix(values)
    fit = hx.fit(acts, values, PERIODS, n_pca=100, holdout=0.2, seed=0)
    assert fit.r2_overall >= 0.95 and fit.r2_full >= 0.95
    assert fit.n_params == 9 and len(fit.test_values) == 20
    assert not set(fit.test_values) & set(fit.train_values)  # the split is over values
    # shuffling which number each activation belongs to leaves nothing to fit
    shuffled = torch.randperm(100, generator=torch.Generator().manual_seed(3))[values]
    control = hx.fit(acts, shuffled, PERIODS)
    assert control.r2_overall < 0.1 and control.r2_full < 0.1
    # baselines: the circle misses the linear term, a polynomial misses the periods
    circle = hx.fit(acts, values, PERIODS, kind="circle")
    poly = hx.fit(acts, values, PERIODS, kind="poly")
    assert poly.r2_full < circle.r2_full < fit.r2_full


def test_fit_states_its_shuffled_values_control():
    values = torch.arange(100).repeat(2)
    fit = hx.fit(planted_helix(values), values, PERIODS)
    control = fit.meta["control"]
    assert control["n_shuffles"] == 5 and control["r2_full_max"] < 0.1 < fit.r2_full
    assert fit.meta["validation"] == "0.2 of the values held out"


def test_ten_digits_are_validated_leave_one_value_out():
    """Ten values: a 20% split holds out two of them; each digit is held out in turn instead."""
    digits = torch.arange(10).repeat(8)
    acts = planted_helix(digits, (10,), d=64, noise=0.02)
    fit = hx.fit(acts, digits, (10,))
    assert fit.meta["validation"] == "leave-one-value-out" and fit.meta["n_folds"] == 10
    assert fit.test_values == list(range(10))
    assert fit.r2_full > 0.95 and fit.r2_overall > 0.95
    assert fit.meta["control"]["r2_full_max"] < 0.3  # digits shuffled: no helix to find
    # the default periods have as many columns as there are digits: refused, with the fix
    with pytest.raises(AnalysisError, match="fits any function .* fewer periods"):
        hx.fit(acts, digits, PERIODS)
    # the search scores only subsets it can validate and beats its shuffled-values null
    search = hx.search_periods(acts, digits, (3, 7, 10), sizes=[1, 2], progress=False)
    assert search.meta["validation"] == "leave-one-value-out"
    assert search.best[0] == [10.0] and search.meta["control"]["beats_null"] == [True, True]


def test_predict_reconstructs_held_out_values_and_round_trips(tmp_path):
    values = torch.arange(100)
    acts = planted_helix(values, noise=0.0)
    fit = hx.fit(acts, values)
    held_out = torch.tensor(fit.test_values).long()
    error = (fit.predict(held_out) - acts[held_out].float()).norm(dim=1) / acts[held_out].float().norm(dim=1)
    assert float(error.max()) < 1e-3
    loaded = hx.HelixFit.load(fit.save(tmp_path / "fit"))
    assert torch.allclose(loaded.predict(held_out), fit.predict(held_out))
    assert loaded.labels == fit.labels
    assert len(fit.to_frame()) == fit.components.shape[0]
    assert len(fit.plot().data) == 2 and len(fit.plot(view="periods").data) == 4
    assert len(fit.plot(view="pairs").data) == 2 * 6  # 6 pairs of 4 components, points + fitted curve
    with pytest.raises(ConfigError, match="periods"):
        fit.plot(view="spiral")


def test_helix_of_a_b_and_sum():
    a = torch.arange(30).repeat_interleave(30)
    b = torch.arange(30).repeat(30)
    acts = planted_helix(a, (5, 10), d=64, seed=1) + planted_helix(b, (5, 10), d=64, seed=2) \
        + planted_helix(a + b, (5, 10), d=64, seed=3)
    three = hx.fit(acts, torch.stack([a, b, a + b], 1), (5, 10), names=["a", "b", "a+b"])
    only_a = hx.fit(acts, a, (5, 10))
    assert three.r2_full > 0.95 and only_a.r2_full < 0.6
    assert three.n_params == 15 and three.predict(torch.tensor([[1, 2, 3]])).shape == (1, 64)


def test_fit_validates_input():
    acts = torch.randn(20, 8)
    with pytest.raises(AnalysisError, match="rows"):
        hx.fit(acts, torch.arange(10))
    with pytest.raises(ConfigError, match="holdout"):
        hx.fit(acts, torch.arange(20), holdout=1.0)
    with pytest.raises(AnalysisError, match="name"):
        hx.fit(acts, "a")


# --- causal patch test on a model with a planted helix ------------------------------------------


def _planted_helix_model(tok, n_layers: int, seed: int):
    """Attention-only layers with uniform attention and identity values and outputs over number
    embeddings that are an exact helix (periods 2, 5, 10, 100 + linear); each number's
    unembedding is its own embedding."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    from arithinterp.fourier import number_tokens

    cfg = TransformerBridgeConfig(d_model=64, d_head=16, n_heads=4, n_layers=n_layers, n_ctx=8, d_mlp=128,
                                  d_vocab=len(tok), act_fn="relu", normalization_type=None, attn_only=True, seed=0)
    model = TransformerBridge.boot_native(cfg, tokenizer=tok).eval()
    tokens = number_tokens(model, range(100))
    g = torch.Generator().manual_seed(seed)
    design = hx.helix_basis(torch.arange(100).double(), PERIODS, constant=False)
    embed = (design @ torch.randn(design.shape[1], 64, generator=g, dtype=torch.float64)).float()
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    state["embed.weight"][tokens] = embed
    state["unembed.weight"][tokens] = embed
    for layer in range(n_layers):
        state[f"blocks.{layer}.attn.v.weight"] = torch.eye(64)
        state[f"blocks.{layer}.attn.o.weight"] = torch.eye(64)
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def helix_model(number_tokenizer):
    """A 1-layer planted-helix model whose final position reads the numbers back: patching the
    a-position therefore moves the answer logits, and only the helix coordinates matter."""
    return _planted_helix_model(number_tokenizer, n_layers=1, seed=0)


@pytest.fixture(scope="module")
def helix_pairs(helix_model):
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(helix_model, "+", a=range(100), b=[0], template="{a}+{b}=")
    return prompts, prompts.counterfactual(vary="a", seed=0)


def test_patch_test_planted_helix_is_causally_sufficient(helix_model, helix_pairs):
    from arithinterp.activations import collect

    prompts, pairs = helix_pairs
    acts = collect(helix_model, prompts, sites=["resid_pre"], layers=[0], positions=["a"], progress=False)
    fit = hx.fit(acts, "a", PERIODS)
    assert (fit.layer, fit.position, fit.site) == (0, "a", "resid_pre")
    circle = hx.fit(acts, "a", PERIODS, kind="circle")
    poly = hx.fit(acts, "a", PERIODS, kind="poly")
    result = hx.patch_test(helix_model, pairs, fit, extra={"circle": circle, "poly": poly})
    effect = dict(zip(result.methods, result.effect.tolist()))
    fraction = dict(zip(result.methods, result.fraction.tolist()))
    assert result.methods[:4] == ["layer patch", "PCA-9", "helix", "shuffled"]
    assert effect["layer patch"] > 1.0  # the corrupted answer gains logit
    assert fraction["helix"] == pytest.approx(1.0, abs=0.01)
    assert fraction["PCA-9"] == pytest.approx(1.0, abs=0.01)
    assert abs(fraction["shuffled"]) < 0.2  # the control has no causal effect
    assert abs(fraction["mean"]) < 0.2  # ... and neither has erasing the number
    assert fraction["poly"] < fraction["circle"] < 1.0 + 1e-3
    frame = result.to_frame()
    assert frame.n_pairs.iloc[0] == len(pairs) and frame.fraction_of_layer_patch.iloc[0] == 1.0
    assert len(result.plot().data) == 1


def test_patch_test_fractions_carry_bootstrap_intervals(helix_model, helix_pairs):
    from arithinterp.activations import collect

    prompts, pairs = helix_pairs
    acts = collect(helix_model, prompts, sites=["resid_pre"], layers=[0], positions=["a"], progress=False)
    result = hx.patch_test(helix_model, pairs, hx.fit(acts, "a", PERIODS))
    assert result.layer_patch_distinct and result.note == ""
    low, high = result.fraction_ci
    fractions = result.fractions()
    helix_row, shuffled_row = result.methods.index("helix"), result.methods.index("shuffled")
    assert float(low[helix_row]) <= fractions["helix"] <= float(high[helix_row])
    assert 0.9 < float(low[helix_row]) and float(high[helix_row]) < 1.1  # a planted helix: all of the effect
    assert float(low[shuffled_row]) < 0.3  # the shuffled control's interval reaches down to nothing
    assert float(low[0]) == pytest.approx(1.0) == float(high[0])  # the layer patch is its own reference
    effect_low, effect_high = result.effect_ci
    assert bool((effect_low <= result.effect).all() and (result.effect <= effect_high).all())
    frame = result.to_frame()
    assert {"effect_ci_low", "effect_ci_high", "fraction_ci_low", "fraction_ci_high", "note"} <= set(frame.columns)
    # seeded: the same call gives the same intervals
    again = hx.patch_test(helix_model, pairs, hx.fit(acts, "a", PERIODS))
    assert torch.equal(again.fraction_ci, result.fraction_ci)


def test_patch_result_round_trips_with_its_intervals(helix_model, helix_pairs, tmp_path):
    from arithinterp.activations import collect

    prompts, pairs = helix_pairs
    acts = collect(helix_model, prompts, sites=["resid_post"], layers=[0], positions=["a"], progress=False)
    result = hx.patch_test(helix_model, pairs[:40], hx.fit(acts, "a", PERIODS), n_boot=200)
    loaded = hx.HelixPatchResult.load(result.save(tmp_path / "patch"))
    assert loaded.note == result.note != "" and loaded.layer_patch_distinct is False
    assert torch.equal(loaded.effect_ci, result.effect_ci) and loaded.fraction_ci.isnan().all()
    with pytest.raises(ConfigError, match="n_boot"):
        hx.patch_test(helix_model, pairs, hx.fit(acts, "a", PERIODS), n_boot=10)


def test_patch_test_reports_no_fraction_of_a_zero_layer_patch(helix_model, helix_pairs):
    """In the last layer, the a position's output reaches no later attention: patching it moves
    nothing at the final position, so there is no layer-patch effect to take a share of."""
    from arithinterp.activations import collect

    prompts, pairs = helix_pairs
    acts = collect(helix_model, prompts, sites=["resid_post"], layers=[0], positions=["a"], progress=False)
    fit = hx.fit(acts, "a", PERIODS)
    assert fit.r2_full > 0.99  # the representation there is a perfect helix, yet it does nothing causally
    result = hx.patch_test(helix_model, pairs, fit)
    assert abs(float(result.effect[0])) < 1e-4
    assert not result.layer_patch_distinct
    assert torch.isnan(result.fraction).all() and torch.isnan(result.fraction_ci).all()
    assert result.fractions() == {}
    assert "not distinguishable from zero" in result.note and "no fraction" in result.note
    assert result.meta["note"] == result.note
    frame = result.to_frame()
    assert frame.fraction_of_layer_patch.isna().all() and (frame.note == result.note).all()
    figure = result.plot()
    assert "no fractions" in figure.layout.title.text and not figure.data[0].text


def test_patch_test_refuses_a_fit_on_too_few_values(helix_model):
    """Ten values and a 9-parameter helix: any 9-dim basis with a constant interpolates ten
    points, so 'the helix restores the layer patch' cannot fail; refused with the reason."""
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(helix_model, "+", a=range(10), b=range(10), template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="a", seed=0)
    acts = collect(helix_model, prompts, sites=["resid_pre"], layers=[0], positions=["a"], progress=False)
    fit = hx.fit(acts, "a", PERIODS, holdout=0)  # unvalidated, so fit itself does not refuse
    assert fit.r2_full > 0.999  # a perfect "fit" of ten points: the symptom, flagged on the fit itself
    assert "interpolates any function" in fit.meta["note"]
    with pytest.raises(AnalysisError, match=r"only 10 distinct values.*k \+ 1 = 10.*interpolates them exactly"):
        hx.patch_test(helix_model, pairs, fit)
    # one period fewer leaves the basis below the number of values: the comparison runs
    assert hx.patch_test(helix_model, pairs, hx.fit(acts, "a", (5, 10, 100), holdout=0)).k == 7
    # an extra baseline is held to the same rule
    poly = hx.fit(acts, "a", PERIODS, kind="poly", holdout=0)
    with pytest.raises(AnalysisError, match="'poly' fit"):
        hx.patch_test(helix_model, pairs, hx.fit(acts, "a", (10,), holdout=0), extra={"poly": poly})


def test_report_prints_no_share_of_a_zero_layer_patch(number_tokenizer):
    """The planted helix model with its attention output cut: the final position never sees a, so
    the layer patch at a does nothing and the report states that instead of printing shares."""
    from arithinterp.report import Context, fourier_helix_stage
    from arithinterp.tasks import arithmetic

    model = _planted_helix_model(number_tokenizer, n_layers=1, seed=0)
    state = model.state_dict()
    state["blocks.0.attn.o.weight"] = torch.zeros_like(state["blocks.0.attn.o.weight"])
    model.load_state_dict(state)
    prompts = arithmetic(model, "+", a=range(100), b=[0, 1], template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="a", seed=0)
    section = fourier_helix_stage(Context(model, "planted", prompts, prompts, prompts.evaluate(model), pairs,
                                          n_pairs=60))
    helix_finding = next(f for f in section.findings if f.startswith("A helix"))
    assert re.search(r"the layer patch moves the corrupted answer's logit by 0 \(95% CI 0 to 0\): not "
                     r"distinguishable from zero, so no share of it is reported\.$", helix_finding)
    assert "restore" not in helix_finding and not any("Helix: no signal" in f for f in section.findings)
    # the embeddings are an exact helix: x mod 10 is readable there, beyond a random-init model
    separability = next(f for f in section.findings if "x mod T" in f)
    assert "beyond chance and a random-init model of the same architecture for T = " in separability
    assert "10" in separability.split("for T = ")[1].split(" (")[0]


@pytest.fixture(scope="module")
def helix_model_2layer(number_tokenizer):
    """Two planted-helix layers: every residual site at an operand position is an exact helix of
    that operand (``resid_post`` of layer 0 at ``a`` is 1.5 × its embedding), and the final
    position reads every position, so patching any of them moves the answer."""
    return _planted_helix_model(number_tokenizer, n_layers=2, seed=1)


def _layer_patch_effect(model, pairs, hook, position):
    """Reference: mean corrupt-answer logit gain when ``hook`` at ``position`` takes the corrupt
    run's value, one hand-written hook per pair set (same-length prompts)."""
    clean, corrupt = pairs.clean.tokens, pairs.corrupt.tokens
    rows = torch.arange(len(pairs))
    pos = pairs.clean.positions[position]
    _, cache = model.run_with_cache(corrupt, names_filter=lambda name: name == hook)
    source = cache[hook][rows, pairs.corrupt.positions[position]]

    def patch(act, hook):
        act = act.clone()
        act[rows, pos] = source
        return act

    with torch.inference_mode():
        before = model(clean)[rows, -1, pairs.corrupt_answer_token]
        after = model.run_with_hooks(clean, fwd_hooks=[(hook, patch)])[rows, -1, pairs.corrupt_answer_token]
    return float((after - before).mean())


def test_patch_test_patches_at_the_fits_site_resid_post(helix_model_2layer):
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    model = helix_model_2layer
    prompts = arithmetic(model, "+", a=range(100), b=[0], template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="a", seed=0)
    acts = collect(model, prompts, sites=["resid_post"], layers=[0], positions=["a"], progress=False)
    fit = hx.fit(acts, "a", PERIODS)
    assert (fit.site, fit.layer, fit.position) == ("resid_post", 0, "a")
    result = hx.patch_test(model, pairs, fit)
    assert (result.site, result.layer, result.position) == ("resid_post", 0, "a")
    effect = dict(zip(result.methods, result.effect.tolist()))
    # the layer patch is the corrupt run's resid_post at a, exactly
    reference = _layer_patch_effect(model, pairs, "blocks.0.hook_resid_post", "a")
    assert effect["layer patch"] == pytest.approx(reference, rel=1e-4)
    # patching resid_pre instead moves the logits by a different amount: the site is not ignored
    assert abs(_layer_patch_effect(model, pairs, "blocks.0.hook_resid_pre", "a") - reference) > 0.1 * abs(reference)
    # the helix is a perfect reconstruction here, so patching it does what the layer patch does
    assert effect["layer patch"] > 1.0
    assert effect["helix"] == pytest.approx(effect["layer patch"], rel=0.01)
    assert abs(effect["shuffled"]) < 0.2 * effect["layer patch"]


def test_patch_test_patches_at_the_fits_position_b(helix_model_2layer):
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    model = helix_model_2layer
    prompts = arithmetic(model, "+", a=[3], b=range(100), template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="b", seed=0)
    acts = collect(model, prompts, sites=["resid_pre"], layers=[1], positions=["b"], progress=False)
    fit = hx.fit(acts, "b", PERIODS)
    result = hx.patch_test(model, pairs, fit)
    assert (result.site, result.layer, result.position, result.meta["value"]) == ("resid_pre", 1, "b", "b")
    effect = dict(zip(result.methods, result.effect.tolist()))
    reference = _layer_patch_effect(model, pairs, "blocks.1.hook_resid_pre", "b")
    assert effect["layer patch"] == pytest.approx(reference, rel=1e-4) and abs(reference) > 1.0
    assert effect["helix"] == pytest.approx(effect["layer patch"], rel=0.01)
    # a is the same in clean and corrupt prompts: patching there (the old fixed position) does nothing
    at_a = hx.patch_test(model, pairs, fit, positions="a", value="b")
    assert at_a.position == "a" and abs(float(at_a.effect[0])) < 1e-4


def test_patch_test_of_the_sum_at_the_final_position(helix_model_2layer):
    """The Clock step's test: with a fixed, the final position entering layer 1 holds helix(3) +
    helix(b), an exact helix of the sum a + b; a fit to values "a+b" there is patched at the final
    position with the corrupt sum, restores the layer patch, and its shuffled-sum control does not."""
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    model = helix_model_2layer
    prompts = arithmetic(model, "+", a=[3], b=range(100), template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="b", seed=0)
    acts = collect(model, prompts, sites=["resid_pre"], layers=[1], positions=["final"], progress=False)
    fit = hx.fit(acts, "a+b", PERIODS)
    assert fit.names == ["a+b"] and fit.r2_full > 0.99
    result = hx.patch_test(model, pairs, fit)
    assert (result.site, result.layer, result.position, result.meta["value"]) == ("resid_pre", 1, "final", "a+b")
    effect = dict(zip(result.methods, result.effect.tolist()))
    assert effect["layer patch"] == pytest.approx(_layer_patch_effect(model, pairs, "blocks.1.hook_resid_pre", "final"),
                                                  rel=1e-4)
    # the readout is not an adder (the answer's unembedding is its number's helix): the layer patch moves the
    # corrupt sum's logit (down, here), and the helix of the sum moves it as much
    assert abs(effect["layer patch"]) > 1.0 and result.fractions()["helix"] == pytest.approx(1.0, abs=0.01)
    assert abs(result.fractions()["shuffled"]) < 0.2


def _teacher_forced_effect(model, pairs, hook, position):
    """Reference: per pair, the corrupt answer's logits summed over its tokens (fed after the clean
    prompt, each read where it is predicted) with ``hook`` at ``position`` taking the corrupt run's
    value, minus the same unpatched; hand-written hooks, same-length prompts and answers."""
    answer = pairs.corrupt.answer_tokens
    assert bool((answer >= 0).all())
    k = answer.shape[1]
    fed = torch.cat([pairs.clean.tokens, answer[:, :-1]], dim=1)
    rows = torch.arange(len(pairs))
    pos = pairs.clean.positions[position]
    _, cache = model.run_with_cache(pairs.corrupt.tokens, names_filter=lambda name: name == hook)
    source = cache[hook][rows, pairs.corrupt.positions[position]]

    def patch(act, hook):
        act = act.clone()
        act[rows, pos] = source
        return act

    with torch.inference_mode():
        steps = pairs.clean.tokens.shape[1] - 1 + torch.arange(k)
        before = model(fed)[rows[:, None], steps[None], answer].sum(1)
        after = model.run_with_hooks(fed, fwd_hooks=[(hook, patch)])[rows[:, None], steps[None], answer].sum(1)
    return after - before


def test_patch_test_scores_every_answer_token_with_full_answer_scoring(tiny_digit_model):
    """Answers written digit by digit: with full-answer scoring the effect is the corrupt answer's
    logits summed over its tokens, teacher-forced (the units digit is predicted after the tens digit,
    from a position that sees the patched one), equal to hand-written hooks; first-token scoring
    reads the tens digit alone."""
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    model = tiny_digit_model
    prompts = arithmetic(model, "+", a=range(10, 60), b=range(10, 40, 6), template="{a}+{b}=")
    pairs = prompts.counterfactual(vary="a", seed=0, distinct_first_token=True)[:24]
    acts = collect(model, prompts, sites=["resid_pre"], layers=[1], positions=["final"], progress=False)
    fit = hx.fit(acts, "a+b", (10, 100))
    scored = dataclasses.replace(pairs, clean=pairs.clean.with_scoring("full-answer"),
                                 corrupt=pairs.corrupt.with_scoring("full-answer"))
    full = hx.patch_test(model, scored, fit, n_boot=200)
    reference = _teacher_forced_effect(model, pairs, "blocks.1.hook_resid_pre", "final")
    assert torch.allclose(full.per_pair[0], reference, atol=1e-4)
    first = hx.patch_test(model, pairs, fit, n_boot=200)  # first-token scoring, the default
    tens = dataclasses.replace(pairs, corrupt=dataclasses.replace(pairs.corrupt,
                                                                  answer_tokens=pairs.corrupt.answer_tokens[:, :1]))
    assert torch.allclose(first.per_pair[0], _teacher_forced_effect(model, tens, "blocks.1.hook_resid_pre", "final"),
                          atol=1e-4)
    assert not torch.allclose(first.per_pair[0], reference, atol=1e-3)


def test_causal_period_search_prefers_the_planted_periods(helix_model, helix_pairs):
    from arithinterp.activations import collect

    prompts, pairs = helix_pairs
    acts = collect(helix_model, prompts, sites=["resid_pre"], layers=[0], positions=["a"], progress=False)
    search = hx.search_periods(acts, "a", (2, 3, 5, 10, 100), sizes=[4], model=helix_model, pairs=pairs[:60],
                               layer=0, progress=False)
    assert search.criterion == "causal effect"
    assert search.best == [[2.0, 5.0, 10.0, 100.0]]


def test_patch_test_validates_input(helix_model, helix_pairs):
    prompts, pairs = helix_pairs
    fit = hx.fit(torch.randn(100, 64), torch.arange(100))
    with pytest.raises(SiteError, match="layer"):
        hx.patch_test(helix_model, pairs, fit)
    with pytest.raises(SiteError, match="position"):
        hx.patch_test(helix_model, pairs, fit, layer=0, positions="c")
    with pytest.raises(SiteError, match="out of range"):
        hx.patch_test(helix_model, pairs, fit, layer=3)


def test_fit_layers_reports_each_kind(helix_model, helix_pairs):
    from arithinterp.activations import collect

    prompts, _ = helix_pairs
    acts = collect(helix_model, prompts, sites=["resid_pre"], layers=[0], positions=["a"], progress=False)
    result = hx.fit_layers(acts, "a", PERIODS)
    assert result.fits == ["helix", "circle", "poly", "PCA-k"] and result.r2.shape == (4, 1)
    assert float(result.r2[0, 0]) > 0.999 > float(result.r2[2, 0])
    assert len(result.plot().data) == 4
    assert result.meta["control"]["r2_full_mean"]["helix"][0] < 0.5  # shuffled values


# --- neuron fits ---------------------------------------------------------------------------------


def planted_neurons():
    a = torch.arange(40).repeat_interleave(40).double()
    b = torch.arange(40).repeat(40).double()
    g = torch.Generator().manual_seed(0)
    neurons = torch.stack([
        3 * torch.cos(2 * math.pi / 10 * (a + b - 3)) + 0.05 * a,
        torch.cos(2 * math.pi / 5 * (a - 1)) - 2 * torch.cos(2 * math.pi / 2 * b) + 1.0,
        torch.randn(len(a), generator=g, dtype=torch.float64),
    ], 1)
    return neurons, a, b


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gd", "lstsq"])
def test_neuron_fits_recover_planted_preactivations(method):
    neurons, a, b = planted_neurons()
    result = hx.fit_neurons(neurons, a, b, PERIODS, method=method, progress=False)
    assert torch.all(result.nrmse[:2] < 0.01)
    assert result.nrmse[2] > 0.15  # noise is not fitted
    # the planted term: amplitude 3 at period 10 on a+b, phase 3
    t10, sum_index = PERIODS.index(10), 2
    assert float(result.amplitude[0, t10, sum_index]) == pytest.approx(3.0, abs=0.05)
    assert float(result.phase[0, t10, sum_index]) == pytest.approx(3.0, abs=0.05)
    assert torch.allclose(result.predict(a, b)[:, :2], neurons[:, :2].float(), atol=0.1)
    assert result.to_frame().strongest_variable.tolist()[:2] == ["a+b", "b"]


def test_neuron_fits_on_shuffled_operands_fail():
    neurons, a, b = planted_neurons()
    order = torch.randperm(len(a), generator=torch.Generator().manual_seed(0))
    result = hx.fit_neurons(neurons[:, :2], a[order], b[order], PERIODS, method="lstsq", progress=False)
    assert torch.all(result.nrmse > 0.15)


def test_neuron_fits_validate_input():
    neurons, a, b = planted_neurons()
    with pytest.raises(ConfigError, match="gd"):
        hx.fit_neurons(neurons, a, b, method="adam")
    with pytest.raises(AnalysisError, match="a and b"):
        hx.fit_neurons(neurons, a[:5], b)


# --- known results on the zoo (measured, see docs/fourier.md) ------------------------------------


def _shipped(name):
    from arithinterp.models.zoo import get_entry

    return (get_entry(name).directory / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _shipped("add-100"), reason="zoo:add-100 is not shipped")
def test_add100_helix_patch_test_at_the_a_position():
    import arithinterp as ai
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    model = ai.load_model("zoo:add-100")
    prompts = arithmetic(model, "+", a=range(100), b=range(0, 100, 5), template="{a}+{b}=")
    per_a = prompts[prompts.b == 0]  # the a-position activation depends on a only
    acts = collect(model, per_a, sites=["resid_pre"], layers=[0, 1], positions=["a"], progress=False)
    sample = prompts[torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))[:300]]
    pairs = sample.counterfactual(vary="a", seed=0)[:200]
    fit = hx.fit(acts, "a", PERIODS, layer=0)
    result = hx.patch_test(model, pairs, fit)
    fraction = dict(zip(result.methods, result.fraction.tolist()))
    # measured: layer patch +13.7 logits (95% CI 13.3 to 14.1); PCA-9 63%, helix 30% (26% to 34%), shuffled 1%
    assert float(result.effect[0]) > 5 and result.layer_patch_distinct
    assert 0.1 < fraction["helix"] < fraction["PCA-9"]
    assert abs(fraction["shuffled"]) < 0.1
    helix_low, helix_high = result.fraction_ci[:, result.methods.index("helix")].tolist()
    assert 0.1 < helix_low < fraction["helix"] < helix_high < fraction["PCA-9"]
    # by layer 1 the a position no longer matters (attention in layer 0 has moved it on)
    later = hx.patch_test(model, pairs, hx.fit(acts, "a", PERIODS, layer=1))
    assert abs(float(later.effect[0])) < 0.05 * float(result.effect[0])
    assert not later.layer_patch_distinct and later.fractions() == {}  # measured: +0.0008 (−0.009 to 0.010)


@pytest.mark.slow
@pytest.mark.skipif(not _shipped("modadd-113"), reason="zoo:modadd-113 is not shipped")
def test_modadd_key_frequency_circle_is_causally_sufficient():
    import arithinterp as ai
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    model = ai.load_model("zoo:modadd-113")
    prompts = arithmetic(model, "+", a=range(113), b=range(0, 113, 4), template="{a} {b} =", modulus=113)
    per_a = prompts[prompts.b == 0]
    acts = collect(model, per_a, sites=["resid_pre"], layers=[0], positions=["a"], progress=False)
    periods = [113 / k for k in (7, 10, 16, 20, 38)]  # the measured key frequencies
    circle = hx.fit(acts, "a", periods, kind="circle")
    sample = prompts[torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))[:300]]
    result = hx.patch_test(model, sample.counterfactual(vary="a", seed=0)[:200], circle, layer=0)
    fraction = dict(zip(result.methods, result.fraction.tolist()))
    # measured (six periods incl. 113): circle 99.8% of a +32-logit layer patch, shuffled 10%, mean 3%
    assert float(result.effect[0]) > 10
    assert fraction["circle"] > 0.9
    assert fraction["shuffled"] < 0.3 and fraction["mean"] < 0.3
