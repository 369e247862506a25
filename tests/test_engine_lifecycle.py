"""The engine's caches and temporary forwards: models are freed, models without blocks fall back,
every prompt-length class is checked, and the native key/value forward survives nesting."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import tiny_bridge

from arithinterp import engine, patching
from arithinterp.engine import native, stepping, steppers
from arithinterp.errors import AnalysisError
from arithinterp.tasks import arithmetic


def _pairs(model, few_shot=0, n=3):
    return arithmetic(model, a=range(6), b=range(6), few_shot=few_shot).counterfactual(vary="b", seed=0)[:n]


def test_stepped_models_are_freed_once_the_user_drops_them(number_tokenizer):
    """The stepper cache must not keep the models it has stepped alive (a sweep over checkpoints
    would grow without bound)."""
    alive = []
    for seed in range(3):
        model = tiny_bridge(number_tokenizer, seed=seed)
        result = patching.activation_patching(model, _pairs(model), "resid_pre", engine="stepped", progress=False)
        assert "stepped blocks" in result.meta["engine"][0]
        alive.append(weakref.ref(model))
        del model, result
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True, True]


def test_a_stepper_of_a_freed_model_says_so(number_tokenizer):
    model = tiny_bridge(number_tokenizer, seed=5)
    stepper = stepping.Stepper(model)
    del model
    gc.collect()
    with pytest.raises(AnalysisError, match="has been freed"):
        stepper.model  # noqa: B018


class _WithoutBlocks:
    """A user's model with the hooked-model surface (run_with_hooks, hooks, cfg, tokenizer, ...)
    delegated to a real one, but no ``blocks`` to step."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        if name == "blocks":
            raise AttributeError(name)
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)


def test_a_model_without_blocks_falls_back_to_whole_forwards(tiny_model):
    user_model = _WithoutBlocks(tiny_model)
    pairs = _pairs(tiny_model)
    reference = patching.activation_patching(tiny_model, pairs, "resid_pre", engine="hooks", progress=False)
    with pytest.warns(RuntimeWarning, match="no 'blocks'"):
        result = patching.activation_patching(user_model, pairs, "resid_pre", engine="auto", progress=False)
    assert result.meta["engine"][0].startswith("hooks: ")
    assert torch.allclose(result.values, reference.values, atol=1e-5)
    with pytest.raises(AnalysisError, match="cannot be stepped block by block"):
        patching.activation_patching(user_model, pairs, "resid_pre", engine="stepped", progress=False)


def test_every_prompt_length_class_is_checked(number_tokenizer, monkeypatch):
    """Stepping that is exact on short prompts but not on long ones (as past a sliding window)
    is caught on the first long call: the long prompts' sweep recomputes every position and
    matches whole forwards, the short prompts still reuse keys and values."""
    own = native._forward

    def wrong_past_twelve(attn, layer, hidden_states, *args, **kwargs):
        out, pattern = own(attn, layer, hidden_states, *args, **kwargs)
        cache = kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length(layer) + hidden_states.shape[1] > 12:
            out = out * 1.01
        return out, pattern

    monkeypatch.setattr(native, "_forward", wrong_past_twelve)
    model = tiny_bridge(number_tokenizer, n_layers=3, seed=6)
    short, long = _pairs(model, few_shot=0), _pairs(model, few_shot=3)
    assert short.clean.tokens.shape[1] <= 6 and long.clean.tokens.shape[1] > 12
    assert steppers.length_class(model, short.clean.tokens.shape[1]) != steppers.length_class(
        model, long.clean.tokens.shape[1])
    statuses = []
    for pairs in (short, long, short):
        fast = patching.activation_patching(model, pairs, "attn_z", layers=[0, 2], engine="stepped", progress=False)
        slow = patching.activation_patching(model, pairs, "attn_z", layers=[0, 2], engine="hooks", progress=False)
        assert (fast.values - slow.values).abs().max() <= 1e-4
        statuses.append(fast.meta["engine"][0])
    assert "keys/values reused" in statuses[0] and "every position recomputed" in statuses[1]
    assert statuses[2] == statuses[0]  # the short class keeps its own check


def test_a_length_class_is_a_power_of_two_range_and_a_side_of_each_window(tiny_model, monkeypatch):
    classes = [steppers.length_class(tiny_model, n) for n in (5, 7, 8, 15, 16)]
    assert classes[0] == classes[1] and classes[2] == classes[3] != classes[1] and classes[4] != classes[3]
    monkeypatch.setattr(tiny_model.cfg, "window_size", 6, raising=False)
    assert steppers.length_class(tiny_model, 5) != steppers.length_class(tiny_model, 7)


def _cache_reading(attention):
    return "forward" in vars(attention)


def test_the_native_cache_forward_survives_nesting_and_overlap(number_tokenizer):
    """Nested contexts (and overlapping ones, as two threads would open) keep the cache-reading
    forward until the last closes; then the module's own forward is back."""
    model = tiny_bridge(number_tokenizer, seed=7)
    blocks = list(model.blocks)
    attentions = [native._native_attention(block) for block in blocks]
    assert all(a is not None for a in attentions)
    with native.native_attention_cache(blocks):
        with native.native_attention_cache(blocks):
            assert all(_cache_reading(a) for a in attentions)
        assert all(_cache_reading(a) for a in attentions)  # the outer context still steps
    assert not any(_cache_reading(a) for a in attentions)

    first, second = native.native_attention_cache(blocks), native.native_attention_cache(blocks)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # closed before the second: not nested
    assert all(_cache_reading(a) for a in attentions)
    second.__exit__(None, None, None)
    assert not any(_cache_reading(a) for a in attentions)

    with pytest.raises(AnalysisError, match="already stepped as layer 1 and cannot be layer 0"):
        with native.native_attention_cache(blocks):
            with native.native_attention_cache(blocks[1:] + blocks[:1]):
                pass
    assert not any(_cache_reading(a) for a in attentions)


def test_a_sweep_inside_a_stepped_run_gives_the_same_numbers(number_tokenizer):
    """A sweep run while another stepped run holds the native cache forward (a callback, a
    nested analysis) gives the numbers it gives alone, and leaves the outer run stepping."""
    model = tiny_bridge(number_tokenizer, n_layers=3, seed=8)
    pairs = _pairs(model, few_shot=1)
    alone = patching.activation_patching(model, pairs, "attn_z", layers=[1], engine="stepped", progress=False)
    stepper, _ = engine.stepper_for(model, pairs.corrupt.tokens)
    assert stepper is not None and stepper.reuses_prefix
    with native.native_attention_cache(stepper.blocks):
        inside = patching.activation_patching(model, pairs, "attn_z", layers=[1], engine="stepped", progress=False)
        assert all(_cache_reading(native._native_attention(block)) for block in stepper.blocks)
    assert torch.equal(inside.values, alone.values)
