"""collect(): exactly what run_with_cache gives, only what was asked for."""

import pytest
import torch

from arithinterp.activations import collect
from arithinterp.errors import SiteError
from arithinterp.sites import HOOKS, hook_name
from arithinterp.tasks import arithmetic, prompts_for_pairs

SITES = ["embed", "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_z", "mlp_pre", "mlp_post"]


@pytest.fixture(scope="module")
def prompts(tiny_model):
    return arithmetic(tiny_model, "+", range(12), range(12), "{a}+{b}=")


def test_collect_matches_run_with_cache(tiny_model, prompts):
    acts = collect(tiny_model, prompts, sites=SITES, positions=["a", "b", "final"], batch_size=50, progress=False)
    _, cache = tiny_model.run_with_cache(prompts.tokens)
    rows = torch.arange(len(prompts))
    assert set(acts.data) == set(SITES)  # only the requested sites are kept
    for site in SITES:
        for li, layer in enumerate([0] if site == "embed" else acts.layers):
            reference = cache[hook_name(site, layer)]
            for pi, name in enumerate(acts.positions):
                expected = reference[rows, prompts.positions[name]]
                got = acts[site][:, li, pi]
                assert got.shape == expected.shape
                assert (got - expected).abs().max() <= 1e-6, (site, layer, name)


def test_collect_layers_positions_dtype(tiny_model, prompts):
    acts = collect(tiny_model, prompts, sites="resid_post", layers=[1], positions="last", dtype=torch.float16, progress=False)
    assert acts["resid_post"].shape == (len(prompts), 1, 1, tiny_model.cfg.d_model)
    assert acts["resid_post"].dtype == torch.float16
    full = collect(tiny_model, prompts, sites="resid_post", positions="all", progress=False)
    assert full["resid_post"].shape == (len(prompts), 2, prompts.tokens.shape[1], tiny_model.cfg.d_model)
    assert full.positions == [str(i) for i in range(prompts.tokens.shape[1])]
    one = acts.get("resid_post", 1, "final")
    assert torch.allclose(one.float(), full.get("resid_post", 1, prompts.tokens.shape[1] - 1), atol=1e-2)


def test_collect_disk_backed(tiny_model, prompts, tmp_path):
    in_memory = collect(tiny_model, prompts, sites="mlp_post", positions="final", progress=False)
    on_disk = collect(tiny_model, prompts, sites="mlp_post", positions="final", store=tmp_path, progress=False)
    assert (tmp_path / "mlp_post.npy").exists()
    assert torch.equal(in_memory["mlp_post"], on_disk["mlp_post"])


def test_collect_variable_length_prompts(tiny_digit_model):
    prompts = prompts_for_pairs(tiny_digit_model, "+", [123, 4, 56], [7, 8, 12], "{a}+{b}=")
    acts = collect(tiny_digit_model, prompts, sites="resid_post", positions=["a", "final"], progress=False)
    for i in range(len(prompts)):
        start = prompts.tokens.shape[1] - int(prompts.lengths[i])
        _, cache = tiny_digit_model.run_with_cache(prompts.tokens[i : i + 1, start:])
        for pi, name in enumerate(acts.positions):
            expected = cache["blocks.1.hook_resid_post"][0, int(prompts.positions[name][i]) - start]
            assert (acts["resid_post"][i, 1, pi] - expected).abs().max() <= 1e-6
    with pytest.raises(SiteError, match="one token length"):
        collect(tiny_digit_model, prompts, sites="resid_post", positions="all", progress=False)


def test_collect_reads_attention_patterns_in_the_padded_frame(tiny_digit_model):
    """``pattern`` is [prompt, layer, query, head, key]: each query's row is run_with_cache's on the
    unpadded prompt, its keys placed after the padding (weight 0 there) and each row sums to 1."""
    prompts = prompts_for_pairs(tiny_digit_model, "+", [123, 4, 56], [7, 8, 12], "{a}+{b}=")
    acts = collect(tiny_digit_model, prompts, sites="pattern", positions=["a", "final", "answer[0]"], progress=False)
    T, heads = prompts.tokens.shape[1], tiny_digit_model.cfg.n_heads
    assert acts["pattern"].shape == (3, 2, 3, heads, T + 1)  # the first answer token is fed: one more key
    assert torch.allclose(acts["pattern"].sum(-1), torch.ones(3, 2, 3, heads), atol=1e-5)
    assert repr(acts) == (f"Activations(n_prompts=3, pattern=float32 [3, 2, 3, {heads}, {T + 1}], layers=[0, 1], "
                          "positions=['a', 'final', 'answer[0]'])")  # shapes, never the values
    for i in range(len(prompts)):
        start = T - int(prompts.lengths[i])
        tokens = torch.cat([prompts.tokens[i, start:], prompts.answer_tokens[i, :1]])[None]
        _, cache = tiny_digit_model.run_with_cache(tokens)
        assert (acts["pattern"][i, ..., :start] == 0).all()
        for li, layer in enumerate(acts.layers):
            for pi, query in enumerate([prompts.positions["a"][i], prompts.positions["final"][i], T]):
                expected = cache[hook_name("pattern", layer)][0, :, int(query) - start]  # [head, key]
                assert (acts["pattern"][i, li, pi, :, start:] - expected).abs().max() <= 1e-6, (i, layer, pi)


def test_plot_attention_draws_one_heatmap_per_layer_and_head_over_the_prompts_tokens(tiny_digit_model):
    from arithinterp.errors import ConfigError
    from arithinterp.viz import plot_attention

    prompts = prompts_for_pairs(tiny_digit_model, "+", [123, 4], [7, 8], "{a}+{b}=")
    acts = collect(tiny_digit_model, prompts, sites="pattern", positions=["final", "answer[0]"], progress=False)
    fig = plot_attention(acts, 1)  # the shorter prompt: its padding is not drawn
    assert len(fig.data) == 2 * tiny_digit_model.cfg.n_heads
    first = fig.data[0]
    keys = [label.split(": ", 1)[1] for label in first.x]
    assert keys[-5:] == ["4", "+", "8", "=", "1"] and len(keys) == int(prompts.lengths[1]) + 1  # 4+8= then 12's "1"
    assert list(first.y) == [first.x[-2], first.x[-1]]  # the queries: "final" (=) and the answer's first token
    start = prompts.tokens.shape[1] - int(prompts.lengths[1])
    for k, (li, h) in ((0, (0, 0)), (5, (1, 1))):
        assert torch.allclose(torch.tensor(fig.data[k].z).float(), acts["pattern"][1, li, :, h, start:])
    assert len(plot_attention(acts, 0, layers=[1], heads=[2]).data) == 1
    with pytest.raises(SiteError, match="layer 3 was not collected"):
        plot_attention(acts, layers=[3])
    with pytest.raises(ConfigError, match="prompt must be an integer in -2..1"):
        plot_attention(acts, 2)
    with pytest.raises(SiteError, match="'pattern' was not collected"):
        plot_attention(collect(tiny_digit_model, prompts, sites="resid_post", progress=False))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sites="resid_psot"), "unknown site 'resid_psot'"),
        (dict(sites="resid_post", layers=[5]), "out of range"),
        (dict(sites="resid_post", positions="c"), "unknown position"),
        (dict(sites=[]), "sites is empty"),
        (dict(sites="resid_post", batch_size=0), "batch_size"),
    ],
)
def test_collect_rejects_bad_input(tiny_model, prompts, kwargs, match):
    with pytest.raises(SiteError, match=match):
        collect(tiny_model, prompts, progress=False, **kwargs)


def test_collect_rejects_empty_prompt_set(tiny_model, prompts):
    with pytest.raises(SiteError, match="empty"):
        collect(tiny_model, prompts[[]], sites="resid_post", progress=False)


def test_every_site_names_a_real_hook(tiny_model):
    hooks = set(tiny_model.hook_dict)
    for site in HOOKS:
        if site.endswith("_post_scale"):  # only models with norms after their branches (Gemma 2, 3) have them
            continue  # (attribution graphs read them there: tests/test_branch_norms.py)
        assert hook_name(site, 1) in hooks, site


def test_a_subset_keeps_each_prompts_rows_and_labels(tiny_model, prompts):
    """``subset`` selects prompts the way a PromptSet does: the same rows of every site and the
    same prompts (so labels follow), by index or mask; anything else is refused."""
    from arithinterp.errors import ConfigError

    acts = collect(tiny_model, prompts, sites=["resid_post", "mlp_out"], positions=["a", "final"], progress=False)
    pick = torch.tensor([5, 0, 3])
    some = acts.subset(pick)
    for site in acts.sites:
        assert torch.equal(some[site], acts[site][pick])
    assert torch.equal(some.prompts.label("a"), prompts.label("a")[pick])
    assert (some.layers, some.positions) == (acts.layers, acts.positions)
    mask = prompts.label("a") % 2 == 0
    assert torch.equal(acts.subset(mask)["resid_post"], acts["resid_post"][mask])
    for bad in (torch.tensor([0.5]), torch.ones(2, dtype=torch.bool), torch.tensor([len(prompts)])):
        with pytest.raises(ConfigError):
            acts.subset(bad)
