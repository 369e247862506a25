"""Fourier bases, spectra, key frequencies, neuron clusters, restricted / excluded loss, filters."""

import math
import re

import pytest
import torch

from arithinterp import fourier as fo
from arithinterp import sites
from arithinterp.errors import AnalysisError, ArithInterpError, ConfigError, SiteError, TokenizationError

torch.set_num_threads(1)


def planted(n, d, freqs, noise, seed=0):
    """[n, d] rows = numbers, a random mix of cos/sin at ``freqs`` plus Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.arange(n, dtype=torch.float64)
    out = noise * torch.randn(n, d, generator=g, dtype=torch.float64)
    for k in freqs:
        angle = 2 * math.pi * k * x / n
        out += torch.outer(angle.cos(), torch.randn(d, generator=g, dtype=torch.float64))
        out += torch.outer(angle.sin(), torch.randn(d, generator=g, dtype=torch.float64))
    return out


# --- basis ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 7, 10, 100, 113])
def test_basis_is_orthonormal_with_labels_and_frequencies(n):
    basis = fo.fourier_basis(n)
    assert torch.allclose(basis.matrix @ basis.matrix.T, torch.eye(n, dtype=torch.float64), atol=1e-10)
    assert basis.labels[0] == "const" and len(basis.labels) == n
    assert basis.freqs.max() == n // 2 and basis.n_freq == n // 2 + 1
    if n >= 7:
        assert basis.labels[5:7] == ["cos 3", "sin 3"]
    # a range of consecutive numbers gives the same basis
    assert torch.equal(fo.fourier_basis(range(5, 5 + n)).matrix, basis.matrix)


def test_period_labels():
    assert fo.period_label(100, 10) == "10"
    assert fo.period_label(113, 14) == "113/14 ≈ 8.07"
    assert fo.frequency_periods(10)[:3] == [math.inf, 10.0, 5.0]


def test_2d_transform_is_the_outer_product_basis():
    n = 6
    grids = torch.randn(3, n, n, dtype=torch.float64)
    full = fo.fourier_basis_2d(n)  # [n, n, n, n]
    explicit = torch.einsum("ijab,mab->mij", full, grids)
    assert torch.allclose(fo.fourier_2d(grids), explicit, atol=1e-10)
    # Parseval on the 2-D spectrum
    assert math.isclose(float(fo.spectrum_of_2d(grids).sum()), float(grids.pow(2).sum()), rel_tol=1e-9)


def test_basis_rejects_non_consecutive_numbers():
    with pytest.raises(AnalysisError, match="consecutive"):
        fo.fourier_basis([0, 2, 4])
    with pytest.raises(AnalysisError, match="at least 2"):
        fo.fourier_basis(1)


# --- spectra and key frequencies -----------------------------------------------------------------


def test_spectrum_is_parseval_and_finds_planted_frequencies():
    values = planted(113, 64, [14, 35, 41], noise=0.3)
    power = fo.spectrum_of(values)
    assert math.isclose(float(power.sum()), float(values.pow(2).sum()), rel_tol=1e-9)
    assert sorted(fo.key_frequencies(power)) == [14, 35, 41]
    assert sorted(fo.key_frequencies(power, "fraction", fraction=0.9)) == [14, 35, 41]
    result = fo.activation_spectrum(values.float())
    assert sorted(result.key[0]) == [14, 35, 41]
    assert float(result.key_fraction[0]) > 0.9


def test_spectrum_along_another_axis_matches():
    values = planted(50, 8, [5], noise=0.1)
    assert torch.allclose(fo.spectrum_of(values.T, dim=1), fo.spectrum_of(values))


@pytest.mark.parametrize("seed", range(3))
def test_pure_noise_has_no_key_frequencies_and_a_flat_spectrum(seed):
    noise = torch.randn(113, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    power = fo.spectrum_of(noise)
    assert fo.key_frequencies(power) == []
    # near uniform: reaching 90% of the power needs most frequencies, none holds more than 5%
    assert len(fo.key_frequencies(power, "fraction", fraction=0.9)) > 0.75 * 56
    assert float(power[1:].max() / power[1:].sum()) < 0.05


def test_key_frequency_rule_is_validated():
    with pytest.raises(ConfigError, match="median"):
        fo.key_frequencies(torch.ones(10), "largest")
    with pytest.raises(AnalysisError, match="1-D"):
        fo.key_frequencies(torch.ones(3, 3))
    with pytest.raises(ConfigError):
        fo.activation_spectrum(torch.ones(10, 2), rule="nope")


def test_shuffled_numbers_destroy_the_planted_spectrum():
    values = planted(113, 64, [14, 35, 41], noise=0.3)
    shuffled = values[torch.randperm(113, generator=torch.Generator().manual_seed(1))]
    result = fo.activation_spectrum(shuffled.float())
    assert result.key[0] == []
    assert float(result.key_fraction[0]) == 0.0


def test_key_frequencies_are_calibrated_against_shuffled_numbers():
    """A lenient rule picks frequencies out of noise; the shuffled-numbers test removes them,
    keeps the planted ones, and the result says what the rule found on shuffled numbers."""
    noise = torch.randn(113, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lenient = dict(rule="median", factor=3.0)
    rule_only = fo.activation_spectrum(noise, n_shuffles=0, **lenient)
    assert len(rule_only.key[0]) >= 2 and "control" not in rule_only.meta
    controlled = fo.activation_spectrum(noise, **lenient)
    control = controlled.meta["control"]
    assert controlled.key[0] == [] and control["dropped"][0] == sorted(rule_only.key[0])
    assert control["n_shuffles"] == 100 and control["null_keys_mean"][0] >= 1  # the rule alone fires on the null
    planted_values = planted(113, 4, [14, 35, 41], noise=1.0)
    found = fo.activation_spectrum(planted_values, **lenient)
    assert sorted(found.key[0]) == [14, 35, 41]
    assert max(found.meta["control"]["p_values"][0][k] for k in (14, 35, 41)) <= 1 / 101
    frame = found.to_frame()
    assert (frame.loc[frame.key, "p_value"] <= 0.05).all()
    with pytest.raises(ConfigError, match="alpha"):
        fo.activation_spectrum(noise, n_shuffles=10, alpha=0.01)


def test_shuffled_power_equals_the_spectrum_of_shuffled_rows():
    values = planted(30, 5, [4], noise=0.1)
    null = fo.spectra.shuffled_power(values @ values.T, 3, seed=2)
    generator = torch.Generator().manual_seed(2)
    for r in range(3):
        perm = torch.randperm(30, generator=generator)
        assert torch.allclose(null[r], fo.spectrum_of(values[torch.argsort(perm)]))


def test_spectrum_result_frame_plot_and_round_trip(tmp_path):
    result = fo.activation_spectrum(planted(20, 4, [3], noise=0.05).float(), numbers=range(10, 30))
    frame = result.to_frame()
    assert len(frame) == 11 and set(frame.columns) >= {"series", "frequency", "period", "power", "share", "key"}
    assert frame.loc[frame.key, "frequency"].tolist() == [3]
    assert abs(frame.share.sum() - 1) < 1e-6  # shares of the non-constant power
    assert result.period_labels[3] == "20/3 ≈ 6.67" and result.numbers == [10, 30]
    figure = result.plot()
    assert "key frequencies" in figure.layout.annotations[0].text
    loaded = fo.SpectrumResult.load(result.save(tmp_path / "spectrum"))
    assert torch.equal(loaded.power, result.power) and loaded.key == result.key


def test_activation_spectrum_groups_prompts_by_value():
    values = planted(30, 6, [4], noise=0.0)
    labels = torch.arange(30).repeat(3)
    from arithinterp.activations import Activations

    acts = Activations(data={"resid_post": values[labels].float()[:, None, None, :]}, layers=[0], positions=["a"])
    result = fo.activation_spectrum(acts, values=labels, site="resid_post")
    assert result.key == [[4]] and result.series == ["L0 resid_post"]
    with pytest.raises(AnalysisError, match="no prompt"):
        fo.activation_spectrum(acts, values=labels.clamp(max=28), numbers=range(30), site="resid_post")


# --- neuron clusters ------------------------------------------------------------------------------


def test_neuron_frequencies_find_planted_blocks_and_reject_noise():
    n = 31
    x = torch.arange(n, dtype=torch.float64)
    w = lambda k: 2 * math.pi * k / n  # noqa: E731
    a, b = x[:, None], x[None, :]
    grids = torch.stack([
        torch.cos(w(4) * (a + b)),  # cos(w(a+b)) = cos a cos b - sin a sin b: block 4
        torch.relu(torch.cos(w(7) * a) + torch.cos(w(7) * b)) + 0.0,  # ReLU keeps most variance in block 7
        torch.cos(w(2) * a) * torch.sin(w(2) * b) + 0.3 * torch.cos(w(2) * a),
        torch.randn(n, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64),
        torch.full((n, n), 3.0, dtype=torch.float64),  # dead: constant
    ])
    result = fo.neuron_frequencies(grids)
    assert result.best_k[:3].tolist() == [4, 7, 2]
    assert torch.all(result.fraction[[0, 2]] > 0.999)
    assert result.fraction[1] > 0.85
    assert result.fraction[3] < 0.05
    assert result.clustered.tolist() == [True, True, True, False, False]
    assert result.dead.tolist() == [False, False, False, False, True]
    assert result.cluster_sizes() == {2: 1, 4: 1, 7: 1}
    assert result.to_frame().clustered.sum() == 3
    assert "3 / 5" in result.plot().layout.title.text
    # control: the same grids with their cells shuffled are not clustered
    assert result.meta["control"]["clustered_fraction"] == 0.0
    assert result.meta["control"]["best_share_q95"] < 0.5


# --- restricted / excluded loss ------------------------------------------------------------------


def fourier_logits(p, freqs, scale=4.0, noise=0.0, seed=0):
    """Planted 'Fourier multiplication' logits [p, p, p] = Σ_k scale·cos(w_k(a + b − c)) + noise."""
    x = torch.arange(p, dtype=torch.float64)
    s = (x[:, None, None] + x[None, :, None] - x[None, None, :])
    logits = sum(scale * torch.cos(2 * math.pi * k * s / p) for k in freqs)
    g = torch.Generator().manual_seed(seed)
    return logits + noise * torch.randn(p, p, p, generator=g, dtype=torch.float64)


def test_restricted_and_excluded_loss_on_planted_fourier_logits():
    p, key = 23, [3, 7, 9]
    clean = fourier_logits(p, key)
    noisy = fourier_logits(p, key, noise=1.5)
    # the planted logits live in the key directions: restricting changes nothing
    assert math.isclose(fo.restricted_loss(clean, key), fo.full_loss(clean), rel_tol=1e-9)
    # noise off the key directions hurts the full loss; the restricted loss removes it
    assert fo.restricted_loss(noisy, key) < 0.5 * fo.full_loss(noisy)
    # excluding the key directions leaves no signal: the loss is near uniform guessing
    assert fo.excluded_loss(clean, key) == pytest.approx(math.log(p), rel=1e-6)
    assert fo.excluded_loss(noisy, key) > 5 * fo.full_loss(noisy)
    # the wrong frequencies neither carry the answer nor remove it
    wrong = [1, 2]
    assert fo.restricted_loss(clean, wrong) == pytest.approx(math.log(p), rel=1e-6)
    assert math.isclose(fo.excluded_loss(clean, wrong), fo.full_loss(clean), rel_tol=1e-9)
    # the key frequencies are the ones the logits are built from
    assert sorted(fo.key_frequencies(fo.sum_frequency_power(noisy))) == key


def test_losses_respect_the_mask_and_validate_input():
    p, key = 11, [2]
    logits = fourier_logits(p, key, noise=0.5)
    mask = torch.zeros(p, p, dtype=torch.bool)
    mask[:3] = True
    labels = (torch.arange(3)[:, None] + torch.arange(p)) % p
    by_hand = torch.nn.functional.cross_entropy(logits[:3].reshape(-1, p), labels.flatten())
    assert fo.full_loss(logits, mask=mask) == pytest.approx(float(by_hand))
    losses = fo.modular_losses(logits, key, mask)
    assert losses["train_loss"] == pytest.approx(float(by_hand))
    assert set(losses) == set(fo.ProgressResult.MEASURES)
    with pytest.raises(AnalysisError, match=r"\[p, p, n_classes\]"):
        fo.full_loss(torch.zeros(3, 4, 5))
    with pytest.raises(AnalysisError, match="out of range"):
        fo.restricted_loss(logits, [6])


# --- models ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(number_tokenizer):
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    tok = number_tokenizer
    cfg = TransformerBridgeConfig(d_model=64, d_head=16, n_heads=4, n_layers=2, n_ctx=8, d_mlp=128,
                                  d_vocab=len(tok), act_fn="relu", normalization_type="LN", seed=0)
    return TransformerBridge.boot_native(cfg, tokenizer=tok).eval()


def test_embedding_spectrum_finds_frequencies_planted_in_the_embeddings(tiny):
    tokens = fo.number_tokens(tiny, range(100))
    original = tiny.W_E.detach()[tokens].clone()
    embed = planted(100, 64, [10, 20, 50], noise=0.05).float()  # periods 10, 5, 2
    with torch.no_grad():
        tiny.W_E[tokens] = embed
    try:
        result = fo.spectrum(tiny, range(100), site="embed")
    finally:
        with torch.no_grad():
            tiny.W_E[tokens] = original
    assert sorted(result.key[0]) == [10, 20, 50]
    assert [result.period_labels[k] for k in sorted(result.key[0])] == ["10", "5", "2"]
    # the random embedding has no structure
    assert fo.embedding_spectrum(tiny, range(100)).key == [[]]


def test_number_tokens_rejects_multi_token_numbers(tiny):
    with pytest.raises(TokenizationError, match="single tokens"):
        fo.number_tokens(tiny, range(195, 205))


def test_logit_lens_and_neuron_spectra_on_a_tiny_model(tiny):
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(tiny, "+", a=range(12), b=range(12), template="{a}+{b}=")
    lens = fo.logit_lens_spectrum(tiny, prompts, progress=False)
    assert lens.series == ["L0 attn_out", "L0 mlp_out", "L1 attn_out", "L1 mlp_out"]
    assert lens.power.shape == (4, 23 // 2 + 1) and lens.numbers == [0, 23]
    assert len(lens.plot().data) == 1  # one heatmap
    neurons = fo.spectrum(tiny, site="mlp_post", prompts=prompts, layer=1, progress=False)
    assert neurons.is_2d and neurons.power.shape == (1, 7, 7)
    clusters = fo.neuron_clusters(tiny, prompts, layer=1, progress=False)
    assert clusters.shares.shape == (128, 7)
    assert torch.all((clusters.fraction >= 0) & (clusters.fraction <= 1 + 1e-6))
    with pytest.raises(AnalysisError, match="exactly once"):
        fo.neuron_clusters(tiny, prompts[torch.arange(100)], layer=0, progress=False)
    with pytest.raises(SiteError, match="attn_out"):
        fo.logit_lens_spectrum(tiny, prompts, components=["resid_post"], progress=False)


def test_filter_projector_removes_exactly_the_band():
    g = torch.Generator().manual_seed(0)
    unembed = torch.randn(64, 40, generator=g, dtype=torch.float64)
    removed = fo.band_frequencies(40, "high", split_period=10)  # periods ≤ 10: k ≥ 4
    assert removed == list(range(4, 21))
    projector = fo.filter_projector(unembed, removed)
    h = torch.randn(200, 64, generator=g, dtype=torch.float64)
    before, after = fo.spectrum_of(h @ unembed, dim=1), fo.spectrum_of(h @ projector @ unembed, dim=1)
    assert float(after[removed].sum()) < 1e-18 * float(before[removed].sum()) + 1e-9
    kept = [k for k in range(21) if k not in removed]
    # a projector: idempotent, and it leaves the rest of the spectrum mostly in place
    assert torch.allclose(projector @ projector, projector, atol=1e-9)
    assert float(after[kept].sum()) > 0.3 * float(before[kept].sum())
    assert fo.band_frequencies(40, "low", split_period=10) == [1, 2, 3]
    with pytest.raises(ConfigError, match="band"):
        fo.band_frequencies(40, "middle")


def test_frequency_filter_reports_accuracy_and_errors(tiny):
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(tiny, "+", a=range(10), b=range(10), template="{a}+{b}=")
    result = fo.frequency_filter(tiny, prompts, "high", site="attn_out")
    baseline = prompts.evaluate(tiny)
    assert result.baseline_accuracy == baseline.accuracy
    wrong = round((1 - result.accuracy) * len(prompts))
    assert sum(result.counts) + result.unparsable == wrong
    assert 0 not in result.errors
    assert result.removed == fo.band_frequencies(19, "high")
    assert result.layers == [0, 1]
    # a random model answers (almost) nothing: no share of a zero baseline is reported
    if result.baseline_ci[0] <= 0:
        assert math.isnan(result.retained) and "not distinguishable from zero" in result.note
    assert 0 <= result.accuracy_ci[0] <= result.accuracy <= result.accuracy_ci[1] <= 1
    assert result.drop == pytest.approx(result.baseline_accuracy - result.accuracy)
    # the filter acts: removing every non-constant frequency from every component changes the logits
    everything = fo.frequency_filter(tiny, prompts, list(range(1, 10)), site="mlp_out")
    assert everything.removed == list(range(1, 10))
    with pytest.raises(SiteError, match="mlp_out"):
        fo.frequency_filter(tiny, prompts, site="resid_post")


def test_filter_hook_zeroes_the_band_in_the_component_output(tiny):
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(tiny, "+", a=range(10), b=range(10), template="{a}+{b}=")
    tokens = fo.number_tokens(tiny, range(19))
    removed = fo.band_frequencies(19, "low", split_period=5)
    projector = fo.filter_projector(tiny.W_U.detach()[:, tokens], removed)
    name = sites.hook_name("mlp_out", 1)
    seen = {}

    def read(x, hook):
        seen["out"] = x[:, -1].detach().double()

    def filt(x, hook):
        x[:, -1] = (x[:, -1].double() @ projector).to(x.dtype)
        return x

    with torch.inference_mode():
        tiny.run_with_hooks(prompts.tokens, fwd_hooks=[(name, filt), (name, read)])
    lens = seen["out"] @ tiny.W_U.detach()[:, tokens].double()
    out = fo.spectrum_of(lens, dim=1)
    assert float(out[removed].sum()) < 1e-8 * float(out.sum())


def test_modular_logits_match_the_model(tiny):
    logits = fo.modular_logits(tiny, 7)
    assert logits.shape == (7, 7, 7)
    tokens = tiny.to_tokens("3 5 =")
    direct = tiny(tokens, return_type="logits")[0, -1, fo.number_tokens(tiny, range(7))]
    assert torch.allclose(logits[3, 5], direct, atol=1e-4)
    with pytest.raises(ArithInterpError, match="p="):
        fo.modular_logits(tiny)


def test_train_mask_is_the_zoo_training_split():
    mask = fo.train_mask("modadd-113")
    assert mask.shape == (113, 113) and int(mask.sum()) == round(0.3 * 113 * 113)
    assert torch.equal(mask, fo.train_mask("modadd-113"))  # seeded
    with pytest.raises(AnalysisError, match="modular"):
        fo.train_mask("add-100")


# --- known results on the zoo (measured, see docs/fourier.md) ------------------------------------


def _shipped(name):
    from arithinterp.models.zoo import get_entry

    return (get_entry(name).directory / "model.safetensors").exists()


needs_add100 = pytest.mark.skipif(not _shipped("add-100"), reason="zoo:add-100 is not shipped")


@pytest.fixture(scope="module")
def add100():
    import arithinterp as ai
    from arithinterp.tasks import arithmetic

    model = ai.load_model("zoo:add-100")
    prompts = arithmetic(model, "+", a=range(100), b=range(100), template="{a}+{b}=")
    return model, prompts


@pytest.mark.slow
@needs_add100
def test_add100_embeddings_spread_over_many_frequencies(add100):
    model, _ = add100
    emb = fo.embedding_spectrum(model, range(100))
    power = emb.power[0]
    # measured: the strongest frequency is k=1 (period 100) with 14% of the power, then periods
    # 2.7 and 2.5 with about 5% and 4%; 90% of the power needs 42 of the 50 frequencies
    assert int(power[1:].argmax()) + 1 == 1
    assert len(fo.key_frequencies(power, "fraction", fraction=0.9)) > 30


@pytest.mark.slow
@needs_add100
def test_add100_final_residual_after_layer_0_is_low_frequency_in_the_sum(add100):
    from arithinterp.activations import collect

    model, prompts = add100
    prompts = prompts[prompts.answer < 198]
    acts = collect(model, prompts, sites=["resid_post"], layers=[0], positions=["final"], progress=False)
    result = fo.activation_spectrum(acts, values=prompts.answer, numbers=range(198), site="resid_post")
    power = result.power[0]
    # measured: periods 198 and 99 (the magnitude of a + b) hold 49% + 20% of the power
    assert float(power[1:3].sum() / power[1:].sum()) > 0.5


@pytest.mark.slow
@needs_add100
def test_add100_frequency_filters(add100):
    model, prompts = add100
    sample = prompts[torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))[:500]]
    high = fo.frequency_filter(model, sample, "high", site="mlp_out")
    low = fo.frequency_filter(model, sample, "low", site="mlp_out")
    # measured on 1000 prompts: 100% unfiltered, 0.8% without periods <= 10, 67% without periods > 10
    assert high.baseline_accuracy > 0.99
    assert high.accuracy < 0.1
    assert 0.3 < low.accuracy < 0.95
    # shares of an accuracy that is there carry their bootstrap interval over prompts
    assert low.note == "" and low.retained_ci[0] <= low.retained <= low.retained_ci[1]
    assert low.retained == pytest.approx(low.accuracy / low.baseline_accuracy)
    assert low.drop_ci[0] > 0.03  # removing the low band costs accuracy, beyond the noise
    assert low.summary()["drop_ci"] == low.drop_ci


@pytest.fixture
def small_modadd(tmp_path, monkeypatch):
    """A zoo entry 'modadd-11' ((a + b) mod 11, one small layer) trained for 150 steps with a
    snapshot every 50, in a temporary checkpoint directory."""
    from arithinterp.models import zoo
    from arithinterp.models.train import train

    from families import modadd_entry

    name = "modadd-11"
    entry = modadd_entry(name, 11, 32, steps=150, every=50, purpose="progress-measure test")
    monkeypatch.setattr(zoo, "CHECKPOINT_DIR", tmp_path)  # undone after the test
    monkeypatch.setitem(zoo.ZOO, name, entry)
    train(name, progress=False)
    return name


def test_progress_measures_every_snapshot_with_fixed_key_frequencies(small_modadd):
    import arithinterp as ai

    result = fo.progress(name=small_modadd, rule="fraction", fraction=0.5, progress=False)
    assert result.steps == [50, 100, 150]  # the final model is the last snapshot
    final = fo.modular_logits(ai.load_model(f"zoo:{small_modadd}"))
    assert result.key == fo.key_frequencies(fo.sum_frequency_power(final), "fraction", fraction=0.5)
    mask = fo.train_mask(small_modadd)
    first = fo.modular_logits(ai.load_model(f"zoo:{small_modadd}@step=50"))
    assert float(result.train_loss[0]) == pytest.approx(fo.full_loss(first, mask=mask), rel=1e-5)
    assert float(result.excluded_loss[0]) == pytest.approx(fo.excluded_loss(first, result.key, mask=mask), rel=1e-5)
    assert float(result.train_loss[-1]) < float(result.train_loss[0])
    assert len(result.to_frame()) == 3 * 6 and len(result.plot().data) == 6
    with pytest.raises(ConfigError, match="not shipped"):
        fo.progress([75], name=small_modadd, progress=False)


needs_modadd = pytest.mark.skipif(not _shipped("modadd-113"), reason="zoo:modadd-113 is not shipped")
FIVE = {7, 10, 16, 20, 38}  # measured key frequencies of zoo:modadd-113 (docs/fourier.md)


@pytest.fixture(scope="module")
def modadd():
    import arithinterp as ai
    from arithinterp.tasks import arithmetic

    model = ai.load_model("zoo:modadd-113")
    prompts = arithmetic(model, "+", a=range(113), b=range(113), template="{a} {b} =", modulus=113)
    return model, prompts


@pytest.mark.slow
@needs_modadd
def test_modadd_embeddings_and_neurons_use_a_few_key_frequencies(modadd):
    model, prompts = modadd
    emb = fo.embedding_spectrum(model, range(113))
    # measured: 16, 38, 7, 10, 20 hold 21%, 21%, 20%, 16%, 11% (and k = 1 2%)
    assert FIVE <= set(emb.key[0]) and len(emb.key[0]) <= 8
    assert fo.key_fraction(emb.power[0], FIVE) > 0.8
    clusters = fo.neuron_clusters(model, prompts, layer=0, progress=False)
    # measured: 444 of 512 neurons (87%) have > 85% of their variance in one of the five blocks
    assert clusters.clustered_fraction > 0.75
    assert set(clusters.cluster_sizes()) <= FIVE


@pytest.mark.slow
@needs_modadd
def test_modadd_restricted_and_excluded_loss(modadd):
    model, _ = modadd
    logits = fo.modular_logits(model)
    losses = fo.modular_losses(logits, sorted(FIVE), fo.train_mask("modadd-113"))
    # measured: restricted 8.8e-6 vs full 2.9e-5 on the held-out pairs; excluded 8.24 vs 1.5e-5
    assert losses["restricted_test_loss"] < losses["test_loss"]
    assert losses["excluded_loss"] > 2.0 and losses["excluded_loss"] > 1e4 * losses["train_loss"]


@pytest.mark.slow
@needs_modadd
def test_modadd_progress_measures_move_before_the_test_loss():
    result = fo.progress([400, 4400], progress=False)
    assert result.steps == [400, 4400, 6800]
    restricted, test, excluded = result.restricted_loss, result.test_loss, result.excluded_loss
    # measured: restricted 3.02 -> 0.002 -> 0.0; test 18.5 -> 5.9 -> 0.0; excluded 0.07 -> 13.6 -> 8.2
    assert restricted[0] > 1 and restricted[1] < 0.05 and test[1] > 1  # restricted loss leads
    assert excluded[0] < 1 < 5 < excluded[1]
    assert test[2] < 1e-3 and restricted[2] < 1e-3


def test_key_fraction_takes_any_iterable_of_frequencies():
    power = torch.tensor([5.0, 1.0, 3.0, 0.0, 1.0])  # index 0 is the constant term, left out of the total
    assert fo.key_fraction(power, [2]) == pytest.approx(0.6)
    assert fo.key_fraction(power, (k for k in [2])) == pytest.approx(0.6)
    assert fo.key_fraction(power, iter([1, 4])) == pytest.approx(0.4)
    assert fo.key_fraction(power, []) == 0.0


# --- mod-T linear separability (Fu et al. 2026) -------------------------------------------------


def _numbers_as(rows_per_number, d, encode, noise=0.1, seed=0):
    """[100 · rows_per_number, d] rows: ``encode(x)`` [n, k] in a random k-plane of d dims, plus noise."""
    g = torch.Generator().manual_seed(seed)
    values = torch.arange(100).repeat(rows_per_number)
    code = encode(values.double())
    plane = torch.linalg.qr(torch.randn(d, code.shape[1], generator=g, dtype=torch.float64))[0]
    return values, code @ plane.T + noise * torch.randn(len(values), d, generator=g, dtype=torch.float64)


def _circle(period):
    return lambda x: torch.stack([(2 * math.pi * x / period).cos(), (2 * math.pi * x / period).sin()], 1) * 3


@pytest.mark.slow
def test_separability_reads_a_planted_mod_10_circle_and_not_random_numbers():
    values, acts = _numbers_as(2, 32, _circle(10))
    g = torch.Generator().manual_seed(1)
    random_init = torch.randn(100, 32, generator=g, dtype=torch.float64)[values]  # one random vector per number
    result = fo.separability(acts, values, (2, 5, 10), control=random_init)
    acc = dict(zip(result.periods, result.accuracy[0].tolist()))
    assert acc[10] > 0.95  # each residue is one point of the circle
    # x mod 5 puts opposite points of the circle in one class, x mod 2 alternates round it:
    # no line separates either, though both periods divide 10
    assert acc[5] < 0.35 and acc[2] < 0.75
    assert result.chance.tolist() == pytest.approx([0.5, 0.2, 0.1])
    assert (result.shuffled[0] < result.chance + 0.15).all()  # numbers shuffled: nothing to read
    assert (result.random_init[0] < result.chance + 0.15).all()  # a random vector per number: nothing held out
    assert result.beats_controls()[0].tolist() == [False, False, True]
    assert (result.ci >= 0).all() and (result.ci <= 1).all()
    frame = result.to_frame()
    assert set(frame.columns) >= {"period", "accuracy", "ci_low", "ci_high", "chance", "shuffled", "random_init",
                                  "beats_controls"}
    assert len(result.plot().data) == 4


def test_a_spectral_spike_need_not_be_a_mod_t_feature():
    """One cosine of period 10: the spectrum spikes at period 10, but x and 10 − x coincide, so x mod
    10 is only partly readable (6 of the 10 residues at best): the spike alone says too little."""
    values, acts = _numbers_as(1, 16, lambda x: (2 * math.pi * x / 10).cos()[:, None] * 3, noise=0.05)
    spectrum = fo.activation_spectrum(acts, numbers=range(100))
    assert spectrum.key[0] == [10]  # period 100 / 10 = 10
    result = fo.separability(acts, values, (10,))
    assert 0.3 < float(result.accuracy[0, 0]) < 0.7


def test_separability_is_seeded_and_validates_input():
    values, acts = _numbers_as(1, 8, _circle(5))
    first, second = fo.separability(acts, values, (5,)), fo.separability(acts, values, (5,))
    assert torch.equal(first.accuracy, second.accuracy) and torch.equal(first.shuffled, second.shuffled)
    with pytest.raises(ConfigError, match="whole periods|periods=.* is not accepted"):
        fo.separability(acts, values, (2.5,))
    with pytest.raises(AnalysisError, match="too few for 5 folds"):
        fo.separability(acts[:6], values[:6], (2,))
    with pytest.raises(AnalysisError, match="shape of source"):
        fo.separability(acts, values, (5,), control=acts[:, :4])
    with pytest.raises(AnalysisError, match="values has 3 entries"):
        fo.separability(acts, values[:3], (5,))
    # a period with fewer than two training numbers per class is not scored, and says why
    sparse = fo.separability(acts, values, (5, 50))
    assert math.isnan(float(sparse.accuracy[0, 1])) and sparse.meta["skipped"][0]["period"] == 50
    assert fo.integer_periods([100 / 10, 100 / 40, 100 / 3, 100], 100) == [10]


@pytest.mark.slow
def test_number_separability_compares_with_a_random_init_model(tiny):
    result = fo.number_separability(tiny, range(100), (2, 5, 10))
    assert result.series == ["embed"] and result.random_init is not None
    # a random model against another random model: nothing the training put there
    assert not result.beats_controls().any()
    # several tokens per number work too: read at the number's last token in a prompt
    layers = fo.number_representations(tiny, range(100), site="resid_post", layers=[0])
    assert list(layers) == ["L0 resid_post"] and layers["L0 resid_post"].shape == (100, 64)


@pytest.mark.slow
@needs_add100
def test_add100_embeddings_hold_x_mod_5_beyond_a_random_init_model(add100):
    model, _ = add100
    result = fo.number_separability(model, range(100), (2, 5, 10))
    acc = dict(zip(result.periods, result.accuracy[0].tolist()))
    random_init = dict(zip(result.periods, result.random_init[0].tolist()))
    # measured: mod 5 0.59 (random-init 0.21, chance 0.20); mod 2 0.70 (0.52); mod 10 0.22 (0.11)
    assert acc[5] > 0.45 and random_init[5] < 0.35
    assert result.beats_controls()[0].tolist()[1]


def test_separability_and_filter_results_round_trip(tmp_path, tiny):
    from arithinterp.tasks import arithmetic

    values, acts = _numbers_as(1, 8, _circle(10))
    result = fo.separability(acts, values, (5, 10, 50), control=acts.flip(0))
    loaded = fo.SeparabilityResult.load(result.save(tmp_path / "sep"))
    assert torch.equal(loaded.accuracy.isnan(), result.accuracy.isnan())
    assert torch.allclose(loaded.random_init.nan_to_num(), result.random_init.nan_to_num())
    assert loaded.periods == [5, 10, 50] and loaded.meta["skipped"] == result.meta["skipped"]
    no_control = fo.SeparabilityResult.load(fo.separability(acts, values, (10,)).save(tmp_path / "sep2"))
    assert no_control.random_init is None and "random_init" not in no_control.to_frame()
    prompts = arithmetic(tiny, "+", a=range(10), b=range(10), template="{a}+{b}=")
    filtered = fo.frequency_filter(tiny, prompts, "high", site="attn_out")
    again = fo.FilterResult.load(filtered.save(tmp_path / "filter"))
    assert again.drop_ci == filtered.drop_ci and again.note == filtered.note


@pytest.mark.slow
def test_report_fourier_stage_reads_digit_split_numbers_against_a_random_init_model(llama_model):
    """A random-weight Llama with one token per digit and a few-shot prefix: each number of the hundred the
    operands lie in (0..99) is read at its last token; the digit token there makes periods 10, 5, 2 spike and
    x mod 10 readable — in a random-init copy just as much, so the report calls nothing learned."""
    from arithinterp.report import Context, fourier_helix_stage
    from arithinterp.tasks import prompts_for_pairs

    model = llama_model("digit")
    a = [x for x in range(10, 60) for _ in range(2)]
    prompts = prompts_for_pairs(model, "+", a, [10 + (7 * i) % 50 for i in range(len(a))], "{a}+{b}=", few_shot=2)
    assert not prompts.single_token_operands
    section = fourier_helix_stage(Context(model, "llama", prompts, prompts, prompts.evaluate(model), None))
    assert section.sample.startswith("100 numbers (the residual stream entering layer 1 at each number's last token)")
    spectrum, separability = section.findings[0], section.findings[1]
    assert "periods 10" in spectrum and "every one of these periods is key there too" in spectrum
    assert separability.startswith("No signal above the control: x mod T is not linearly readable")
    readable = re.search(r"T=10 \(a key period\): (\d\.\d\d) .* random-init model (\d\.\d\d)", separability)
    assert readable is not None and float(readable.group(1)) >= 0.95 and float(readable.group(2)) >= 0.95
    assert section.findings[2].startswith("Helix: Not enough data")
