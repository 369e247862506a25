"""The engine on every decoder family: patching sweeps equal TransformerLens's, cell for cell.

Random-weight folders of GPT-2, GPT-NeoX, GPT-J, Llama, Qwen2, Gemma 2, Gemma 3 and Phi (see
``hf_families``), few-shot prompts of two different lengths; each length group is compared with
TransformerLens 4's ``get_act_patch_*`` on the same prompts (a one-cell-at-a-time hooks loop for
``attn_out`` / ``mlp_post``, which it has no function for on bridges).
"""

from __future__ import annotations

import pytest
import torch
from hf_families import FAMILIES, save_family
from test_patching import _logit_diff

import arithinterp as ai
from arithinterp import patching
from arithinterp.tasks import arithmetic

pytestmark = pytest.mark.slow  # seven decoder families, each loaded from a folder: not in the quick loop

TL_FUNCTIONS = {
    "resid_pre": "get_act_patch_resid_pre",
    "attn_z": "get_act_patch_attn_head_out_by_pos",
    "mlp_out": "get_act_patch_mlp_out",
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, number_tokenizer, tmp_path_factory):
    directory = save_family(request.param, number_tokenizer, tmp_path_factory.mktemp(request.param))
    model = ai.load_model(str(directory))
    # one- and two-shot prompts: different token lengths, patches starting mid-prompt
    pair_sets = [
        arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4), few_shot=shots).counterfactual(vary="a", seed=0)[:12]
        for shots in (1, 2)
    ]
    return request.param, model, pair_sets


def _reference(model, pairs, site):
    """TransformerLens's own patching (or one cell per forward with a hook): ``[pairs, layers, pos, (units)]``."""
    from transformer_lens import patching as tl_patching

    clean, corrupt = pairs.clean.unpadded(torch.arange(len(pairs))), pairs.corrupt.unpadded(torch.arange(len(pairs)))
    if site in TL_FUNCTIONS:
        _, cache = model.run_with_cache(clean)
        values = getattr(tl_patching, TL_FUNCTIONS[site])(model, corrupt, cache, _logit_diff(pairs), reduce="none").values
        return values.permute(-1, *range(values.ndim - 1))
    metric = _logit_diff(pairs)
    layers, length = model.cfg.n_layers, clean.shape[1]
    units = [0, 5] if site == "mlp_post" else [None]
    out = torch.empty(len(pairs), layers, length, len(units))
    for layer in range(layers):
        name = f"blocks.{layer}.hook_{site}" if site == "attn_out" else f"blocks.{layer}.mlp.hook_post"
        _, cache = model.run_with_cache(clean, names_filter=lambda n, name=name: n == name)
        source = cache[name]
        for p in range(length):
            for u, unit in enumerate(units):

                def hook(activation, hook, p=p, unit=unit):
                    activation = activation.clone()
                    if unit is None:
                        activation[:, p] = source[:, p]
                    else:
                        activation[:, p, unit] = source[:, p, unit]
                    return activation

                with torch.no_grad():
                    out[:, layer, p, u] = metric(model.run_with_hooks(corrupt, fwd_hooks=[(name, hook)]))
    return out if site == "mlp_post" else out[..., 0]


@pytest.mark.parametrize("site", ["resid_pre", "attn_out", "mlp_out", "attn_z", "mlp_post"])
def test_sweep_equals_transformer_lens_on_every_family(family, site):
    name, model, pair_sets = family
    lengths = set()
    for pairs, idx in [(ps, idx) for ps in pair_sets for idx in ps.clean.length_groups()]:
        group = pairs[idx]
        lengths.add(group.clean.tokens.shape[1] - pairs.clean.offset(idx))
        kwargs = dict(neurons=[0, 5]) if site == "mlp_post" else {}
        every_position = list(range(pairs.clean.offset(idx), pairs.clean.tokens.shape[1]))
        ours = patching.activation_patching(model, group, site, positions=every_position, progress=False, **kwargs)
        assert ours.meta["engine"][0].startswith("stepped"), ours.meta["engine"]
        reference = _reference(model, group, site)
        assert ours.values.shape == reference.shape
        assert (ours.values - reference).abs().max() <= 1e-4, (name, site)
    assert len(lengths) >= 2
    # the patches do something: a sweep that returned the base run everywhere would also "match"
    assert ours.values.std() > 1e-3


def test_every_family_reuses_keys_and_values(family):
    """Each family is stepped from the patched position on, with earlier keys and values reused."""
    from arithinterp.engine import stepper_for

    name, model, pair_sets = family
    pairs = pair_sets[1]
    stepper, status = stepper_for(model, pairs.corrupt.unpadded(pairs.clean.length_groups()[0]))
    assert stepper is not None and stepper.reuses_prefix, (name, status)
    # and prompts sharing a prefix (the few-shot examples) compute it once
    assert stepper.shares_prefixes, name


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_prompts_longer_than_the_sliding_window(name, number_tokenizer, tmp_path):
    """Gemma's sliding-window and global layers take different masks (and, in Gemma 3, different
    rotary bases) once prompts pass the window (16 tokens here): stepping, shared prefixes
    included, still gives the hooks' numbers."""
    model = ai.load_model(str(save_family(name, number_tokenizer, tmp_path)))
    pairs = arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4), few_shot=4).counterfactual(vary="a", seed=0)[:6]
    assert pairs.clean.tokens.shape[1] > 16
    for site in ("resid_pre", "attn_z", "mlp_out"):
        fast = patching.activation_patching(model, pairs, site, engine="stepped", progress=False)
        slow = patching.activation_patching(model, pairs, site, engine="hooks", progress=False)
        assert "keys/values reused" in fast.meta["engine"][0]
        assert (fast.values - slow.values).abs().max() <= 1e-4, site


# --- ablations and decoding through the stepper ------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "gpt_neox", "gemma2"])
def digit_family(request, digit_tokenizer, tmp_path_factory):
    """A random-weight folder with a digit tokenizer (multi-token answers) and one-shot prompts."""
    directory = save_family(request.param, digit_tokenizer, tmp_path_factory.mktemp(f"{request.param}_digits"))
    model = ai.load_model(str(directory))
    prompts = arithmetic(model, a=range(10, 70, 7), b=range(50, 99, 9), answer_digits=3, few_shot=1)
    return request.param, model, prompts


def _close(fast, slow, tolerance=1e-5):
    return float(((fast - slow).abs() / slow.abs().clamp(min=1)).max()) <= tolerance


@pytest.mark.slow
def test_stacked_ablations_equal_whole_forwards_on_every_family(digit_family):
    """Digit ablation (heads stacked per layer and answer position), mean-ablation importance and the
    engine's stacked ablation cells equal whole forwards, cell for cell (≤ 1e-5 of their scale)."""
    from test_engine import _ablation_cells

    from arithinterp import engine, neurons
    from arithinterp.patching.components import parse_components
    from arithinterp.patching.digits import digit_scores

    name, model, prompts = digit_family
    parsed = parse_components(model, ["L0H0", "L0H2", "L1H1", "L1H3"], ("head",))
    fast = digit_scores(model, prompts, parsed, "mean", 0, engine="stepped")
    slow = digit_scores(model, prompts, parsed, "mean", 0, engine="hooks")
    assert torch.equal(fast[1][..., 0], slow[1][..., 0]) and _close(fast[1][..., 1], slow[1][..., 1]), name
    pairs = prompts.counterfactual(vary="a", seed=0, distinct_first_token=True)[:6]
    scores = [neurons.importance(model, pairs, method="mean-ablation", top_k=None, engine=choice).scores
              for choice in ("stepped", "hooks")]
    assert _close(*scores) and float(scores[1].max()) > 1e-3, name
    tokens = prompts.unpadded(prompts.length_groups()[0])[:5]
    cells, _ = _ablation_cells(model, 5, tokens.shape[1])
    stepper, status = engine.stepper_for(model, tokens, engine="stepped")
    stacked = engine.AblationRunner(model, stepper, tokens, n_last=3).run(cells, n_last=3)
    whole = engine.AblationRunner(model, None, tokens, n_last=3).run(cells, n_last=3)
    assert "keys/values reused" in status and _close(stacked.float(), whole.float()), name


def test_stepped_greedy_decoding_on_every_family(digit_family):
    """The stepper's greedy continuation (each token after the first at its own position) gives the
    plain forward's tokens and logits on every family."""
    from arithinterp import engine

    name, model, prompts = digit_family
    tokens = prompts.unpadded(prompts.length_groups()[0])[:6]
    stepper, _ = engine.stepper_for(model, tokens)
    with torch.inference_mode():
        generated, logits = stepper.greedy(tokens, 4)
        reference = model(torch.cat([tokens, generated[:, :-1]], 1))[:, -4:].float()
    assert torch.equal(generated, reference.argmax(-1)) and _close(logits.float(), reference), name


def test_final_position_gradients_equal_the_whole_forwards_on_every_family(family, monkeypatch):
    """The neuron ranking's stepped gradients (the final position alone resumed with gradients, the
    shared few-shot prefix computed once) equal a whole forward's and backward's, and so does the
    attribution ranking built on them."""
    from arithinterp import engine, neurons
    from arithinterp.engine.steppers import final_gradients
    from arithinterp.metrics import answer_columns

    name, model, pair_sets = family
    pairs = pair_sets[1]
    idx = pairs.clean.length_groups()[0]
    tokens = pairs.clean.unpadded(idx)
    layers = [0, model.cfg.n_layers - 1]
    good, bad = pairs.clean.answer_tokens[idx, 0], pairs.corrupt.answer_tokens[idx, 0]
    rows = torch.arange(len(idx))
    columns, (g, b) = answer_columns(good, bad)
    names = [(layer, f"blocks.{layer}.mlp.hook_post") for layer in layers]
    stepped = final_gradients(model, tokens, names, lambda logits: logits[rows, g] - logits[rows, b], columns)
    assert stepped is not None, name
    final = torch.full((len(idx),), tokens.shape[1] - 1)
    whole = engine.run(model, tokens, reads=[engine.Read("mlp_post", layer, final) for layer in layers],
                       metric=lambda logits: logits[rows, good] - logits[rows, bad])
    assert whole.grads is not None
    for act, grad, act_ref, grad_ref in zip(*stepped, whole.reads, whole.grads):
        torch.testing.assert_close(act.float(), act_ref.float(), atol=1e-5, rtol=1e-4)
        assert grad is not None and grad_ref is not None
        torch.testing.assert_close(grad.float(), grad_ref.float(), atol=1e-5, rtol=1e-4)
    ranked = neurons.importance(model, pairs, layers=layers, top_k=None, progress=False)
    monkeypatch.setattr("arithinterp.neurons.neuron_importance.final_gradients", lambda *args: None)  # whole forwards
    reference = neurons.importance(model, pairs, layers=layers, top_k=None, progress=False)
    torch.testing.assert_close(ranked.scores, reference.scores, atol=1e-5, rtol=1e-4)
