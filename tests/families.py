"""Random-weight Hugging Face model folders of real decoder families, built in the tests.

Each folder holds ``config.json``, safetensors weights (``save_pretrained``) and a fast tokenizer
(``PreTrainedTokenizerFast.save_pretrained``), so ``arithinterp.load_model(path)`` loads it the
way it loads a downloaded checkpoint. Tokenizers come in the three regimes real models have:

* ``"number"`` — one token per number (the zoo; GPT-J up to 520; Llama 3 in 3-digit chunks);
* ``"digit"`` — one token per digit (Llama 2, Gemma, Qwen, SmolLM);
* ``"bpe"`` — irregular byte-level BPE splits trained here (GPT-2-like).
"""

from __future__ import annotations

from pathlib import Path

import torch

REGIMES = ("number", "digit", "bpe")


def bpe_tokenizer():
    """A GPT-2-style byte-level BPE tokenizer trained on arithmetic text: numbers split irregularly."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    texts = [f"{a}+{b}={a + b}\n{a} plus {b} is {a * b}" for a in range(0, 400, 3) for b in range(0, 60, 7)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def tokenizer_for(regime: str, max_number: int = 400):
    """A tokenizer of one regime (``"number"`` covers 0..``max_number`` as single tokens)."""
    from arithinterp.models.tokenizers import digit_tokenizer, number_tokenizer

    if regime == "number":
        return number_tokenizer(max_number)
    if regime == "digit":
        return digit_tokenizer()
    if regime == "bpe":
        return bpe_tokenizer()
    raise ValueError(f"unknown tokenizer regime {regime!r}; accepted: {REGIMES}")


def save_llama(directory: Path, tokenizer, *, n_layers: int = 2, d_model: int = 64, n_heads: int = 4,
               n_kv_heads: int = 2, d_mlp: int = 128, n_ctx: int = 256, seed: int = 0) -> Path:
    """Save a random-weight ``LlamaForCausalLM`` (RMSNorm, rotary, grouped-query attention, SwiGLU)
    and ``tokenizer`` to ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=d_model, intermediate_size=d_mlp, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, max_position_embeddings=n_ctx,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # random init gives tiny logits; larger weights make the greedy answers depend on the prompt
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory
