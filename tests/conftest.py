"""Shared fixtures: tiny randomly initialised hooked models and the three tokenizer kinds."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: so do the processes a test starts
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # (benchmark scripts, notebook kernels, sweep workers)
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # the models are tiny: one thread avoids contention overhead


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what exists once collection ends (modules, test functions, parameters) out of the garbage
    collector's view: its full collections, which otherwise walk all of it again and again while the
    tests build and drop models, then only walk what the tests create."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The notebooks (each a minute of work on one core) run first, so that the workers share out
    the shorter tests behind them instead of one worker finishing a notebook alone at the end."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_notebooks.py"))


@pytest.fixture(scope="session")
def number_tokenizer(tmp_path_factory):
    from arithinterp.models.tokenizers import number_tokenizer, save_and_reload

    return save_and_reload(number_tokenizer(198), tmp_path_factory.mktemp("number_tok"))


@pytest.fixture(scope="session")
def digit_tokenizer(tmp_path_factory):
    from arithinterp.models.tokenizers import digit_tokenizer, save_and_reload

    return save_and_reload(digit_tokenizer(), tmp_path_factory.mktemp("digit_tok"))


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory):
    """A GPT-2-style byte-level BPE tokenizer trained here (no download): numbers split irregularly."""
    from families import bpe_tokenizer
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("bpe_tok")
    bpe_tokenizer().save_pretrained(str(directory))
    return PreTrainedTokenizerFast.from_pretrained(str(directory))


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory):
    """``llama_folder(regime, **shape)`` → a saved random-weight Llama folder (``config.json``,
    safetensors, fast tokenizer) whose tokenizer is of ``regime`` ``"number"``, ``"digit"`` or
    ``"bpe"`` (see ``families.py``); tiny by default (2 layers, d 64). Built once per arguments."""
    from families import save_llama, tokenizer_for

    made = {}

    def make(regime: str = "digit", **shape):
        key = (regime, tuple(sorted(shape.items())))
        if key not in made:
            made[key] = save_llama(tmp_path_factory.mktemp(f"llama_{regime}"), tokenizer_for(regime), **shape)
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_model(llama_folder):
    """``llama_model(regime)`` → the tiny Llama folder of that regime loaded with ``load_model``."""
    from arithinterp import load_model

    loaded = {}

    def load(regime: str = "digit"):
        if regime not in loaded:
            loaded[regime] = load_model(str(llama_folder(regime)))
        return loaded[regime]

    return load


def tiny_bridge(tokenizer, n_layers: int = 2, d_model: int = 64, n_ctx: int = 32, seed: int = 0,
                norm: "str | None" = "LN", **overrides):
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    settings = dict(
        d_model=d_model, d_head=16, n_heads=d_model // 16, n_layers=n_layers, n_ctx=n_ctx, d_mlp=2 * d_model,
        d_vocab=len(tokenizer), act_fn="relu", normalization_type=norm, seed=seed,
    )
    cfg = TransformerBridgeConfig(**{**settings, **overrides})
    return TransformerBridge.boot_native(cfg, tokenizer=tokenizer).eval()


@pytest.fixture(scope="session")
def tiny_model(number_tokenizer):
    """A 2-layer random model over the number tokenizer (numbers 0..198 are single tokens)."""
    return tiny_bridge(number_tokenizer)


@pytest.fixture(scope="session")
def tiny_digit_model(digit_tokenizer):
    return tiny_bridge(digit_tokenizer)
