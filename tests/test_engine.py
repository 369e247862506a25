"""The engine's interventions and reads as data (arithinterp.engine.forward)."""

from __future__ import annotations

import pytest
import torch

from arithinterp import engine
from arithinterp.errors import AnalysisError, TaskError


@pytest.fixture(scope="module")
def tokens(tiny_model):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 100, (5, 7), generator=g)


def _hooked_logits(model, tokens, name, fn):
    with torch.inference_mode():
        return model.run_with_hooks(tokens, fwd_hooks=[(name, fn)])[:, -1].float()


def test_one_position_per_prompt_takes_a_value_without_a_position_axis(tiny_model, tokens):
    B = tokens.shape[0]
    pos = torch.tensor([0, 2, 4, 6, 1])
    value = torch.randn(B, 64, generator=torch.Generator().manual_seed(1))  # [B, d]: one vector per prompt
    out = engine.run(tiny_model, tokens, [engine.Write("resid_pre", 1, pos, value=value)],
                     reads=[engine.Read("resid_pre", 1, pos), engine.Read("resid_pre", 1)])

    def patch(act, hook):
        act = act.clone()
        act[torch.arange(B), pos] = value
        return act

    assert torch.allclose(out.logits, _hooked_logits(tiny_model, tokens, "blocks.1.hook_resid_pre", patch), atol=1e-5)
    # a read at the patched hook sees the activation before later hooks change it: the model's own
    assert out.reads[0].shape == (B, 64) and out.reads[1].shape == (B, 7, 64)
    assert torch.equal(out.reads[0], out.reads[1][torch.arange(B), pos])


def test_a_function_value_sees_the_selected_units_at_one_position(tiny_model, tokens):
    B = tokens.shape[0]
    pos = torch.full((B,), 3)
    seen = {}

    def halve(current):
        seen["shape"] = tuple(current.shape)
        return current / 2

    out = engine.run(tiny_model, tokens, [engine.Write("mlp_post", 0, pos, units=[5, 9], value=halve)])

    def patch(act, hook):
        act = act.clone()
        act[:, 3, [5, 9]] /= 2
        return act

    assert seen["shape"] == (B, 2)
    assert torch.allclose(out.logits, _hooked_logits(tiny_model, tokens, "blocks.0.mlp.hook_post", patch), atol=1e-5)


def test_an_int_position_is_the_same_in_every_prompt_and_may_count_from_the_end(tiny_model, tokens):
    zero_last = engine.Write("mlp_out", 1, -1, value=0.0)
    out = engine.run(tiny_model, tokens, [zero_last], reads=[engine.Read("mlp_out", 1, -1), engine.Read("resid_post", 1, -1)])

    def patch(act, hook):
        act = act.clone()
        act[:, -1] = 0
        return act

    assert torch.allclose(out.logits, _hooked_logits(tiny_model, tokens, "blocks.1.hook_mlp_out", patch), atol=1e-5)
    assert out.reads[0].shape == (tokens.shape[0], 64)
    # the same intervention on a longer input still acts on its last token
    longer = torch.cat([tokens, tokens[:, :2]], 1)
    again = engine.run(tiny_model, longer, [zero_last])
    assert torch.allclose(again.logits, _hooked_logits(tiny_model, longer, "blocks.1.hook_mlp_out", patch), atol=1e-5)


def test_a_write_of_the_whole_activation_leaves_what_computed_it_out_of_the_backward():
    """A frozen pattern or a replaced MLP output keeps no autograd link to the value it replaces (the
    backward of an attribution graph does not run through queries, keys or the real MLP); a write of
    some positions keeps the rest linked, and a function value stays differentiable in its input."""
    computed = torch.ones(2, 3, 4, requires_grad=True) * 2.0
    assert not engine.Write("mlp_out", value=torch.zeros(2, 3, 4)).apply(computed).requires_grad
    assert engine.Write("mlp_out", positions=1, value=0.0).apply(computed).requires_grad
    doubled = engine.Write("mlp_out", value=lambda x: 2 * x).apply(computed)
    assert torch.equal(doubled, 2 * computed.detach()) and doubled.requires_grad


def test_positions_of_the_wrong_shape_are_refused(tiny_model, tokens):
    with pytest.raises(AnalysisError, match="B = 5"):
        engine.run(tiny_model, tokens, [engine.Write("resid_pre", 0, torch.zeros(3, dtype=torch.long))])
    with pytest.raises(AnalysisError, match="positions must be"):
        engine.run(tiny_model, tokens, reads=[engine.Read("resid_pre", 0, "final")], logits="none")


def test_evaluate_applies_interventions_in_every_generated_step(tiny_digit_model):
    from arithinterp.tasks import arithmetic

    model = tiny_digit_model
    prompts = arithmetic(model, "+", a=range(10, 20), b=range(10, 15), template="{a}+{b}=")
    assert prompts.answer_tokens.shape[1] > 1  # several answer tokens: several forwards per prompt
    plain = prompts.evaluate(model)
    zeroed = prompts.evaluate(model, writes=[engine.Write("resid_post", 1, None, value=0.0)])
    # with the final residual zeroed the logits no longer depend on the input: one token everywhere
    assert plain.generated_tokens.unique().numel() > 1
    assert zeroed.generated_tokens.unique().numel() == 1
    same = prompts.evaluate(model, writes=[engine.Write("resid_post", 1, -1, value=lambda h: h)])
    assert torch.equal(same.generated_tokens, plain.generated_tokens)
    with pytest.raises(TaskError, match="None or an int"):
        prompts.evaluate(model, writes=[engine.Write("resid_post", 1, torch.zeros(50, dtype=torch.long))])


def test_run_refuses_positions_and_units_out_of_range(tiny_model):
    """Out-of-range positions and units are refused, never wrapped around."""
    from arithinterp.engine import Write, Read, run
    from arithinterp.errors import SiteError

    tokens = torch.randint(3, 50, (2, 5))
    with pytest.raises(SiteError, match="outside prompts of 5 tokens"):
        run(tiny_model, tokens, reads=[Read("resid_pre", 0, torch.tensor([1, 7]))])
    with pytest.raises(SiteError, match="out of range"):
        run(tiny_model, tokens, [Write("attn_z", 0, None, [99], 0.0)])
    with pytest.raises(SiteError, match="units"):
        run(tiny_model, tokens, [Write("resid_pre", 0, None, [0], 0.0)])


def test_a_running_mean_over_batches_is_the_mean_activation_of_all_of_them():
    """Batches of different widths and lengths combine, aligned from the prompts' end, into exactly
    what mean_activation gives for the whole reference set at once."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 5, 5, 2, 4, 5, 1])
    frame = torch.randn(7, 5, 2, 3, generator=generator)  # [N, T, ...], left-padded
    frame[torch.arange(5)[None, :] < (5 - lengths)[:, None]] = 1e6  # padding must never count
    expected = engine.mean_activation(frame, lengths)
    running = engine.RunningMean()
    for rows in ([0, 3], [1, 2, 4], [5, 6]):  # each batch unpadded to its own widest prompt
        width = int(lengths[rows].max())
        running.add(frame[rows, 5 - width :], lengths[rows])
    assert running.value().shape == (5, 2, 3)
    assert torch.allclose(running.value(), expected, atol=1e-6) and running.value().abs().max() < 10
    # batches of one length each need no lengths: position -3 only the first batch has
    same = engine.RunningMean().add(torch.ones(2, 3, 4)).add(3 * torch.ones(2, 2, 4))
    assert torch.equal(same.value()[:, 0], torch.tensor([1.0, 2.0, 2.0]))
    with pytest.raises(AnalysisError, match="do not match"):
        same.add(torch.ones(2, 3, 5))
    with pytest.raises(AnalysisError, match="nothing"):
        engine.RunningMean().value()


def test_native_attention_reuses_keys_and_a_wrong_cached_forward_is_caught(number_tokenizer, monkeypatch):
    """TransformerLens-native attention resumes with the base run's keys and values; were its
    cached forward ever to disagree with the module's own, the one-time check says so and the
    sweep recomputes every position, with the same numbers as whole forwards."""
    from conftest import tiny_bridge

    from arithinterp import patching
    from arithinterp.engine import native
    from arithinterp.tasks import arithmetic

    def sweep(model):
        pairs = arithmetic(model, a=range(10), b=range(10), few_shot=2).counterfactual(vary="b", seed=0)[:3]
        fast = patching.activation_patching(model, pairs, "attn_z", layers=[0, 2], engine="stepped", progress=False)
        slow = patching.activation_patching(model, pairs, "attn_z", layers=[0, 2], engine="hooks", progress=False)
        assert (fast.values - slow.values).abs().max() <= 1e-4
        return fast.meta["engine"][0]

    assert "keys/values reused" in sweep(tiny_bridge(number_tokenizer, n_layers=3, seed=2))
    own = native._forward

    def off_by_a_little(attn, layer, hidden_states, *args, **kwargs):
        out, pattern = own(attn, layer, hidden_states, *args, **kwargs)
        return out * (1.01 if kwargs.get("past_key_values") is not None else 1.0), pattern

    monkeypatch.setattr(native, "_forward", off_by_a_little)
    assert "every position recomputed" in sweep(tiny_bridge(number_tokenizer, n_layers=3, seed=3))


def test_prompts_sharing_a_prefix_compute_it_once_with_the_same_base_run(number_tokenizer):
    """A base run whose prompts share their first tokens (a few-shot prefix, then the first
    operand) runs each distinct prefix once; its block inputs, keys and values, read activations
    (attention patterns included) and logits are those of the plain run."""
    from conftest import tiny_bridge

    from arithinterp.engine import shared_prefixes
    from arithinterp.tasks import arithmetic

    model = tiny_bridge(number_tokenizer, n_layers=3, seed=4)
    tokens = arithmetic(model, a=range(10), b=range(3), few_shot=2).tokens
    stepper, _ = engine.stepper_for(model, tokens)
    assert stepper is not None and stepper.shares_prefixes
    examples = shared_prefixes.shared_prefix(tokens, 1)[0]  # the examples are worth sharing
    assert len(torch.unique(tokens[:, :examples], dim=0)) == 1 and examples >= 8
    split = shared_prefixes.split_at(tokens, examples + 2)  # examples, a, '+': one prefix per a
    k, representatives, inverse = split
    assert len(representatives) == 10 and torch.equal(tokens[representatives][inverse, :k], tokens[:, :k])
    reads = ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_z", "blocks.2.mlp.hook_post"]
    with torch.inference_mode():
        runs = [stepper.base(tokens, read=reads, read_only=True), stepper._shared_base(tokens, reads, None, *split)]
        stepper.shares_prefixes = False
        plain = stepper.base(tokens, read=reads, read_only=True)
        stepper.shares_prefixes = True
    close = lambda x, y: torch.allclose(x, y, atol=1e-5, equal_nan=True)  # noqa: E731
    for shared in runs:
        assert close(shared.logits, plain.logits)
        assert all(close(x, y) for x, y in zip(shared.resid, plain.resid))
        assert all(close(shared.kv[i][j], plain.kv[i][j]) for i in range(3) for j in range(2))
        assert all(close(shared.acts[name], plain.acts[name]) for name in reads)


# --- stacked ablations (arithinterp.engine.ablations) ----------------------------------------------


def _by_hand(model, tokens, cell, n_last):
    """One cell's logits at the last ``n_last`` positions, ``[B, n_last, V]``: one whole forward with
    a hand-written hook per ablation (site, layer, position per row, unit index or all, value)."""
    hooks = []
    for site, layer, pos, unit, value in cell:
        name = {"attn_z": f"blocks.{layer}.attn.hook_z", "mlp_post": f"blocks.{layer}.mlp.hook_post",
                "attn_out": f"blocks.{layer}.hook_attn_out", "mlp_out": f"blocks.{layer}.hook_mlp_out"}[site]

        def hook(act, hook, pos=pos, unit=unit, value=value, site=site):
            act = act.clone()
            view = act.unflatten(-1, (model.cfg.n_heads, -1)) if site == "attn_z" and act.ndim == 3 else act
            rows = torch.arange(len(pos))
            if unit is None:
                view[rows, pos] = value
            else:
                view[rows, pos, unit] = value[:, unit]
            return view.flatten(-2) if view is not act else act

        hooks.append((name, hook))
    with torch.inference_mode():
        return model.run_with_hooks(tokens, fwd_hooks=hooks)[:, -n_last:].float()


def _ablation_cells(model, B, T, seed=0):
    """Cells over every ablation site: single heads and neurons at per-row positions, whole outputs,
    two layers at once, zero and per-prompt values; as (engine cells, hand-written specs)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    H, dh, d, dm = cfg.n_heads, cfg.d_head, cfg.d_model, cfg.d_mlp
    late = torch.randint(T // 2, T, (B,), generator=g)
    last = torch.full((B,), T - 1)
    specs = [
        [("attn_z", 0, late, 1, torch.randn(B, H, dh, generator=g))],
        [("attn_z", 1, last, 3, torch.zeros(B, H, dh))],
        [("mlp_post", 0, late, 5, torch.randn(B, dm, generator=g)), ("mlp_post", 1, last, 7, torch.zeros(B, dm))],
        [("attn_out", 1, late, None, torch.randn(B, d, generator=g))],
        [("mlp_out", 0, last, None, torch.zeros(B, d)), ("attn_z", 1, late, 0, torch.randn(B, H, dh, generator=g))],
        [],
    ]
    cells = [[engine.Ablation(site, layer, pos, None if unit is None else torch.tensor([unit]), value)
              for site, layer, pos, unit, value in cell] for cell in specs]
    return cells, specs


def test_stacked_ablations_equal_hand_hooked_forwards(tiny_model):
    """Every cell of a stack, resumed at its ablated layer and first position with the base run's
    keys and values, equals one whole forward with hand-written hooks (≤ 1e-5), at the last
    positions asked for; whole stacked forwards (no stepper) too; ablating changes the logits."""
    tokens = torch.randint(0, 100, (6, 9), generator=torch.Generator().manual_seed(3))
    cells, specs = _ablation_cells(tiny_model, 6, 9)
    stepper, status = engine.stepper_for(tiny_model, tokens, engine="stepped")
    assert "keys/values reused" in status
    reference = torch.stack([_by_hand(tiny_model, tokens, spec, 2) for spec in specs])
    for runner in (engine.AblationRunner(tiny_model, stepper, tokens, n_last=2),
                   engine.AblationRunner(tiny_model, None, tokens, n_last=2)):
        logits = runner.run(cells, n_last=2).float()
        assert logits.shape == (len(cells), 6, 2, tiny_model.cfg.d_vocab)
        assert (logits - reference).abs().max() <= 1e-5
        final = runner.run(cells).float()  # the final position only
        assert (final - reference[:, :, -1]).abs().max() <= 1e-5
    assert all((reference[i] - reference[-1]).abs().max() > 1e-3 for i in range(len(cells) - 1))


def test_stacked_ablations_take_unit_masks_and_score_in_chunks(tiny_model):
    """A per-prompt neuron mask writes only the chosen neurons of each prompt; a score function
    sees the logits chunk by chunk (a tiny memory budget: one cell per stack) with the same result."""
    tokens = torch.randint(0, 100, (4, 6), generator=torch.Generator().manual_seed(4))
    dm = tiny_model.cfg.d_mlp
    mask = torch.zeros(4, dm, dtype=torch.bool)
    mask[0, [1, 2]] = mask[2, 9] = True  # prompts 1 and 3: nothing ablated
    value = torch.randn(dm, generator=torch.Generator().manual_seed(5))
    runner = engine.AblationRunner(tiny_model, engine.stepper_for(tiny_model, tokens)[0], tokens)
    cells = [[engine.Ablation("mlp_post", 0, 5, mask, value)], [engine.Ablation("mlp_post", 0, 5, torch.tensor([1, 2]), value)]]
    logits = runner.run(cells).float()
    by_hand = _by_hand(tiny_model, tokens[:1], [("mlp_post", 0, torch.tensor([5]), [1, 2], value[None])], 1)[:, 0]
    assert (logits[0, 0] - by_hand[0]).abs().max() <= 1e-5 and (logits[1, 0] - by_hand[0]).abs().max() <= 1e-5
    assert (logits[0, [1, 3]] - runner.base_logits[[1, 3]].float()).abs().max() <= 1e-5  # unmasked prompts
    assert (logits[0, 2] - runner.base_logits[2].float()).abs().max() > 1e-4
    scored = runner.run(cells, score=lambda x: x.argmax(-1), max_memory=1)
    assert torch.equal(scored, logits.argmax(-1))


def test_stacked_ablations_refuse_what_they_cannot_do(tiny_model):
    from arithinterp.errors import SiteError

    tokens = torch.randint(0, 100, (3, 5), generator=torch.Generator().manual_seed(6))
    runner = engine.AblationRunner(tiny_model, None, tokens)
    dm = tiny_model.cfg.d_mlp
    with pytest.raises(SiteError, match="resid_pre"):
        runner.run([[engine.Ablation("resid_pre", 0, 4)]])
    with pytest.raises(SiteError, match="fall outside"):
        runner.run([[engine.Ablation("mlp_post", 0, 5, torch.tensor([0]))]])
    with pytest.raises(SiteError, match=f"0..{dm - 1}"):
        runner.run([[engine.Ablation("mlp_post", 0, 4, torch.tensor([dm]))]])
    with pytest.raises(SiteError, match="value"):
        runner.run([[engine.Ablation("mlp_post", 1, 4, torch.tensor([0]), torch.zeros(3))]])
    with pytest.raises(SiteError, match="units"):
        runner.run([[engine.Ablation("attn_out", 1, 4, torch.tensor([0]))]])
    with pytest.raises(SiteError, match="positions"):
        runner.run([[engine.Ablation("attn_z", 1, torch.tensor([1.0, 2.0, 3.0]))]])
    with pytest.raises(AnalysisError, match="n_last"):
        runner.run([[]], n_last=2)  # the base run read the final position only


def test_native_models_decode_through_the_stepper_with_the_plain_answers(number_tokenizer):
    """Greedy decoding on a TransformerLens-native model runs each token after the first at its
    own position (the native key/value cache): the plain forward's tokens and logits; under the
    caller's hooks, the plain forward."""
    from conftest import tiny_bridge

    from arithinterp.engine import decode

    model = tiny_bridge(number_tokenizer, n_layers=3, seed=7, positional_embedding_type="rotary")
    tokens = torch.randint(0, 150, (5, 6), generator=torch.Generator().manual_seed(8))
    assert decode.decode_mode(model, tokens) == "stepped"
    generated = decode.greedy(model, tokens, 4)
    plain = tokens
    with torch.inference_mode():
        for _ in range(4):
            plain = torch.cat([plain, model(plain)[:, -1].argmax(-1, keepdim=True)], dim=1)
        stepper, _ = engine.stepper_for(model, tokens)
        _, logits = stepper.greedy(tokens, 4)
        reference = model(plain[:, :-1])[:, -4:]
    assert torch.equal(generated, plain[:, 6:])
    assert (logits - reference).abs().max() <= 1e-5
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x)]):
        assert decode.decode_mode(model, tokens) == "full"
