"""random_like: a seeded random re-initialisation of any bridge model (the random-init control).

Tested on a random-weight Llama-family folder written here with transformers (no download) and
loaded the way a user loads a real checkpoint, through ``load_model(path)``.
"""

from __future__ import annotations

import pytest
import torch

import arithinterp as ai
from arithinterp.errors import ModelSpecError
from arithinterp.models import random_like


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, number_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)  # "trained" weights: not the seeds random_like is asked for below
    config = LlamaConfig(
        vocab_size=len(number_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=number_tokenizer.bos_token_id, eos_token_id=number_tokenizer.eos_token_id,
    )
    directory = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(str(directory))
    number_tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def llama(llama_dir):
    return ai.load_model(str(llama_dir))


def _weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_random_like_reinitialises_a_llama_checkpoint(llama):
    assert llama.cfg.architecture == "LlamaForCausalLM"
    state = torch.random.get_rng_state()
    control = random_like(llama, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random stream is untouched
    assert type(control) is type(llama) and not control.training
    assert control.cfg.architecture == llama.cfg.architecture
    for field in ("n_layers", "d_model", "n_heads", "d_mlp", "d_vocab"):
        assert getattr(control.cfg, field) == getattr(llama.cfg, field)
    assert control.tokenizer is llama.tokenizer
    trained, fresh = _weights(llama), _weights(control)
    assert trained.keys() == fresh.keys()
    assert all(trained[k].shape == fresh[k].shape for k in trained)
    changed = [k for k in trained if trained[k].numel() > 1 and not torch.equal(trained[k], fresh[k])]
    assert any("embed" in k for k in changed) and any("mlp" in k for k in changed)
    assert "random-init" in ai.models.model_id(control)


def test_random_like_is_seeded(llama):
    first, again, other = (_weights(random_like(llama, seed=s)) for s in (3, 3, 4))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)


def test_random_like_runs_the_analyses(llama):
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    control = random_like(llama, seed=0)
    prompts = arithmetic(llama, "+", range(5), range(5))
    acts = collect(control, prompts, sites="resid_post", positions="final", progress=False)
    trained = collect(llama, prompts, sites="resid_post", positions="final", progress=False)
    assert acts["resid_post"].shape == trained["resid_post"].shape
    assert torch.isfinite(acts["resid_post"]).all()
    assert not torch.allclose(acts["resid_post"], trained["resid_post"])


def test_random_like_of_a_zoo_model_still_works():
    zoo = ai.load_model("zoo:add-100")
    control = random_like(zoo, seed=0)
    assert control.cfg.n_layers == zoo.cfg.n_layers
    assert any(not torch.equal(a, b) for a, b in zip(zoo.parameters(), control.parameters()))


def test_random_like_rejects_what_is_not_a_model():
    with pytest.raises(ModelSpecError, match="hooked model"):
        random_like(object())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "gptj", "qwen2", "gemma2", "phi"])
def test_random_like_on_other_decoder_families(family, tmp_path, number_tokenizer):
    from hf_families import save_family

    model = ai.load_model(str(save_family(family, number_tokenizer, tmp_path, seed=1234)))
    control = random_like(model, seed=0)
    assert control.cfg.architecture == model.cfg.architecture and control.cfg.n_layers == model.cfg.n_layers
    trained, fresh = _weights(model), _weights(control)
    assert {k: v.shape for k, v in trained.items()} == {k: v.shape for k, v in fresh.items()}
    assert any(not torch.equal(trained[k], fresh[k]) for k in trained)
    tokens = model.tokenizer("12 + 34 =", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        assert torch.isfinite(control(tokens)).all()
