"""load_model("*.gguf"): a GGUF file loads as a TransformerBridge that computes what the original model does.

No GGUF file is downloaded. The test builds a tiny random Llama-architecture model in Hugging Face
transformers, writes it to a GGUF file itself (a small stand-in for llama.cpp's
``convert_hf_to_gguf.py``), loads that file with ``arithinterp.load_model`` and compares logits.

Why Llama rather than GPT-2: both are GGUF architectures transformers reads and TransformerLens
bridges, but transformers maps GPT-2's ``gpt2.context_length`` onto ``n_ctx`` rather than
``n_positions`` (the size of the position-embedding table), so a GPT-2 GGUF only loads if it has
exactly GPT-2's default 1024 positions. Llama has no such catch, is the format most GGUF files in
the wild use, and exercises the one real reshuffle llama.cpp applies (the rotary permutation of the
q/k rows), which the loader has to undo.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the 'gguf' extra is not installed; .gguf loading needs it")

import arithinterp as ai  # noqa: E402  (after the skip, so a missing extra skips rather than errors)

# Small enough to build, write and load in a few seconds on one shared CPU thread, but with
# several heads, grouped-query attention and two layers, so a wrong head permutation or a
# swapped layer would show in the logits.
N_LAYERS, D_MODEL, N_HEADS, N_KV_HEADS, D_MLP, N_CTX = 2, 64, 4, 2, 128, 64
# Not the Llama default of 10000, so the test notices if the loader ignores the file's rope base.
ROPE_THETA = 5000.0
RMS_EPS = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The test machine's cores are shared with other jobs: stay on one thread, then restore.

    Module-scoped so that it is in force before the module-scoped fixtures that build and load
    the models (pytest sets up autouse fixtures first within a scope).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows the way llama.cpp's converter does.

    Hugging Face Llama rotates the two *halves* of each head's dimensions together; ggml rotates
    *adjacent pairs*. llama.cpp therefore permutes the rows of ``q_proj``/``k_proj`` per head when
    writing a GGUF, and transformers' reader undoes it (``LlamaTensorProcessor``). Doing the same
    here makes the file a faithful llama.cpp-style GGUF, and exercises that inverse.
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tokenizer_vocab(tokenizer) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, llama.cpp token types, merges as "a b" strings) of a byte-level BPE tokenizer."""
    vocab = tokenizer.get_vocab()
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    # GGUF has no id -> token map, only a list, so the ids must be exactly 0..n-1.
    assert None not in tokens, "tokenizer ids must be contiguous to be written as a GGUF token list"
    special = set(tokenizer.all_special_ids)
    # llama.cpp token types: 1 NORMAL, 3 CONTROL. transformers makes CONTROL tokens special again.
    token_types = [3 if index in special else 1 for index in range(len(tokens))]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    # tokenizers >= 0.20 serialises a merge as a pair; GGUF (like older tokenizer.json) wants "a b".
    merges = [" ".join(merge) if isinstance(merge, (list, tuple)) else merge for merge in merges]
    return tokens, token_types, merges


def write_llama_gguf(hf_model, tokenizer, path) -> None:
    """Write a Hugging Face ``LlamaForCausalLM`` and its byte-level BPE tokenizer as a float32 GGUF.

    Mirrors what llama.cpp's ``convert_hf_to_gguf.py`` writes for a Llama model: the ``llama.*``
    hyperparameter keys transformers maps back onto ``LlamaConfig`` (``integrations/ggml.py``,
    ``GGUF_CONFIG_MAPPING["llama"]``), the ``tokenizer.ggml.*`` keys it rebuilds the tokenizer from
    (``integrations/gguf/gguf_tokenizer_mapping.py``), and the standard ggml tensor names.
    """
    config = hf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "llama")  # writes general.architecture = "llama"
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens, token_types, merges = _tokenizer_vocab(tokenizer)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE, whatever the architecture
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    # The arithmetic prompts are fed without BOS; say so, so the reloaded tokenizer agrees.
    writer.add_add_bos_token(False)

    # HF parameter name -> ggml tensor name (the names in gguf-py's TENSOR_NAMES for LLAMA).
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for layer in range(config.num_hidden_layers):
        for hf_part, ggml_part in per_layer.items():
            names[f"model.layers.{layer}.{hf_part}.weight"] = f"blk.{layer}.{ggml_part}.weight"

    state = hf_model.state_dict()
    assert set(state) == set(names), f"unexpected parameters: {set(state) ^ set(names)}"
    for hf_name, ggml_name in names.items():
        # numpy (row-major) shape is what GGUFWriter records; the reader hands the same shape back.
        weight = state[hf_name].detach().to(torch.float32).numpy().copy()
        if ggml_name.endswith("attn_q.weight"):
            weight = _llama_cpp_permute(weight, config.num_attention_heads)
        elif ggml_name.endswith("attn_k.weight"):
            weight = _llama_cpp_permute(weight, config.num_key_value_heads)
        writer.add_tensor(ggml_name, weight)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama(tokenizer, seed: int = 0):
    """A small random ``LlamaForCausalLM`` over ``tokenizer``, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=D_MODEL, intermediate_size=D_MLP, num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, max_position_embeddings=N_CTX,
        rms_norm_eps=RMS_EPS, rope_theta=ROPE_THETA, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        # The bridge forces eager attention; use it here too so the comparison is like for like.
        attn_implementation="eager",
        # Five times the default init scale: with the default the logits are so small that a
        # mis-permuted q/k or the wrong rope base moves them by under 1e-2; at 0.1 by 0.2 to 3.
        initializer_range=0.1,
    )
    hf_model = LlamaForCausalLM(config).eval()
    # Random init leaves the RMSNorm gains at exactly 1; perturb them so the test sees if a norm
    # weight is dropped or attached to the wrong layer.
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return hf_model


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory, bpe_tokenizer):
    """(path to a tiny Llama GGUF, the HF model it was written from, its tokenizer)."""
    hf_model = tiny_llama(bpe_tokenizer)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_llama_gguf(hf_model, bpe_tokenizer, path)
    return path, hf_model, bpe_tokenizer


@pytest.fixture(scope="module")
def loaded(gguf_llama):
    path, _, _ = gguf_llama
    return ai.load_model(str(path))


def test_gguf_loads_as_eval_bridge(loaded):
    from transformer_lens.model_bridge import TransformerBridge

    assert isinstance(loaded, TransformerBridge)
    assert not loaded.training
    assert all(not module.training for module in loaded.modules())
    assert loaded.cfg.n_layers == N_LAYERS and loaded.cfg.d_model == D_MODEL
    assert "blocks.1.hook_resid_post" in loaded.hook_dict
    assert loaded.arithinterp_spec.endswith("tiny-llama.gguf")


def test_gguf_logits_match_original(gguf_llama, loaded):
    _, hf_model, tokenizer = gguf_llama
    prompts = ["12+34=", "357+21=378", "99 plus 7 is 693\n0+0="]
    for prompt in prompts:
        tokens = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            expected = hf_model(tokens).logits
            got = loaded(tokens)
        assert got.shape == expected.shape
        diff = (got - expected).abs().max().item()
        assert diff <= 1e-4, f"{prompt!r}: logits differ by {diff}"
    # A batch, and a random sequence that reaches every part of the vocabulary range.
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, len(tokenizer), (2, 16), generator=generator)
    with torch.inference_mode():
        diff = (loaded(batch) - hf_model(batch).logits).abs().max().item()
    assert diff <= 1e-4, f"random batch: logits differ by {diff}"


def test_gguf_tokenizer_round_trips(gguf_llama, loaded):
    _, _, original = gguf_llama
    for prompt in ["12+34=", "357+21=378", "99 plus 7 is 693\n", "<|endoftext|>5+5="]:
        ids = loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert ids == original(prompt, add_special_tokens=False)["input_ids"], prompt
        assert loaded.tokenizer.decode(ids) == prompt
    assert loaded.tokenizer.eos_token == original.eos_token == "<|endoftext|>"
    assert loaded.tokenizer.bos_token_id == original.bos_token_id
    assert len(loaded.tokenizer) == len(original)


def test_gguf_same_name_in_working_directory(gguf_llama, tmp_path, monkeypatch):
    """A different model under the same file name in the working directory must not be loaded instead.

    Regression test: transformers takes the weights from ``gguf_file`` whenever it names an existing
    file, so passing only the file's name made a same-named file in the working directory win.
    """
    path, hf_model, tokenizer = gguf_llama
    write_llama_gguf(tiny_llama(tokenizer, seed=1), tokenizer, tmp_path / path.name)
    monkeypatch.chdir(tmp_path)
    model = ai.load_model(str(path))
    tokens = torch.tensor([tokenizer("12+34=", add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        assert (model(tokens) - hf_model(tokens).logits).abs().max() <= 1e-4


def test_gguf_float16(gguf_llama):
    path, _, _ = gguf_llama
    model = ai.load_model(str(path), dtype="float16")
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float16}
    assert not model.training


def test_gguf_directory_is_not_a_file(tmp_path):
    from arithinterp.errors import ModelFileError

    (tmp_path / "model.gguf").mkdir()
    with pytest.raises(ModelFileError, match="no such GGUF file"):
        ai.load_model(str(tmp_path / "model.gguf"))
