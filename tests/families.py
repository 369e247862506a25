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


FAMILIES = ("llama", "gpt2", "gpt_neox", "qwen2", "gemma2", "phi3")


def save_family(directory: Path, family: str, tokenizer, *, seed: int = 0) -> Path:
    """Save a tiny random-weight causal LM of ``family`` (2 layers, d 64) and ``tokenizer``."""
    import transformers as hf

    if family == "llama":
        return save_llama(directory, tokenizer, seed=seed)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=256)
    grouped = dict(shape, num_key_value_heads=2)
    configs = {
        "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel, dict(n_layer=2, n_embd=64, n_head=4, n_positions=256)),
        "gpt_neox": (hf.GPTNeoXConfig, hf.GPTNeoXForCausalLM, shape),
        "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, grouped),
        "gemma2": (hf.Gemma2Config, hf.Gemma2ForCausalLM, dict(grouped, head_dim=16)),  # soft-capped logits
        "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM, grouped),
    }
    if family not in configs:
        raise ValueError(f"unknown family {family!r}; accepted: {FAMILIES}")
    config_class, model_class, options = configs[family]
    config = config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **options)
    torch.manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    model_class(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory
