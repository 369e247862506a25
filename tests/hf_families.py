"""Random-weight Hugging Face folders of the decoder families the arithmetic papers study.

Each is built here from a ``transformers`` config (2 layers, d_model 64) with a word-level number
tokenizer and saved as a local folder, so loading goes through ``load_model(path)`` exactly as a
user's checkpoint would. Weights are drawn wider than the library default so that patches move
the logits by amounts a tolerance can tell apart.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("gpt2", "gpt_neox", "gptj", "llama", "qwen2", "gemma2", "gemma3", "phi")


def family_config(family: str, vocab_size: int, n_layers: int = 2, d_model: int = 64, n_ctx: int = 128):
    """A small ``transformers`` config of ``family`` with that family's distinctive features."""
    import transformers as T

    common = dict(vocab_size=vocab_size, initializer_range=0.2)
    if family == "gpt2":
        return T.GPT2Config(n_embd=d_model, n_layer=n_layers, n_head=4, n_positions=n_ctx, **common)
    if family == "gpt_neox":  # parallel attention and MLP, rotary on a quarter of each head
        return T.GPTNeoXConfig(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=4, intermediate_size=4 * d_model,
                               rotary_pct=0.25, use_parallel_residual=True, max_position_embeddings=n_ctx, **common)
    if family == "gptj":  # parallel blocks, interleaved partial rotary
        return T.GPTJConfig(n_embd=d_model, n_layer=n_layers, n_head=4, rotary_dim=8, n_positions=n_ctx, **common)
    if family == "llama":  # grouped-query attention, gated MLP, RMSNorm
        return T.LlamaConfig(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=2 * d_model, max_position_embeddings=n_ctx, **common)
    if family == "qwen2":  # like Llama, with biases on q, k, v
        return T.Qwen2Config(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=2 * d_model, max_position_embeddings=n_ctx, **common)
    if family == "gemma2":  # soft-capped attention and logits, extra norms, sliding-window layers
        return T.Gemma2Config(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              intermediate_size=2 * d_model, max_position_embeddings=n_ctx, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0, sliding_window=16, **common)
    if family == "gemma3":  # QK-norm, post-norms on both branches, sliding/global layers with their own rope bases
        return T.Gemma3TextConfig(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=1,
                                  head_dim=16, intermediate_size=2 * d_model, max_position_embeddings=n_ctx, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention"] * (n_layers // 2) + ["sliding_attention"] * (n_layers % 2),
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                                  query_pre_attn_scalar=16, **common)
    if family == "phi":  # parallel blocks, partial rotary, dense biases
        return T.PhiConfig(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=4, intermediate_size=2 * d_model,
                           partial_rotary_factor=0.5, max_position_embeddings=n_ctx, **common)
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


def save_family(family: str, tokenizer, directory: Path, seed: int = 0, **config_kw) -> Path:
    """Save a random-weight ``family`` model with ``tokenizer`` as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(family, len(tokenizer), **config_kw)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory
