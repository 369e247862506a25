"""Pretrained-style models end to end: random-weight Llama folders in the three tokenizer regimes
(one token per number, one per digit, irregular BPE) loaded with ``load_model(path)``."""

import pytest
import torch
from hf_families import FAMILIES, save_family

from arithinterp import fourier, helix, load_model, neurons, patching, probes
from arithinterp.activations import collect
from arithinterp.engine import decode
from arithinterp.errors import ConfigError, ModelSpecError, SiteError
from arithinterp.tasks import arithmetic, prompts_for_pairs

REGIMES = ("number", "digit", "bpe")
POSITIONS = ["a", "a[0]", "a[-1]", "b", "b[0]", "b[-1]", "final", "final-1", "answer[0]"]


@pytest.fixture(scope="module", params=REGIMES)
def regime(request):
    return request.param


def plain_greedy(model, prompts):
    """The reference: append the argmax of the plain forward's last logits, once per answer token."""
    out = torch.empty_like(prompts.answer_tokens)
    for group in prompts.length_groups():
        tokens = prompts.unpadded(group)
        for step in range(prompts.answer_tokens.shape[1]):
            out[group, step] = model(tokens, return_type="logits")[:, -1].argmax(-1)
            tokens = torch.cat([tokens, out[group, step : step + 1]], dim=1)
    return out


def plain_logprob(model, prompts):
    total = torch.zeros(len(prompts))
    k = prompts.answer_tokens.shape[1] if prompts.scoring == "full-answer" else 1
    for group in prompts.length_groups():
        answer = prompts.answer_tokens[group, :k]
        fed = torch.cat([prompts.unpadded(group), answer[:, :-1].clamp(min=0)], dim=1)
        logits = model(fed, return_type="logits")[:, -answer.shape[1]:].float().log_softmax(-1)
        total[group] = (logits.gather(-1, answer.clamp(min=0)[..., None])[..., 0] * (answer >= 0)).sum(-1)
    return total


def test_tokenizer_regimes_split_numbers_as_intended(llama_model):
    pieces = {r: llama_model(r).tokenizer.tokenize("257") for r in REGIMES}
    assert len(pieces["number"]) == 1 and len(pieces["digit"]) == 3
    split = [len(llama_model("bpe").tokenizer.tokenize(str(x))) for x in range(400)]
    assert min(split) == 1 and max(split) >= 2  # BPE: some numbers whole, some in pieces


def test_evaluate_gives_the_plain_forward_greedy_answers(llama_model, regime):
    model = llama_model(regime)
    prompts = arithmetic(model, a=range(0, 100, 9), b=range(3, 100, 13), few_shot=2)
    evaluation = prompts.evaluate(model)
    assert decode.decode_mode(model) == "cached"  # the key/value cache is used ...
    reference = plain_greedy(model, prompts)
    assert torch.equal(evaluation.generated_tokens, reference)  # ... and changes no token
    assert torch.equal(prompts.evaluate(model, batch_size=5).generated_tokens, reference)
    scored = prompts.with_scoring("full-answer")
    assert torch.allclose(scored.answer_logprob(model), plain_logprob(model, scored), atol=1e-4)
    assert torch.allclose(prompts.answer_logprob(model), plain_logprob(model, prompts), atol=1e-4)


def test_evaluate_on_native_models_and_under_hooks(tiny_digit_model, llama_model):
    prompts = arithmetic(tiny_digit_model, a=range(0, 60, 7), b=range(5, 60, 11))
    assert torch.equal(prompts.evaluate(tiny_digit_model).generated_tokens, plain_greedy(tiny_digit_model, prompts))
    assert decode.decode_mode(tiny_digit_model) == "stepped"  # native models: the engine's stepper and its cache
    model = llama_model("digit")
    prompts = arithmetic(model, a=range(0, 60, 7), b=range(5, 60, 11))

    def erase_earlier(x, hook):  # depends on the sequence it is shown: a cached step shows one token
        x[:, :-1] = 0
        return x

    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", erase_earlier)]):
        assert decode.decode_mode(model) == "full"  # hooks attached: the plain forward
        hooked = prompts.evaluate(model).generated_tokens
        assert torch.equal(hooked, plain_greedy(model, prompts))
    assert not torch.equal(hooked, prompts.evaluate(model).generated_tokens)
    assert decode.decode_mode(model) == "cached"  # hooks gone: the cache again


def test_collect_at_every_named_position(llama_model, regime):
    model = llama_model(regime)
    prompts = prompts_for_pairs(model, "+", [7, 47, 128, 305], [62, 5, 250, 31], "{a}+{b}=")
    acts = collect(model, prompts, sites="resid_post", layers=[1], positions=POSITIONS, progress=False)
    assert acts.positions == POSITIONS
    tokenizer = model.tokenizer
    for i in range(len(prompts)):
        start = prompts.tokens.shape[1] - int(prompts.lengths[i])
        fed = torch.cat([prompts.tokens[i, start:], prompts.answer_tokens[i, :1]])
        _, cache = model.run_with_cache(fed[None])
        for j, spec in enumerate(POSITIONS):
            column = int(prompts.locate(spec, answers=1)[1][i, 0]) - start
            assert torch.allclose(acts["resid_post"][i, 0, j], cache["blocks.1.hook_resid_post"][0, column], atol=1e-5)
        a = str(int(prompts.a[i]))
        first = tokenizer.decode(fed[int(prompts.positions["a[0]"][i]) - start : int(prompts.positions["a"][i]) - start + 1].tolist())
        assert first.replace(" ", "") == a  # a[0] .. a spans exactly the number's tokens


def test_positions_that_do_not_exist_are_refused(llama_model):
    model = llama_model("digit")
    prompts = prompts_for_pairs(model, "+", [7, 47], [6, 5], "{a}+{b}=")
    with pytest.raises(SiteError, match="different lengths"):
        collect(model, prompts, positions=[0], progress=False)
    with pytest.raises(SiteError, match="has 1 token"):
        collect(model, prompts, positions=["a[1]"], progress=False)
    with pytest.raises(SiteError, match="outside the prompt"):
        prompts.locate("a[0]-9")
    with pytest.raises(SiteError, match="past 'final'"):
        prompts.locate("answer[0]")
    same = prompts_for_pairs(model, "+", [17, 47], [62, 15], "{a}+{b}=")
    with pytest.raises(SiteError, match="out of range"):
        collect(model, same, positions=[99], progress=False)
    with pytest.raises(SiteError, match="out of range"):
        patching.ablate(model, same, ["L0H0@99"])
    assert same.locate(-1)[1].tolist() == same.locate("final")[1].tolist()


@pytest.mark.slow
def test_patching_probes_helix_fourier_neurons_run(llama_model, regime):
    model = llama_model(regime)
    prompts = arithmetic(model, a=range(100), b=[3, 14])
    pairs = prompts.counterfactual(vary="a", seed=0)
    sweep = patching.activation_patching(model, pairs[:40], site="resid_pre", positions=["a[0]", "a", "final"], progress=False)
    assert sweep.mean.shape == (2, 3) and torch.isfinite(sweep.mean).all()
    acts = collect(model, prompts, sites="resid_pre", layers=[0, 1], positions=["a", "a[0]", "final"], progress=False)
    probe = probes.probe_layers(acts, target="a_units", cv=2, controls=(), progress=False)
    assert probe.to_frame().score.between(0, 1).all()
    fit = helix.fit(acts, "a", layer=1, positions="a", n_pca=20)
    test = helix.patch_test(model, pairs[:30], fit, layer=1)
    assert test.methods[:3] == ["layer patch", "PCA-9", "helix"] and torch.isfinite(test.effect).all()
    spectrum = fourier.spectrum(acts, range(100), site="resid_pre", positions="a")
    assert spectrum.power.shape == (2, 51)
    in_context = fourier.spectrum(model, range(100), site="resid_post", layers=[1])
    assert in_context.power.shape == (1, 51) and in_context.meta["position"] == "a"
    grid = arithmetic(model, a=range(10, 30), b=range(10, 30))  # a two-digit grid
    table = neurons.classify(model, grid, layers=[1], top_k=8)
    assert len(table.layer) == 8 and table.labels.shape[0] == 8


def test_embedding_spectrum_of_digit_split_numbers_reads_the_last_digit(llama_model):
    model = llama_model("digit")
    result = fourier.spectrum(model, range(100), site="embed")
    power = result.series_power(0)
    # the embedding at a two-digit number's last token is that of its units digit: period 10 only
    assert float(power[torch.arange(51) % 10 != 0][1:].sum()) < 1e-6 * float(power[1:].sum())
    assert result.meta["operand_tokens"] == 2


def test_planted_helix_is_found_on_digit_split_prompts(digit_tokenizer):
    from arithinterp.activations import Activations

    prompts = arithmetic(digit_tokenizer, a=range(100), b=[3])
    assert prompts.meta["operand_tokens"]["max"] == 2
    g = torch.Generator().manual_seed(0)
    design = helix.helix_basis(prompts.a.double(), (2, 5, 10, 100))[:, :-1]
    planted = (design @ torch.randn(design.shape[1], 48, generator=g, dtype=torch.float64)).float()
    planted = planted + 0.02 * torch.randn(planted.shape, generator=g)
    acts = Activations({"resid_pre": planted[:, None, None]}, layers=[0], positions=["a"], prompts=prompts)
    fit = helix.fit(acts, "a", (2, 5, 10, 100), n_pca=20)
    assert fit.r2_overall > 0.95
    shuffled = helix.fit(acts, prompts.a[torch.randperm(100, generator=g)], (2, 5, 10, 100), n_pca=20)
    assert shuffled.r2_overall < 0.5
    result = fourier.spectrum(acts, range(100), site="resid_pre", positions="a")
    assert set(result.key[0]) >= {10, 20, 50}  # periods 10, 5, 2 of the planted helix


def test_load_model_dtype_and_device_map(llama_folder, monkeypatch):
    from transformers import AutoModelForCausalLM

    calls, original = [], AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    path = str(llama_folder("digit"))
    model = load_model(path, dtype="bfloat16", device_map="cpu")
    assert calls[-1]["device_map"] == "cpu" and calls[-1]["dtype"] == torch.bfloat16  # handed to Hugging Face
    assert next(model.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).device.type == "cpu"
    prompts = arithmetic(model, a=range(0, 40, 7), b=[3, 8])
    assert torch.equal(prompts.evaluate(model).generated_tokens, plain_greedy(model, prompts))
    with pytest.raises(ModelSpecError, match="device= or device_map"):
        load_model(path, device="cpu", device_map="cpu")
    with pytest.raises(ModelSpecError, match="TransformerLens-native"):
        load_model("zoo:add-100", device_map="cpu")


def test_ablate_at_operand_token_positions(llama_model):
    model = llama_model("digit")
    prompts = arithmetic(model, a=range(10, 40, 3), b=range(10, 40, 7))
    first = patching.ablate(model, prompts, ["attn1@a[0]", "mlp0@final-1"], ablation="zero")
    assert first.logprob_after.shape == (len(prompts),)
    assert not torch.allclose(first.logprob_after, first.logprob_before)


def test_batch_size_follows_the_memory_budget(llama_model):
    model = llama_model("digit")
    small = decode.batch_size_for(model, 40, n_new=3, budget_bytes=2**22)
    big = decode.batch_size_for(model, 40, n_new=3, budget_bytes=2**26)
    assert 1 <= small < big
    assert decode.batch_size_for(model, 200, n_new=3, budget_bytes=2**26) < big  # longer prompts, fewer at once
    with pytest.raises(ConfigError, match=r"PromptSet\.evaluate: batch_size=0 is not accepted .*a positive int"):
        arithmetic(model, a=[1], b=[2]).evaluate(model, batch_size=0)


def test_neuron_maps_of_a_two_digit_grid_are_arranged_by_value(llama_model):
    model = llama_model("digit")
    grid = arithmetic(model, a=range(5, 25), b=range(5, 25))  # 1- and 2-digit operands: 4 token lengths
    assert len(set(grid.lengths.tolist())) > 1
    result = neurons.maps(model, grid, neurons=(torch.tensor([1, 1]), torch.tensor([0, 5])))
    acts = collect(model, grid, sites="mlp_post", layers=[1], positions="final", progress=False)
    cells = result.k_maps[1, grid.a - 5, grid.b - 5]
    assert torch.allclose(cells, acts["mlp_post"][:, 0, 0, 5], atol=1e-5)  # each cell is its own prompt's value
    # a heuristic planted into one map over this grid is found (Nikankin et al. 2025)
    A = torch.tensor(result.a_values)[:, None].expand(20, 20)
    g = torch.Generator().manual_seed(0)
    k_maps = result.k_maps.clone()
    k_maps[0] = torch.relu((A % 5 == 2).float() + 0.2 * torch.randn(20, 20, generator=g))
    table = neurons.classify_maps(k_maps, result.kv_maps, result.a_values, result.b_values, "+")
    assert "a mod 5 = 2" in table.neuron_labels(0)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_cached_greedy_decoding_in_other_families(family, tmp_path):
    from families import tokenizer_for

    model = load_model(str(save_family(family, tokenizer_for("digit"), tmp_path)))
    prompts = arithmetic(model, a=range(0, 60, 7), b=range(5, 60, 11))
    assert torch.equal(prompts.evaluate(model).generated_tokens, plain_greedy(model, prompts))
    assert decode.decode_mode(model) == "cached"
