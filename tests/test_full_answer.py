"""Full-answer scoring of patching sweeps: every answer token, teacher-forced.

The reference here is written out by hand, one cell per forward with ``run_with_hooks``: each
answer the metric compares is fed after the corrupt prompt (denoising), the cell is patched with
the clean prompt's activation (the clean prompt fed the same answer), and the answer's
log-probability is summed over its own tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_families import save_family

import arithinterp as ai
from arithinterp import patching
from arithinterp.errors import ConfigError
from arithinterp.tasks import PromptPairs, arithmetic


def _answer(prompts, i: int) -> torch.Tensor:
    row = prompts.answer_tokens[i]
    return row[row >= 0]


def _hook_name(site: str, layer: int) -> str:
    return f"blocks.{layer}.hook_resid_pre" if site == "resid_pre" else f"blocks.{layer}.attn.hook_z"


def _answer_logprob(logits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """``log P(answer | prompt)`` from the logits ``[1, T, V]`` of prompt + answer[:-1]."""
    k = len(answer)
    return logits[0, -k:].float().log_softmax(-1).gather(-1, answer[:, None])[:, 0].sum()


def reference(model, pairs, site: str, metric: str = "logit_diff") -> torch.Tensor:
    """Denoising, one pair, one fed answer and one cell per forward: ``[pairs, layers, positions, (heads)]``."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    idx = torch.arange(len(pairs))
    heads = list(range(n_heads)) if site == "attn_z" else [None]
    width = int(pairs.clean.lengths[0])
    out = torch.empty(len(pairs), n_layers, width, len(heads))
    for i in range(len(pairs)):
        clean = pairs.clean.unpadded(idx[i : i + 1])
        corrupt = pairs.corrupt.unpadded(idx[i : i + 1])
        answers = [_answer(pairs.clean, i)] + ([_answer(pairs.corrupt, i)] if metric == "logit_diff" else [])
        for layer in range(n_layers):
            name = _hook_name(site, layer)
            for p in range(width):
                for u, head in enumerate(heads):
                    scores = []
                    for answer in answers:
                        fed = lambda prompt: torch.cat([prompt, answer[None, :-1]], dim=1)  # noqa: E731
                        _, cache = model.run_with_cache(fed(clean), names_filter=lambda n: n == name)
                        source = cache[name]

                        def hook(activation, hook, p=p, head=head, source=source):
                            activation = activation.clone()
                            if head is None:
                                activation[:, p] = source[:, p]
                            elif activation.ndim == 3:  # bridges fire hook_z flat [B, T, H * d_head]
                                d = activation.shape[-1] // n_heads
                                activation[:, p, head * d : (head + 1) * d] = source[:, p, head * d : (head + 1) * d]
                            else:
                                activation[:, p, head] = source[:, p, head]
                            return activation

                        with torch.no_grad():
                            logits = model.run_with_hooks(fed(corrupt), fwd_hooks=[(name, hook)])
                        scores.append(_answer_logprob(logits, answer))
                    out[i, layer, p, u] = scores[0] - scores[1] if metric == "logit_diff" else scores[0]
    return out if site == "attn_z" else out[..., 0]


@pytest.fixture(scope="module")
def digit_pairs(tiny_digit_model):
    """Two-digit answers, digit by digit; most pairs' answers start with the same digit."""
    prompts = arithmetic(tiny_digit_model, a=range(10, 40), b=range(50, 60))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same-first-token warning is what these pairs are for
        pairs = prompts.counterfactual(vary="b", seed=0)
    return pairs[:6]


@pytest.mark.slow
@pytest.mark.parametrize("site", ["resid_pre", "attn_z"])
def test_full_answer_sweep_equals_a_cell_by_cell_reference(tiny_digit_model, digit_pairs, site):
    ours = patching.activation_patching(tiny_digit_model, digit_pairs, site, scoring="full-answer", progress=False)
    expected = reference(tiny_digit_model, digit_pairs, site)
    assert ours.values.shape == expected.shape
    assert (ours.values - expected).abs().max() <= 1e-4
    assert ours.values.std() > 1e-3 and ours.meta["scoring"] == "full-answer"


def test_pairs_sharing_the_first_token_get_full_answer_effects(tiny_digit_model, digit_pairs):
    same = digit_pairs.clean.answer_tokens[:, 0] == digit_pairs.corrupt.answer_tokens[:, 0]
    assert same.all()  # 5x+5y with y the varied b: the tens digit is the same in these pairs
    first = patching.activation_patching(tiny_digit_model, digit_pairs, "resid_pre", progress=False)
    full = patching.activation_patching(tiny_digit_model, digit_pairs, "resid_pre", scoring="full-answer", progress=False)
    assert first.values.abs().max() == 0  # clean and corrupt first tokens coincide: exactly 0
    effect = full.values - full.corrupt_baseline[:, None, None]
    assert effect.abs().amax(dim=(1, 2)).min() > 1e-3  # every pair moves under some patch
    assert (full.clean_baseline - full.corrupt_baseline).abs().min() > 1e-3


@pytest.mark.parametrize("metric", ["logit_diff", "logprob", "prob", "ie"])
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_stepped_and_whole_forward_paths_agree(tiny_digit_model, digit_pairs, metric, direction):
    kwargs = dict(scoring="full-answer", metric=metric, direction=direction, progress=False)
    stepped = patching.activation_patching(tiny_digit_model, digit_pairs, "attn_z", engine="stepped", **kwargs)
    hooks = patching.activation_patching(tiny_digit_model, digit_pairs, "attn_z", engine="hooks", **kwargs)
    assert hooks.meta["engine"] == ["hooks: requested"] and stepped.meta["engine"][0].startswith("stepped")
    scale = max(1.0, float(hooks.values.abs().max()))
    assert (stepped.values - hooks.values).abs().max() <= 1e-4 * scale
    assert hooks.values.std() > 0


def test_whole_answer_metrics_are_their_definitions(tiny_digit_model, digit_pairs):
    """Unpatched, logprob is the prompt set's own full-answer log-probability; prob its exp; a
    patch everywhere at layer 0 is the clean run."""
    logprob = patching.activation_patching(tiny_digit_model, digit_pairs, "resid_pre", metric="logprob", scoring="full-answer", progress=False)
    expected = digit_pairs.clean.with_scoring("full-answer").answer_logprob(tiny_digit_model)
    assert torch.allclose(logprob.clean_baseline, expected, atol=1e-4)
    prob = patching.activation_patching(tiny_digit_model, digit_pairs, "resid_pre", metric="prob", scoring="full-answer", progress=False)
    assert torch.allclose(prob.values, logprob.values.exp(), atol=1e-5)
    everything = patching.activation_patching(tiny_digit_model, digit_pairs, "resid_pre", layers=[0], per_position=False,
                                scoring="full-answer", progress=False)
    assert torch.allclose(everything.values[:, 0], everything.clean_baseline, atol=1e-4)


def test_single_token_answers_score_as_the_first_token(tiny_model):
    """With one answer token, log P(clean) − log P(corrupt) is the logit difference."""
    pairs = arithmetic(tiny_model, a=range(10), b=range(10)).counterfactual(vary="a", seed=0)[:6]
    first = patching.activation_patching(tiny_model, pairs, "resid_pre", progress=False)
    full = patching.activation_patching(tiny_model, pairs, "resid_pre", scoring="full-answer", progress=False)
    assert (first.values - full.values).abs().max() <= 1e-4 and first.values.std() > 1e-3


@pytest.mark.slow
def test_answers_of_different_token_counts_are_each_scored_on_their_own_tokens(tiny_digit_model):
    prompts = arithmetic(tiny_digit_model, a=range(1, 10), b=range(1, 10))  # 1+1=2 .. 9+9=18: one or two tokens
    n = prompts.n_answer_tokens
    one, two = torch.nonzero(n == 1).flatten(), torch.nonzero(n == 2).flatten()
    clean = torch.cat([two[:3], one[:2], two[3:4]])
    corrupt = torch.cat([one[-3:], two[-2:], two[-3:-2]])  # 2 vs 1, 1 vs 2 and 2 vs 2 answer tokens
    pairs = PromptPairs(prompts[clean], prompts[corrupt])
    ours = patching.activation_patching(tiny_digit_model, pairs, "resid_pre", scoring="full-answer", progress=False)
    assert (ours.values - reference(tiny_digit_model, pairs, "resid_pre")).abs().max() <= 1e-4


def test_scoring_defaults_to_the_prompts_own(tiny_digit_model, digit_pairs):
    scored = PromptPairs(digit_pairs.clean.with_scoring("full-answer"), digit_pairs.corrupt.with_scoring("full-answer"))
    default = patching.activation_patching(tiny_digit_model, scored, "resid_pre", layers=[1], progress=False)
    explicit = patching.activation_patching(tiny_digit_model, digit_pairs, "resid_pre", layers=[1], scoring="full-answer", progress=False)
    assert default.meta["scoring"] == "full-answer" and torch.equal(default.values, explicit.values)
    first = patching.activation_patching(tiny_digit_model, scored, "resid_pre", layers=[1], scoring="first-token", progress=False)
    assert first.meta["scoring"] == "first-token" and first.values.abs().max() == 0


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(scoring="whole"), ["unknown scoring 'whole'", "first-token", "full-answer"]),
        (dict(scoring=1), ["scoring=1 is not accepted", "scoring accepts a string"]),
        (dict(scoring="full-answer", metric=lambda logits, pairs: logits[:, 0]), ["metric callable", "logit_diff"]),
    ],
)
def test_bad_scoring_is_explained(tiny_digit_model, digit_pairs, kwargs, words):
    with pytest.raises(ConfigError) as info:
        patching.activation_patching(tiny_digit_model, digit_pairs, "resid_pre", progress=False, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.fixture(scope="module")
def llama_digits(digit_tokenizer, tmp_path_factory):
    """A random Llama folder with digit tokens and a few-shot prefix: patches start mid-prompt,
    earlier keys and values are reused, and the teacher-forced answer follows."""
    model = ai.load_model(str(save_family("llama", digit_tokenizer, tmp_path_factory.mktemp("llama_digits"))))
    prompts = arithmetic(model, a=range(10, 40), b=range(50, 60), few_shot=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pairs = prompts.counterfactual(vary="b", seed=0)
    return model, pairs[pairs.clean.length_groups()[0][:3]]


@pytest.mark.slow
@pytest.mark.parametrize("site", ["resid_pre", "attn_z"])
def test_full_answer_on_a_llama_with_reused_keys_and_values(llama_digits, site):
    model, pairs = llama_digits
    ours = patching.activation_patching(model, pairs, site, scoring="full-answer", progress=False)
    assert "keys/values reused" in ours.meta["engine"][0], ours.meta["engine"]
    hooks = patching.activation_patching(model, pairs, site, scoring="full-answer", engine="hooks", progress=False)
    assert (ours.values - hooks.values).abs().max() <= 1e-4
    assert (ours.values - reference(model, pairs, site)).abs().max() <= 1e-4
    assert ours.values.std() > 1e-3


def test_a_callable_metric_reads_the_final_position_when_scoring_is_left_to_the_prompts(tiny_digit_model, digit_pairs):
    scored = PromptPairs(digit_pairs.clean.with_scoring("full-answer"), digit_pairs.corrupt.with_scoring("full-answer"))
    clean = scored.clean_answer_token
    result = patching.activation_patching(tiny_digit_model, scored, "resid_pre", layers=[1], metric=lambda logits, pairs: logits[:, 0] + clean,
                            progress=False)
    assert result.meta["scoring"] == "first-token"


@pytest.mark.parametrize("engine_kind", ["llama", "native"])
def test_the_stepper_returns_the_last_positions_logits(llama_digits, tiny_digit_model, engine_kind):
    """``n_last=k``: resuming from any layer and position gives the model's own logits at the last k positions."""
    from arithinterp.engine import PatchRunner, Stepper
    from arithinterp.errors import AnalysisError

    model = llama_digits[0] if engine_kind == "llama" else tiny_digit_model
    pairs = llama_digits[1] if engine_kind == "llama" else arithmetic(tiny_digit_model, a=range(10, 14), b=range(50, 52)).counterfactual("b")
    tokens = pairs.clean.unpadded(pairs.clean.length_groups()[0])
    stepper = Stepper(model)
    assert stepper.check(tokens)[0]
    base = stepper.base(tokens, n_last=3)
    with torch.no_grad():
        whole = model(tokens, return_type="logits")[:, -3:]
    assert base.logits.shape == whole.shape and (base.logits - whole).abs().max() <= 1e-4
    start = tokens.shape[1] - 4 if stepper.reuses_prefix else 0
    resumed = stepper.resume(base, 1, base.resid[1][:, start:], start, n_last=3)
    assert (resumed - whole).abs().max() <= 1e-4
    assert stepper.resume(base, 1, base.resid[1][:, start:], start).shape == whole[:, -1].shape  # the default: [B, V]
    with pytest.raises(AnalysisError, match="n_last must be None"):
        stepper.resume(base, 1, base.resid[1][:, start:], start, n_last=tokens.shape[1] - start + 1)
    runner = PatchRunner(model, stepper, "resid_pre", tokens, pairs.corrupt.unpadded(pairs.clean.length_groups()[0]), n_last=2)
    assert runner.patched(0, None, None).shape == (1, len(tokens), 2, model.cfg.d_vocab)


def test_first_token_analyses_say_so_on_full_answer_prompts(tiny_digit_model):
    """attribute and direct_effect read the final position only: on full-answer prompts they warn."""
    from arithinterp import patching

    pairs = arithmetic(tiny_digit_model, a=range(10, 14), b=range(50, 53)).with_scoring("full-answer").counterfactual("a", seed=0)
    with pytest.warns(UserWarning, match="first answer token only"):
        patching.attribute(tiny_digit_model, pairs, "resid_pre", progress=False)
    with pytest.warns(UserWarning, match="first answer token only"):
        patching.direct_effect(tiny_digit_model, pairs, progress=False)
