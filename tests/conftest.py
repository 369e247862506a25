"""Shared fixtures: tiny randomly initialised hooked models and the three tokenizer kinds."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)  # the models are tiny: one thread avoids contention overhead


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
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    texts = [f"{a}+{b}={a + b}\n{a} plus {b} is {a * b}" for a in range(0, 400, 3) for b in range(0, 60, 7)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    directory = tmp_path_factory.mktemp("bpe_tok")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(str(directory))
    return PreTrainedTokenizerFast.from_pretrained(str(directory))


def tiny_bridge(tokenizer, n_layers: int = 2, d_model: int = 64, n_ctx: int = 32, seed: int = 0, norm="LN"):
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(
        d_model=d_model, d_head=16, n_heads=d_model // 16, n_layers=n_layers, n_ctx=n_ctx, d_mlp=2 * d_model,
        d_vocab=len(tokenizer), act_fn="relu", normalization_type=norm, seed=seed,
    )
    return TransformerBridge.boot_native(cfg, tokenizer=tokenizer).eval()


@pytest.fixture(scope="session")
def tiny_model(number_tokenizer):
    """A 2-layer random model over the number tokenizer (numbers 0..198 are single tokens)."""
    return tiny_bridge(number_tokenizer)


@pytest.fixture(scope="session")
def tiny_digit_model(digit_tokenizer):
    return tiny_bridge(digit_tokenizer)
