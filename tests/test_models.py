"""load_model(): every spec form, and clear errors for bad ones."""

import pytest
import torch

import arithinterp as ai
from arithinterp.errors import ArithInterpError, ConfigError, ModelFileError, ModelSpecError


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, bpe_tokenizer):
    """A tiny GPT-2-architecture model saved with save_pretrained, plus its tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(bpe_tokenizer), n_positions=64)
    model = GPT2LMHeadModel(config).eval()
    directory = tmp_path_factory.mktemp("tiny_gpt2")
    model.save_pretrained(str(directory))
    bpe_tokenizer.save_pretrained(str(directory))
    return directory, model


def test_local_hf_directory_round_trip(gpt2_dir):
    directory, hf_model = gpt2_dir
    model = ai.load_model(str(directory))
    assert not model.training
    tokens = model.tokenizer("12+34=56", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        expected = hf_model(tokens).logits
        got = model(tokens)
    assert (got - expected).abs().max() <= 1e-5
    assert "blocks.1.hook_resid_post" in model.hook_dict


def test_local_directory_float16(gpt2_dir):
    directory, _ = gpt2_dir
    model = ai.load_model(str(directory), dtype="float16")
    assert next(model.parameters()).dtype == torch.float16


@pytest.mark.parametrize(
    "spec, error, match",
    [
        ("zoo:nope", ModelSpecError, "the zoo has"),
        ("zoo:add-100@step=7", ArithInterpError, "snapshot"),
        ("./missing-dir", ModelFileError, "no such model"),
        ("", ModelSpecError, "non-empty"),
        ("missing.gguf", ModelFileError, "GGUF"),
    ],
)
def test_bad_specs(spec, error, match):
    with pytest.raises(error, match=match):
        ai.load_model(spec)


def test_bad_dtype():
    with pytest.raises(ConfigError, match="dtype"):
        ai.load_model("zoo:add-100", dtype="int3")


def test_directory_without_config(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelFileError, match="config.json"):
        ai.load_model(str(tmp_path))


def test_hub_id_offline_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ArithInterpError, match="Zoo models"):
        ai.load_model("no-such-org/no-such-model")


def test_transformer_lens_names_load_their_hub_model_and_offline_say_which(monkeypatch):
    """``load_model("gpt2-small")`` asks the hub for TransformerLens's official model, ``gpt2``; offline the
    error names both (nothing is downloaded: the hub call is replaced here)."""
    from transformers import AutoModelForCausalLM

    from arithinterp.models import hub_id

    assert [hub_id(n) for n in ("gpt2-small", "GPT2-Small", "pythia-70m", "gpt2", "no-such-org/no-such-model")] == [
        "gpt2", "gpt2", "EleutherAI/pythia-70m", "gpt2", "no-such-org/no-such-model"]
    asked = []

    def offline(name, **kwargs):
        asked.append(name)
        raise OSError(f"We couldn't connect to the hub to load {name}")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ArithInterpError, match="'gpt2-small' is TransformerLens's name for the hub model 'gpt2'"):
        ai.load_model("gpt2-small")
    assert asked == ["gpt2"]


def test_a_config_without_architectures_loads_by_its_class(tmp_path, number_tokenizer):
    """GGUF files (Gemma 3 270M's among them) give a config with no ``architectures``: the bridge is
    chosen from the class transformers loaded, and the model computes what that class does."""
    import json
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_families import save_family

    directory = save_family("gemma3", number_tokenizer, tmp_path / "gemma3")
    config = json.loads((directory / "config.json").read_text())
    config.pop("architectures")
    (directory / "config.json").write_text(json.dumps(config))
    model = ai.load_model(str(directory))
    reference = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    tokens = model.to_tokens("12+34=")
    with torch.inference_mode():
        assert torch.allclose(model(tokens), reference(tokens).logits, atol=1e-5)
