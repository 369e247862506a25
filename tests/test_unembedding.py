"""Reads and metrics build only the logits they use.

A read of the last layer must not run the unembedding (on Gemma 3, 262,144 logits per position),
and a metric of the final position (or of a few teacher-forced answer positions) must unembed
those positions alone. Each case counts what the model's own unembedding module produced (a
forward hook on it) and checks the result against the full forward, on a Gemma 2 folder (final
logit soft-capping), a Gemma 3 folder (final norm, QK-norm) and the zoo.
"""

from __future__ import annotations

import pytest
import torch
from hf_families import save_family

import arithinterp as ai
from arithinterp import engine
from arithinterp.activations import collect
from arithinterp.engine.decode import teacher_forced_logprobs
from arithinterp.engine.hooks import forward_with_hooks, module_hooks
from arithinterp.tasks import arithmetic

TOLERANCE = 1e-5  # relative to the largest logit of the full forward


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "zoo:add-100"])
def model(request, number_tokenizer, tmp_path_factory):
    if request.param.startswith("zoo:"):
        return ai.load_model(request.param)
    return ai.load_model(str(save_family(request.param, number_tokenizer, tmp_path_factory.mktemp(request.param))))


class Unembedded:
    """The shapes the model's unembedding module produced while the ``with`` block ran."""

    def __init__(self, model):
        self.model, self.shapes = model, []

    def __enter__(self):
        self._hooks = module_hooks(post=[(self.model.unembed, lambda module, args, out: self.shapes.append(
            tuple(out.shape)))])
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _full(model, tokens):
    with torch.inference_mode():
        return model(tokens, return_type="logits").float()


def _shots(model):
    """Few-shot examples the model's context holds (the zoo's is 8 tokens)."""
    return 1 if model.cfg.n_ctx >= 16 else 0


def _random_tokens(model, rows, length, seed):
    length = min(length, model.cfg.n_ctx)
    return torch.randint(1, 150, (rows, length), generator=torch.Generator().manual_seed(seed))


def _close(fast, full):
    assert fast.shape == full.shape
    assert float((fast - full).abs().max()) <= TOLERANCE * float(full.abs().max())


def test_a_last_layer_read_runs_no_unembedding(model):
    """collect at the last layer: no logits at all, and the activations the full forward has."""
    prompts = arithmetic(model, a=range(10, 20), b=range(10, 13), few_shot=_shots(model))
    last = model.cfg.n_layers - 1
    where = dict(sites=["resid_post", "mlp_out"], layers=[last], positions=["a", "final"], progress=False)
    collect(model, prompts[:4], **where)  # a stepped read's one-time check of the model (it unembeds 4 prompts)
    with Unembedded(model) as unembedded:
        acts = collect(model, prompts, **where)
    assert unembedded.shapes == []
    name = f"blocks.{last}.hook_resid_post"
    with torch.inference_mode():
        _, cache = model.run_with_cache(prompts.tokens, names_filter=lambda n: n == name)
    final, a = prompts.positions["final"], prompts.positions["a"]
    rows = torch.arange(len(prompts))
    torch.testing.assert_close(acts.get("resid_post", last, "final"), cache[name][rows, final].float())
    torch.testing.assert_close(acts.get("resid_post", last, "a"), cache[name][rows, a].float())


def test_the_final_norm_scale_is_read_without_logits(model):
    """ln_final_scale runs after every block: a reads-only forward runs them all, then stops."""
    tokens = torch.tensor([[1, 12, 40, 7, 9]])
    with Unembedded(model) as unembedded:
        out = engine.run(model, tokens, reads=[engine.Read("ln_final_scale", 0)], logits="none")
    assert unembedded.shapes == [] and out.reads[0].shape[:2] == (1, 5)


def test_final_and_last_k_logits_unembed_those_positions_alone(model):
    tokens = _random_tokens(model, 3, 9, 0)
    T = tokens.shape[1]
    full = _full(model, tokens)
    V = full.shape[-1]
    with Unembedded(model) as unembedded:
        final = engine.run(model, tokens).logits
        last3 = engine.run(model, tokens, logits=3).logits
    assert unembedded.shapes == [(3, 1, V), (3, 3, V)]
    assert final is not None and last3 is not None
    _close(final, full[:, -1])
    _close(last3, full[:, -3:])
    with pytest.raises(ai.ArithInterpError, match=f"number of last positions 1..{T}"):
        engine.run(model, tokens, logits=T + 1)


def test_teacher_forced_scoring_unembeds_the_answer_positions(model):
    tokens = _random_tokens(model, 4, 7, 1)
    answer = torch.randint(1, 150, (4, 2), generator=torch.Generator().manual_seed(2))
    fed = torch.cat([tokens, answer[:, :-1]], dim=1)
    expected = _full(model, fed)[:, -2:].log_softmax(-1).gather(-1, answer[..., None])[..., 0]
    teacher_forced_logprobs(model, tokens[:1], answer[:1])  # the one-time choice of path (it checks all of a probe)
    with Unembedded(model) as unembedded:
        got = teacher_forced_logprobs(model, tokens, answer)
    assert all(shape[1] <= 2 for shape in unembedded.shapes if len(shape) == 3), unembedded.shapes
    assert float((got - expected).abs().max()) <= 1e-4


def test_patching_and_the_helix_test_score_the_final_position_alone(model):
    """Patching's stepped base run and the helix patch test's patched logits: [B, 1, V] at most."""
    from arithinterp import helix, patching
    from arithinterp.helix.causal import patched_logit

    prompts = arithmetic(model, a=range(10, 40), b=range(10, 12), few_shot=_shots(model))
    pairs = prompts.counterfactual(vary="a", seed=0)[:16]
    layer = model.cfg.n_layers // 2
    acts = collect(model, prompts, sites="resid_pre", layers=[layer], positions="a", progress=False)
    fit = helix.fit(acts, "a", periods=(2, 10), site="resid_pre", layer=layer, positions="a")
    with Unembedded(model) as unembedded:
        patching.activation_patching(model, pairs, "resid_pre", layers=[layer], progress=False)
        test = helix.patch_test(model, pairs, fit, n_boot=100)
    assert unembedded.shapes and all(len(shape) == 2 or shape[1] == 1 for shape in unembedded.shapes)
    # the helix test's unpatched logit of the corrupt answer, against the full forward
    tokens = pairs.clean.unpadded(torch.arange(len(pairs)))
    before = patched_logit(model, pairs.clean, ("resid_pre", layer), "a", None, pairs.corrupt_answer_token)
    full = _full(model, tokens)[:, -1]
    _close(before, full[torch.arange(len(pairs)), pairs.corrupt_answer_token])
    assert torch.isfinite(test.effect).all()


def test_a_hook_on_the_unembedding_sees_every_position(number_tokenizer):
    """Whoever watches the unembedding's own hook points gets the full forward's shapes."""
    model = ai.load_model("zoo:add-100")
    tokens = torch.tensor([[1, 12, 40, 7, 9], [1, 13, 41, 8, 9]])
    seen = []
    hooks = [("unembed.hook_out", lambda activation, hook: seen.append(tuple(activation.shape)))]
    logits = forward_with_hooks(model, tokens, hooks, last=1)
    assert seen == [tuple(logits.shape)] and logits.shape[1] == 5
    assert forward_with_hooks(model, tokens, [], last=2).shape[1] == 2


def test_stepped_reads_of_the_last_positions_unembed_nothing(model):
    """read_last (the error detector's and the neuron means' reads) keeps activations, not logits."""
    from arithinterp.engine.steppers import read_last

    prompts = arithmetic(model, a=range(10, 30), b=range(10, 12), few_shot=_shots(model))
    tokens = prompts.unpadded(torch.arange(len(prompts)))
    name = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    read_last(model, tokens[:4], [name], 1, only_if_shared=False)  # the stepper's one-time check
    with Unembedded(model) as unembedded:
        read = read_last(model, tokens, [name], 1, only_if_shared=False)
    assert unembedded.shapes == []
    if read is not None:  # None where the blocks cannot be stepped that way (whole forwards then)
        with torch.inference_mode():
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == name)
        torch.testing.assert_close(read[name][:, 0], cache[name][:, -1], atol=1e-5, rtol=1e-4)


def _logit_diff_callable(logits, pairs):  # the whole vocabulary's logits, read as a user's metric reads them
    rows = torch.arange(len(pairs))
    return logits[rows, pairs.clean_answer_token] - logits[rows, pairs.corrupt_answer_token]


def test_a_logit_difference_sweep_computes_the_answers_columns_alone(model):
    """A logit difference reads two logits per pair: patched runs compute those columns of the
    unembedding alone (the model's own module runs for the base runs and a one-time check), and
    the sweep equals the same metric read off the whole vocabulary."""
    from arithinterp import patching

    prompts = arithmetic(model, a=range(10, 40), b=range(10, 12), few_shot=_shots(model))
    pairs = prompts.counterfactual(vary="a", seed=0)[:12]
    V = int(model.cfg.d_vocab)
    patching.activation_patching(model, pairs[:2], "resid_pre", progress=False)  # the stepper's one-time checks
    for site in ("resid_pre", "mlp_out", "attn_z"):
        with Unembedded(model) as columns:
            fast = patching.activation_patching(model, pairs, site, progress=False)
        with Unembedded(model) as whole:
            full = patching.activation_patching(model, pairs, site, metric=_logit_diff_callable, progress=False)
        assert not any(shape[-1] == V for shape in columns.shapes), columns.shapes
        assert any(shape[-1] == V for shape in whole.shapes)
        _close(fast.values, full.values)


def test_an_unembedding_that_rescales_its_logits_is_read_through_the_module(number_tokenizer):
    """A model whose unembedding module does more than ``x @ W_U + b_U`` (here it triples the
    logits) is caught by the one-time check, and its columns are picked from the module's logits."""
    from arithinterp import patching

    model = ai.load_model("zoo:add-100")
    prompts = arithmetic(model, a=range(10, 40), b=range(10, 12))
    pairs = prompts.counterfactual(vary="a", seed=0)[:12]
    with module_hooks(post=[(model.unembed, lambda module, args, out: 3 * out)]):
        fast = patching.activation_patching(model, pairs, "resid_pre", progress=False)
        full = patching.activation_patching(model, pairs, "resid_pre", metric=_logit_diff_callable, progress=False)
    _close(fast.values, full.values)
    assert float(fast.values.abs().max()) > 0
