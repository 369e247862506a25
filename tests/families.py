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


def save_llama(directory: Path, tokenizer, *, n_layers: int = 2, d_model: int = 64, n_ctx: int = 256, seed: int = 0) -> Path:
    """Save a random-weight ``LlamaForCausalLM`` (RMSNorm, rotary, grouped-query attention, SwiGLU;
    the configuration of ``hf_families``) and ``tokenizer`` to ``directory``."""
    from hf_families import save_family

    directory.mkdir(parents=True, exist_ok=True)
    return save_family("llama", tokenizer, directory, seed=seed, n_layers=n_layers, d_model=d_model, n_ctx=n_ctx)


def modadd_entry(name: str, modulus: int, d_model: int, steps: int, every: int, purpose: str):
    """A one-layer zoo entry learning (a + b) mod ``modulus`` (number tokens), trained for ``steps``
    with an evaluation and snapshot every ``every`` steps: small enough to train inside a test."""
    from arithinterp.models import zoo

    return zoo.ZooEntry(
        name=name, description=f"(a + b) mod {modulus}", purpose=purpose, tokenizer="number:10",
        config=zoo._config(1, d_model, 2, 2 * d_model, 3, None),
        task=zoo.Task(op="+", a_range=(0, modulus), b_range=(0, modulus), template="{a} {b} =", modulus=modulus),
        recipe=zoo.Recipe(steps=steps, lr=3e-3, weight_decay=1.0, train_frac=0.5, eval_every=every,
                          snapshot_every=every),
        target="", prepend_bos=False,
    )
