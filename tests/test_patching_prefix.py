"""Patches in the shared prefix of a counterfactual pair: the base and the source prompt agree on
every token up to there, so (attention being causal) the patched run is the base run. The sweep
gives those cells the base run's value without a forward, on both engines, and computing them
gives the same numbers."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_bridge

from arithinterp import patching
from arithinterp.engine import PatchRunner
from arithinterp.tasks import arithmetic


@pytest.fixture(scope="module")
def few_shot(number_tokenizer):
    """A 3-layer model and pairs behind a two-example prefix, the second operand varied."""
    model = tiny_bridge(number_tokenizer, n_layers=3, n_ctx=32, seed=1)
    prompts = arithmetic(model, a=range(10), b=range(10), few_shot=2)
    return model, prompts.counterfactual(vary="b", seed=0)[:4]


def _first_difference(pairs) -> int:
    """The first position at which any pair's prompts differ (equal-length prompts)."""
    differs = (pairs.clean.tokens != pairs.corrupt.tokens).any(0)
    return int(differs.int().argmax())


@pytest.mark.parametrize("engine", ["stepped", "hooks"])
def test_shared_prefix_cells_take_the_base_value_without_a_forward(few_shot, engine, monkeypatch):
    model, pairs = few_shot
    assert pairs.clean.uniform_length and pairs.corrupt.uniform_length
    first = _first_difference(pairs)
    assert first > 5  # the few-shot prefix and the first operand are shared

    patched_positions = []
    original = PatchRunner.patched

    def record(self, layer, pos, unit):
        patched_positions.append(None if pos is None else pos.clone())
        return original(self, layer, pos, unit)

    monkeypatch.setattr(PatchRunner, "patched", record)
    result = patching.activation_patching(model, pairs, "resid_pre", engine=engine, progress=False)
    # the shared prefix: exactly the corrupted (base) run, for every pair, layer and position
    base = result.corrupt_baseline[:, None, None].expand(-1, result.values.shape[1], first)
    assert torch.equal(result.values[:, :, :first], base)
    # and no forward patched any of those positions
    assert patched_positions and all(int(p.min()) >= first for p in patched_positions if p is not None)
    n_layers, width = model.cfg.n_layers, int(pairs.clean.tokens.shape[1])
    assert result.meta["cells_run"] <= n_layers * (width - first)
    assert result.meta["cells_settled"] >= n_layers * first


def test_shared_prefix_cells_equal_the_computed_values(few_shot):
    """Computing the skipped cells with whole forwards gives the base run's logits (to float precision)."""
    model, pairs = few_shot
    first = _first_difference(pairs)
    runner = PatchRunner(model, None, "resid_pre", pairs.corrupt.tokens, pairs.clean.tokens)
    B = len(pairs)
    for layer in range(model.cfg.n_layers):
        pos = torch.arange(first)[:, None].expand(first, B)  # one cell per shared position
        logits = runner.patched(layer, pos, None)  # [C, B, V]
        assert (logits - runner.base_logits[None]).abs().max() <= 1e-5
    # and a cell at the first differing position does change the run: the shortcut is not everywhere
    changed = runner.patched(0, torch.full((1, B), first), None)
    assert (changed - runner.base_logits[None]).abs().max() > 1e-3
    # the sweep's skipped values agree with those computed
    swept = patching.activation_patching(model, pairs, "resid_pre", engine="hooks", progress=False)
    for layer in range(model.cfg.n_layers):
        assert torch.equal(swept.values[:, layer, :first], swept.corrupt_baseline[:, None].expand(-1, first))


def test_the_token_check_settles_cells_whose_activations_differ_in_the_last_bit(few_shot, monkeypatch):
    """Whole forwards of different batches need not agree bit for bit; the tokens decide, not the floats."""
    model, pairs = few_shot
    first = _first_difference(pairs)
    runner = PatchRunner(model, None, "resid_pre", pairs.corrupt.tokens, pairs.clean.tokens)
    runner.source_acts = [a + 1e-7 * torch.randn_like(a) for a in runner.source_acts]  # noise everywhere
    pos = torch.arange(runner.tokens.shape[1])[:, None].expand(-1, len(pairs))
    states = runner.cell_states(1, pos, None)  # [positions, pairs]
    from arithinterp.engine.patches import RUN, UNCHANGED

    assert bool((states[:first] == UNCHANGED).all()) and bool((states[first:] == RUN).all())
