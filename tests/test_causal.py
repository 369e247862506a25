"""Causal variables: causal models, interchange datasets, DAS on a planted model, baselines, results."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest
import torch

import arithinterp as ai
from arithinterp import causal
from arithinterp.causal.planted import (
    HELIX_DIMS, HUNDREDS_DIM, planted_helix_model, planted_helix_subspace, planted_model, planted_plane,
)
from arithinterp.engine import Write, run
from arithinterp.errors import AnalysisError, ArithInterpError, ConfigError, SiteError


@pytest.fixture(scope="module")
def planted(number_tokenizer):
    model = planted_model(number_tokenizer)
    prompts = ai.tasks.arithmetic(model, op="+", a=range(10), b=range(10), template="{a}+{b}=")
    return model, prompts


@pytest.fixture(scope="module")
def planted_fit(planted):
    model, prompts = planted
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=600, seed=0)
    result = causal.das(model, dataset, "resid_post", 0, 2, positions="final", steps=300, progress=False)
    return model, dataset, result, before


# --- causal models ----------------------------------------------------------------------------------


def test_addition_model_computes_sums_carries_and_counterfactuals():
    model = causal.addition(3)
    a, b = torch.tensor([155, 999, 100, 450]), torch.tensor([255, 1, 100, 550])
    values = model.values(a, b)
    assert values["answer"].tolist() == (a + b).tolist()
    assert values["carry_tens"].tolist() == [1, 1, 0, 0]  # into the tens: 5 + 5, 9 + 1
    assert values["carry_hundreds"].tolist() == [1, 1, 0, 1]  # into the hundreds
    assert values["answer_units"].tolist() == [0, 0, 0, 0]
    # 155 + 255 = 410; without the carry into the hundreds the hundreds digit drops by one
    assert int(model.answer(a[:1], b[:1], {"carry_hundreds": torch.tensor([0])})) == 310
    # the units digit set to 7 leaves every other digit
    assert int(model.answer(a[:1], b[:1], {"answer_units": torch.tensor([7])})) == 417


def test_carry_matches_the_prompt_sets_carry_label(digit_tokenizer):
    prompts = ai.tasks.prompts_for_pairs(digit_tokenizer, "+", [155, 199, 123, 905], [255, 802, 111, 95],
                                         "{a}+{b}=", answer_digits=4)
    values = causal.addition(3).values(prompts.a, prompts.b)
    # the prompt set's carry_i is the carry *out of* column i, the causal model's carry_j the carry *into* j
    assert torch.equal(values["carry_hundreds"], prompts.label("carry_tens"))


def test_single_token_and_modular_models():
    single = causal.single_token_addition()
    a, b = torch.tensor([47, 99]), torch.tensor([38, 99])
    assert single.values(a, b)["sum_mod_10"].tolist() == [5, 8]
    assert single.values(a, b)["magnitude"].tolist() == [8, 19]
    assert int(single.answer(a[:1], b[:1], {"magnitude": torch.tensor([3])})) == 35
    modular = causal.modular_addition(113)
    assert modular.answer(torch.tensor([100, 3]), torch.tensor([20, 4])).tolist() == [7, 7]


def test_single_token_addition_splits_at_another_base():
    hundreds = causal.single_token_addition(base=100)
    a, b = torch.tensor([47, 99]), torch.tensor([38, 99])
    assert hundreds.values(a, b)["sum_mod_100"].tolist() == [85, 98]
    assert hundreds.values(a, b)["magnitude"].tolist() == [0, 1]
    assert int(hundreds.answer(a[:1], b[:1], {"magnitude": torch.tensor([1])})) == 185
    assert causal.single_token_addition().names == ["sum", "sum_mod_10", "magnitude", "answer"]  # the default
    with pytest.raises(ConfigError, match="base must be an int >= 2"):
        causal.single_token_addition(base=1)


def test_user_defined_models_are_checked():
    custom = causal.CausalModel("double", (causal.Variable("twice", ("a",), lambda a: 2 * a),
                                           causal.Variable("answer", ("twice", "b"), lambda t, b: t + b)))
    assert custom.answer(torch.tensor([3]), torch.tensor([1])).tolist() == [7]
    with pytest.raises(AnalysisError, match="not defined before it"):
        causal.CausalModel("bad", (causal.Variable("answer", ("c",), lambda c: c),))
    with pytest.raises(ConfigError, match="unknown variable 'carry_billions'.*accepted"):
        causal.addition(2).values(torch.tensor([1]), torch.tensor([1]), {"carry_billions": torch.tensor([1])})


# --- interchange datasets -----------------------------------------------------------------------


def test_interchange_pairs_are_balanced_and_held_out_by_operand_pair(planted):
    _, prompts = planted
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=400, seed=3)
    assert len(dataset) == 400 and dataset.meta["kept"] == 400
    assert (dataset.answer != dataset.base.answer).all() and (dataset.answer != dataset.source.answer).all()
    assert (dataset.base_value != dataset.source_value).all()
    expected = dataset.causal_model.answer(dataset.base.a, dataset.base.b, {"sum_mod_10": dataset.source_value})
    assert torch.equal(dataset.answer, expected)

    def pairs(rows):
        return {(int(s.a[i]), int(s.b[i])) for s in (dataset.base, dataset.source) for i in rows.tolist()}

    assert not pairs(dataset.train) & pairs(dataset.test)  # no operand pair on both sides
    assert 0.2 < len(dataset.test) / len(dataset) < 0.4
    # the source values are spread over the other values, not one favourite
    counts = torch.bincount(dataset.source_value, minlength=10)
    assert counts.min() > 0 and counts.max() < 3 * counts.float().mean()


@pytest.mark.slow
def test_shuffled_control_labels_do_not_follow_the_source(planted):
    _, prompts = planted
    control = causal.interchange_dataset(prompts, "sum_mod_10", n=400, seed=3, shuffle=True)
    assert control.shuffled and (control.answer != control.base.answer).all()
    true = control.causal_model.answer(control.base.a, control.base.b, {"sum_mod_10": control.source_value})
    assert (true != control.answer).float().mean() > 0.7  # the label is mostly not what the source says
    assert control.chance < 0.25  # moving the true value hits the shuffled one only by coincidence
    # a binary variable too: its shuffled copy agrees with the true value about half the time, not always
    binary = causal.interchange_dataset(prompts, "magnitude", n=400, seed=3, shuffle=True)
    assert 0.2 < binary.chance < 0.8


def test_dataset_input_errors(planted):
    _, prompts = planted
    with pytest.raises(ConfigError, match="test_fraction"):
        causal.interchange_dataset(prompts, "sum_mod_10", test_fraction=1.0)
    with pytest.raises(ConfigError, match="unknown variable 'carry_hundreds'"):
        causal.interchange_dataset(prompts, "carry_hundreds")
    with pytest.raises(AnalysisError, match="another answer than the prompts"):
        causal.interchange_dataset(prompts, "wraps", causal.modular_addition(7))


# --- DAS on the planted model -------------------------------------------------------------------


def test_planted_model_answers_through_its_plane(planted):
    model, prompts = planted
    assert prompts.evaluate(model).accuracy == 1.0


@pytest.mark.slow
def test_das_recovers_the_planted_subspace(planted_fit):
    model, dataset, result, before = planted_fit
    cosines = causal.principal_angle_cosines(result.basis, planted_plane())
    assert cosines.min() >= 0.99
    assert result.iia >= 0.99 and result.scores["das"]["low"] > 0.95
    assert result.scores["das"]["logit_diff"] > 5
    # the controls: a random plane and no intervention stay at chance (0 on balanced pairs)
    assert abs(result.scores["random"]["iia"] - result.chance) <= 0.05
    assert result.scores["none"]["iia"] == 0.0 and result.scores["none"]["logit_diff"] < 0
    # the whole vector also swaps the tens digit: the source's answer, never the counterfactual
    assert result.scores["full"]["iia"] <= 0.05
    # weights frozen and untouched, no gradients left on them
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_das_fits_a_half_precision_model(number_tokenizer):
    """A bfloat16 copy of the planted model: the rotation (float32) still finds the plane, the
    interchange runs in float32 and returns the model's dtype, and the weights stay untouched."""
    model = planted_model(number_tokenizer).to(torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = ai.tasks.arithmetic(model, op="+", a=range(10), b=range(10), template="{a}+{b}=")
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=600, seed=0)
    result = causal.das(model, dataset, "resid_post", 0, 2, positions="final", steps=150, baselines=("random",),
                        progress=False)
    assert causal.principal_angle_cosines(result.basis, planted_plane()).min() >= 0.98
    assert result.iia >= 0.95 and abs(result.scores["random"]["iia"] - result.chance) <= 0.05
    assert result.basis.dtype == torch.float32 and all(torch.isfinite(torch.tensor(result.history)))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_das_on_a_shuffled_variable_stays_at_chance(planted):
    model, prompts = planted
    control = causal.interchange_dataset(prompts, "sum_mod_10", n=600, seed=0, shuffle=True)
    result = causal.das(model, control, "resid_post", 0, 2, positions="final", steps=300, baselines=(), progress=False)
    assert result.iia <= control.chance + 0.05


@pytest.mark.slow
def test_das_at_a_position_without_the_variable_finds_nothing(planted):
    model, prompts = planted
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=400, seed=0)
    result = causal.das(model, dataset, "resid_post", 0, 2, positions="a", steps=100, baselines=(), progress=False)
    assert result.iia <= 0.05  # the operand position holds a alone, never the sum


@pytest.mark.slow
def test_boundless_das_finds_a_small_working_subspace(planted):
    model, prompts = planted
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=600, seed=0)
    result = causal.das(model, dataset, "resid_post", 0, positions="final", method="boundless", steps=400, lr=2e-2,
                        baselines=("random",), progress=False)
    assert result.iia >= 0.95
    assert result.k <= 4  # from a start of 16 dimensions
    cosines = causal.principal_angle_cosines(result.basis, planted_plane())
    assert cosines.min() >= 0.95  # the plane lies inside the learned subspace


@pytest.mark.slow
def test_results_frame_plot_save_load(planted_fit, tmp_path):
    _, _, result, _ = planted_fit
    frame = result.to_frame()
    assert set(frame["intervention"]) == {"das", "none", "full", "probe", "pca", "random"}
    assert {"iia", "iia_low", "iia_high", "logit_diff", "k", "chance"} <= set(frame.columns)
    assert (frame["iia_low"] <= frame["iia"]).all() and (frame["iia"] <= frame["iia_high"]).all()
    assert isinstance(result.plot(), go.Figure)
    loaded = causal.DASResult.load(result.save(tmp_path / "das"))
    assert torch.equal(loaded.basis, result.basis) and loaded.scores == result.scores
    assert loaded.to_frame().equals(frame)


@pytest.mark.slow
def test_sweep_finds_the_final_position(planted):
    model, prompts = planted
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=400, seed=0)
    sweep = causal.das_layers(model, dataset, layers=[0], positions=["a", "b", "final"], k=2, steps=150, progress=False)
    assert sweep.best()[1] == "final" and sweep.best()[2] >= 0.99
    assert float(sweep.iia[0, :2].max()) <= 0.05 and float(sweep.random_iia.max()) <= 0.05
    assert len(sweep.to_frame()) == 3 and isinstance(sweep.plot(), go.Figure)
    assert "final: =" in sweep.tokens[2]


def _interrupt_after(monkeypatch, n_fits: int) -> None:
    """Ctrl-C during das_layers' fit number ``n_fits + 1``."""
    import arithinterp.causal.layers as layers_module

    real, calls = layers_module.das, []

    def das(*args, **kwargs):
        calls.append(1)
        if len(calls) > n_fits:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(layers_module, "das", das)


def test_an_interrupted_layer_sweep_keeps_its_cells_and_resumes_to_the_whole_result(planted, monkeypatch, tmp_path):
    model, prompts = planted
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=200, seed=0)
    grid = dict(layers=[0], positions=["a", "b", "final"], k=2, steps=3, progress=False)
    whole = causal.das_layers(model, dataset, **grid)
    _interrupt_after(monkeypatch, 2)
    with pytest.warns(UserWarning, match="interrupted after 2 of 3 cells; pass the result as resume="):
        part = causal.das_layers(model, dataset, **grid)
    assert part.meta["stopped"] == "interrupted" and part.meta["done"] == [[True, True, False]]
    assert bool(torch.isnan(part.iia[0, 2])) and torch.equal(part.iia[0, :2], whole.iia[0, :2])
    part = causal.DASLayersResult.load(part.save(tmp_path / "part"))  # kept on disk, resumed from there
    monkeypatch.undo()
    resumed = causal.das_layers(model, dataset, **grid, resume=part)
    assert resumed.meta["stopped"] is None and resumed.meta["done"] == [[True, True, True]]
    for name in ("iia", "low", "high", "random_iia", "logit_diff"):
        assert torch.equal(getattr(resumed, name), getattr(whole, name)), name
    assert resumed.meta["n_test_per_cell"] == whole.meta["n_test_per_cell"]
    # a partial result of another call is refused before any fit
    for changed in (dict(grid, steps=4), dict(grid, positions=["b", "a", "final"]), dict(grid, k=1)):
        with pytest.raises(AnalysisError, match="resume was made with other settings or pairs"):
            causal.das_layers(model, dataset, **changed, resume=part)
    other_pairs = causal.interchange_dataset(prompts, "sum_mod_10", n=200, seed=1)
    with pytest.raises(AnalysisError, match="pairs_digest"):
        causal.das_layers(model, other_pairs, **grid, resume=part)
    # interrupted before the first fit finished: nothing to keep, the interrupt goes on
    _interrupt_after(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        causal.das_layers(model, dataset, **grid)


def test_das_every_layer_command_saves_an_interrupted_sweep_and_resumes_it(monkeypatch, tmp_path, capsys):
    import json

    from arithinterp.cli import main

    command = ["das", "zoo:add-100", "--variable", "magnitude", "--every-layer", "--layers", "0,1", "--steps", "2",
               "--limit", "200", "--json", "--no-progress", "--out", str(tmp_path / "fits")]
    _interrupt_after(monkeypatch, 1)
    assert main(command) == 130
    summary = json.loads(capsys.readouterr().out)
    assert summary["stopped"] == "interrupted" and (summary["cells_done"], summary["cells"]) == (1, 2)
    assert causal.DASLayersResult.load(tmp_path / "fits").meta["done"] == [[True], [False]]
    monkeypatch.undo()
    assert main([*command, "--resume", str(tmp_path / "fits"), "--overwrite"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "stopped" not in summary and summary["best_layer"] in (0, 1)
    fits = causal.DASLayersResult.load(tmp_path / "fits")
    assert fits.meta["done"] == [[True], [True]] and bool(torch.isfinite(fits.iia).all())
    assert main(["das", "zoo:add-100", "--variable", "magnitude", "--resume", str(tmp_path / "fits")]) == 2
    assert "--resume is for --every-layer" in capsys.readouterr().err


@pytest.mark.slow
def test_readable_vs_used_table(planted):
    model, prompts = planted
    table = causal.readable_vs_used(model, prompts, ["sum_mod_10", "magnitude"], layers=[0], steps=150, n=400,
                                    progress=False)
    rows = table.to_frame().set_index("variable")
    assert bool((rows["das_iia"] >= 0.99).all()) and bool((rows["random_iia"] <= 0.05).all())  # both used
    # the tens digit is one signed coordinate: readable by a linear probe, far above its shuffled control
    assert float(rows.loc["magnitude", "probe_accuracy"]) > 0.9 > 0.75 > float(rows.loc["magnitude", "probe_control"])
    # the units digit sits on a circle beside one-hot operands: a regularised linear probe does not read it
    # out of held-out operand pairs, yet the interchange shows the model uses it: used without being readable
    assert float(rows.loc["sum_mod_10", "probe_accuracy"]) < 0.5
    assert isinstance(table.plot(), go.Figure)


def test_das_input_errors(planted):
    model, prompts = planted
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=100, seed=0)
    with pytest.raises(SiteError, match="attn_z"):
        causal.das(model, dataset, "attn_z", 0, progress=False)
    with pytest.raises(ConfigError, match="k must be an int in 1..64"):
        causal.das(model, dataset, k=65, progress=False)
    with pytest.raises(ConfigError, match=r"das: method='pca' is not accepted .*accepts one of 'das', 'boundless'"):
        causal.das(model, dataset, method="pca", progress=False)  # pyright: ignore[reportArgumentType]
    with pytest.raises(SiteError, match="unknown position"):
        causal.das(model, dataset, positions="nowhere", steps=1, progress=False)
    with pytest.raises(ArithInterpError, match="InterchangeDataset"):
        causal.das(model, prompts, progress=False)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"engine='stepped' is not accepted .*engine accepts one of 'auto', 'hooks'"):
        causal.das(model, dataset, engine="stepped", progress=False)  # pyright: ignore[reportArgumentType]


# --- the engine's interchange intervention ---------------------------------------------------------


def test_engine_interchange_is_differentiable_in_the_intervention_only(tiny_model):
    tokens = torch.randint(3, 50, (4, 6))
    weight = torch.zeros(tiny_model.cfg.d_model, requires_grad=True)
    source = torch.randn(4, tiny_model.cfg.d_model)

    def swap(base, src):
        return base + (src - base) * torch.sigmoid(weight)

    iv = Write("resid_post", 0, positions=-1, value=swap, source=source)
    out = run(tiny_model, tokens, [iv], logits="final", train=True)
    assert out.logits is not None and out.logits.requires_grad
    (grad,) = torch.autograd.grad(out.logits.sum(), [weight])
    assert grad.abs().sum() > 0
    assert all(p.grad is None for p in tiny_model.parameters())
    with pytest.raises(AnalysisError, match="source slice has shape"):
        run(tiny_model, tokens, [Write("resid_post", 0, positions=-1, value=swap, source=source[:2])])


@pytest.mark.slow
def test_fit_runs_on_a_few_shot_llama_and_leaves_its_weights(llama_folder):
    from arithinterp import load_model

    model = load_model(str(llama_folder("digit", n_layers=4)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = ai.tasks.arithmetic(model, op="+", a=range(10, 40), b=range(10, 40), template="{a}+{b}=",
                                  few_shot=2)
    dataset = causal.interchange_dataset(prompts, "answer_units", n=120, seed=0)
    result = causal.das(model, dataset, "resid_post", 2, 2, positions="final", steps=5, baselines=("random", "pca"),
                        progress=False)
    assert 0.0 <= result.iia <= 1.0 and len(result.history) == 5
    assert all(torch.isfinite(torch.tensor(result.history)))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_das_command(capsys, tmp_path):
    import json

    from arithinterp.cli import main

    code = main(["das", "zoo:add-100", "--variable", "magnitude", "--layer", "0", "--steps", "3", "--limit", "300",
                 "--out", str(tmp_path / "das"), "--json", "--no-progress"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["variable"] == "magnitude" and summary["pairs"] > 100
    assert {row["intervention"] for row in summary["scores"]} == {"das", "none", "full", "probe", "pca", "random"}
    assert causal.DASResult.load(tmp_path / "das").variable == "magnitude"
    assert main(["das", "zoo:add-100", "--variable", "carry_hundreds", "--limit", "300", "--no-progress"]) == 2
    assert "unknown variable 'carry_hundreds'" in capsys.readouterr().err
    assert main(["das", "zoo:add-3digit", "--variable", "carry2", "--limit", "300", "--no-progress"]) == 2
    assert "unknown variable 'carry2': carries are named by the column they go into: 'carry_hundreds'" in \
        capsys.readouterr().err
    code = main(["das", "zoo:add-3digit", "--variable", "carry_hundreds", "--site", "mlp_post",
                 "--position", "b[1]+answer[0]", "--per-position", "--reachable-only", "--value-from", "product_parity",
                 "--k", "2", "--steps", "2", "--limit", "300", "--json", "--no-progress"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["unreachable"] == {"train": 0, "test": 0}  # b[1] comes before every answer digit
    assert 0.2 < summary["chance"] < 0.8  # the parity label: the true carry agrees with it by coincidence


@pytest.mark.slow
def test_several_positions_swap_through_one_subspace(planted):
    model, prompts = planted
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=400, seed=0)
    result = causal.das(model, dataset, "resid_post", 0, 2, positions=["b", "final"], steps=150, progress=False)
    assert result.position == "b+final" and result.iia >= 0.99
    assert causal.principal_angle_cosines(result.basis, planted_plane()).min() >= 0.99
    assert result.scores["random"]["iia"] <= 0.05 and result.scores["probe"]["k"] >= 1


@pytest.fixture(scope="module")
def planted_helix(number_tokenizer):
    model = planted_helix_model(number_tokenizer)
    prompts = ai.tasks.arithmetic(model, op="+", a=range(100), b=range(100), template="{a}+{b}=")
    return model, prompts[torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))[:600].tolist()]


def _oracle(model, dataset, variable):
    from arithinterp.causal.scoring import evaluate, source_values

    where = causal.Site("resid_post", 0, "final")
    sources = source_values(model, dataset, where, 256)
    return evaluate(model, dataset, where, causal.FixedSubspace(planted_helix_subspace(variable)), sources,
                    dataset.test, 256)["iia"]


@pytest.mark.slow
def test_a_helix_of_the_sum_splits_at_100_but_not_at_10(planted_helix):
    """The sum on a helix of periods 2, 5, 10, 100 (Kantamneni & Tegmark 2025): the model answers it,
    swapping the flag or the periodic part moves exactly the hundreds or the rest; the units digit's
    5 planted dims cannot move it alone, because the period 100 carries the base's tens and units."""
    model, prompts = planted_helix
    assert len(prompts.correct_only(model)) == len(prompts)
    hundreds = causal.single_token_addition(base=100)
    assert _oracle(model, causal.interchange_dataset(prompts, "magnitude", hundreds, n=300), "hundreds") == 1.0
    assert _oracle(model, causal.interchange_dataset(prompts, "sum_mod_100", hundreds, n=300), "sum_mod_100") == 1.0
    units = _oracle(model, causal.interchange_dataset(prompts, "sum_mod_10", n=300), "sum_mod_10")
    assert 0.4 <= units <= 0.8  # the nearest decade wins when the units move by 5 or more: about 2/3


@pytest.mark.slow
def test_das_recovers_a_planted_helix_flag(planted_helix):
    model, prompts = planted_helix
    dataset = causal.interchange_dataset(prompts, "magnitude", causal.single_token_addition(base=100), n=300)
    result = causal.das(model, dataset, "resid_post", 0, 1, positions="final", steps=60, baselines=("random",),
                        progress=False)
    assert result.iia >= 0.95 and result.scores["random"]["iia"] <= 0.05
    # within the dims the unembedding reads (the code and the flag) the learned direction is the flag; the
    # rest of the residual stream is read by nothing, so DAS gets no gradient to turn away from it
    read = result.basis[HELIX_DIMS: HUNDREDS_DIM + 1, 0]
    assert abs(float(read[-1])) / float(read.norm()) >= 0.99


# --- reachable pairs, per-head and per-position interchanges, the parity control ------------------


@pytest.fixture(scope="module")
def three_digit(digit_tokenizer):
    import random

    rng = random.Random(0)
    a = [rng.randrange(100, 1000) for _ in range(400)]
    b = [rng.randrange(100, 1000) for _ in range(400)]
    return ai.tasks.prompts_for_pairs(digit_tokenizer, "+", a, b, "{a}+{b}=", answer_digits=4)


def test_reachable_pairs_agree_with_the_base_before_the_intervened_position(three_digit):
    from arithinterp.causal.scoring import reachable

    dataset = causal.interchange_dataset(three_digit, "carry_hundreds", n=300, seed=0)
    rows = torch.arange(len(dataset))
    same_thousands = dataset.answer // 1000 == dataset.base.answer // 1000
    assert 0 < int((~same_thousands).sum()) < len(dataset)  # some counterfactuals change the thousands digit
    # the thousands digit is predicted at "=": answer[0] cannot reach a pair whose thousands digit changes
    assert torch.equal(reachable(dataset, rows, "answer[0]"), same_thousands)
    assert bool(reachable(dataset, rows, "final").all()) and bool(reachable(dataset, rows, "b[1]").all())
    assert bool(reachable(dataset, rows, ["final", "answer[0]"]).all())  # the earliest position counts
    assert not bool(reachable(dataset, rows, "answer[1]").any())  # the hundreds digit always changes


def test_parity_of_the_product_is_a_control_label(three_digit):
    model = causal.addition(3)
    a, b = torch.tensor([3, 4, 5]), torch.tensor([5, 5, 2])
    assert model.values(a, b)["product_parity"].tolist() == [1, 0, 0]
    assert torch.equal(model.answer(a, b, {"product_parity": torch.tensor([0, 1, 1])}), a + b)  # the sum ignores it
    control = causal.interchange_dataset(three_digit, "carry_hundreds", value_from="product_parity", n=300, seed=0)
    parity = control.causal_model.values(control.source.a, control.source.b)["product_parity"]
    # sources are drawn by their parity, and the label sets the carry to it
    expected = control.causal_model.answer(control.base.a, control.base.b, {"carry_hundreds": parity})
    assert torch.equal(control.answer, expected) and (parity != control.base_value).all()
    assert 0.2 < control.chance < 0.8  # the true carry agrees with the parity label only by coincidence
    with pytest.raises(ConfigError, match="another variable"):
        causal.interchange_dataset(three_digit, "carry_hundreds", value_from="carry_hundreds")
    with pytest.raises(ConfigError, match="one control at a time"):
        causal.interchange_dataset(three_digit, "carry_hundreds", value_from="product_parity", shuffle=True)
    with pytest.raises(ConfigError, match="unknown variable 'parity'"):
        causal.interchange_dataset(three_digit, "carry_hundreds", value_from="parity")


@pytest.mark.slow
def test_reachable_only_leaves_out_the_same_pairs_for_every_intervention(llama_folder):
    from arithinterp import load_model
    from arithinterp.causal.scoring import reachable

    model = load_model(str(llama_folder("digit")))
    a, b = torch.randint(100, 1000, (2, 300), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = ai.tasks.prompts_for_pairs(model, "+", a, b, "{a}+{b}=", answer_digits=4)
    dataset = causal.interchange_dataset(prompts, "carry_hundreds", n=200, seed=0)
    kept = int(reachable(dataset, dataset.test, "answer[0]").sum())
    assert 0 < kept < len(dataset.test)
    fit = causal.das(model, dataset, "resid_post", 1, 2, positions="answer[0]", steps=2, reachable_only=True,
                     progress=False)
    assert fit.meta["unreachable"]["test"] == len(dataset.test) - kept
    assert {s["n"] for s in fit.scores.values()} == {kept}  # DAS, no intervention and every baseline alike
    everything = causal.das(model, dataset, "resid_post", 1, 2, positions="answer[0]", steps=2, baselines=("random",),
                            progress=False)
    assert everything.scores["das"]["n"] == len(dataset.test) and everything.meta["unreachable"]["test"] == 0
    control = causal.interchange_dataset(prompts, "carry_hundreds", n=200, seed=0, shuffle=True)
    shuffled = causal.das(model, control, "resid_post", 1, 2, positions="answer[0]", steps=2, baselines=(),
                          reachable_only=True, progress=False)
    rows = control.test[reachable(control, control.test, "answer[0]")]
    assert shuffled.chance == control.chance_over(rows)  # the chance level over the pairs scored
    # a sweep cell no held-out pair is reachable from has no score (NaN), and best() passes over it
    sweep = causal.das_layers(model, dataset, layers=[1], positions=["final", "answer[1]"], k=2, steps=1,
                              reachable_only=True, progress=False)
    assert bool(torch.isnan(sweep.iia[0, 1])) and not bool(torch.isnan(sweep.iia[0, 0]))
    assert sweep.best()[1] == "final" and sweep.meta["n_test_per_cell"] == [[len(dataset.test), 0]]
    assert isinstance(sweep.plot(), go.Figure)


def test_one_heads_output_is_interchanged(planted):
    model, prompts = planted
    copy_b = causal.CausalModel("copy-b", (causal.Variable("b_value", ("b",), lambda b: b),
                                           causal.Variable("answer", ("a", "b_value"), lambda a, b: a + b)))
    dataset = causal.interchange_dataset(prompts, "b_value", copy_b, n=300, seed=0)
    # head 1 alone copies b to the final position: its whole output vector carries the variable, head 0's does not
    head1 = causal.das(model, dataset, "attn_z", 0, 2, positions="final", head=1, steps=1, baselines=("full",),
                       progress=False)
    head0 = causal.das(model, dataset, "attn_z", 0, 2, positions="final", head=0, steps=1, baselines=("full",),
                       progress=False)
    assert head1.site == "attn_z[1]" and head1.basis.shape == (model.cfg.d_head, 2)
    assert head1.scores["full"]["iia"] == 1.0 and head0.scores["full"]["iia"] <= 0.2
    with pytest.raises(SiteError, match="pass head"):
        causal.das(model, dataset, "attn_z", 0, 2, positions="final", head=2, progress=False)
    with pytest.raises(SiteError, match="only for the per-head sites"):
        causal.das(model, dataset, "resid_post", 0, 2, positions="final", head=1, progress=False)


@pytest.mark.slow
def test_each_position_can_swap_its_own_subspace(planted):
    model, prompts = planted
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=400, seed=0)
    result = causal.das(model, dataset, "resid_post", 0, 2, positions=["b", "final"], steps=150, per_position=True,
                        progress=False)
    assert result.iia >= 0.99 and result.basis.shape == (2, 64, 2)
    assert causal.principal_angle_cosines(result.basis[1], planted_plane()).min() >= 0.99  # the final position's
    assert result.scores["random"]["iia"] <= 0.05 and result.scores["probe"]["k"] >= 1
    with pytest.raises(ConfigError, match="at least 2 positions"):
        causal.das(model, dataset, "resid_post", 0, 2, positions="final", per_position=True, progress=False)
    with pytest.raises(ConfigError, match="method='das'"):
        causal.das(model, dataset, "resid_post", 0, positions=["b", "final"], method="boundless", per_position=True,
                   progress=False)


# --- resumed interchanges score what whole forwards score ------------------------------------------


@pytest.fixture(scope="module")
def add_3digit():
    from arithinterp.models.zoo import task_prompts

    model = ai.load_model("zoo:add-3digit")
    return model, task_prompts(model, "zoo:add-3digit", limit=600).correct_only(model)


CARRY_CELLS = [  # (variable, site, layer, position, options): the carries where the zoo model computes them, and not
    ("carry_hundreds", "mlp_post", 0, ["b[1]", "answer[0]"], dict(per_position=True)),
    ("carry_hundreds", "resid_post", 1, "answer[0]", dict(reachable_only=True)),
    ("carry_tens", "resid_post", 0, "final", {}),
    ("carry_tens", "attn_z", 1, "answer[1]", dict(head=3)),
]


@pytest.mark.slow
@pytest.mark.parametrize("cell", CARRY_CELLS, ids=lambda cell: f"{cell[0]}-{cell[1]}-L{cell[2]}")
def test_resumed_das_scores_what_whole_forwards_score(add_3digit, cell):
    """The fit's resumed runs (base runs kept, every interchange from the intervened layer, the
    answer positions alone unembedded) against one whole forward per interchange: every fixed
    subspace, and the rotation DAS learned, score the same held-out IIA exactly, with the same logit
    difference; training sees the same loss. (The learned rotations themselves differ by float
    rounding, which Adam's normalised steps carry on, so the trained IIA is compared by scoring one
    rotation both ways.)"""
    from arithinterp.causal.scoring import Runs, evaluate, reachable, source_values

    model, prompts = add_3digit
    variable, site, layer, position, options = cell
    dataset = causal.interchange_dataset(prompts, variable, n=300, seed=0)
    fits = {engine: causal.das(model, dataset, site, layer, 4, positions=position, steps=8, progress=False,
                               engine=engine, **options) for engine in ("hooks", "auto")}
    assert fits["hooks"].meta["engine"] == "hooks" and fits["auto"].meta["engine"] == "stepped"
    for name in ("none", "full", "probe", "pca", "random"):
        hooks, auto = fits["hooks"].scores[name], fits["auto"].scores[name]
        assert auto["iia"] == hooks["iia"] and auto["n"] == hooks["n"], name
        assert auto["logit_diff"] == pytest.approx(hooks["logit_diff"], abs=1e-4), name
    assert fits["auto"].history[0] == pytest.approx(fits["hooks"].history[0], rel=1e-5)
    where = causal.Site(site, layer, position, options.get("head"))
    basis = fits["hooks"].basis
    learned = (causal.PerPosition([causal.FixedSubspace(q) for q in basis]) if basis.ndim == 3
               else causal.FixedSubspace(basis))
    test = dataset.test[reachable(dataset, dataset.test, position)] if options.get("reachable_only") else dataset.test
    assert len(test) == fits["hooks"].meta["n_test"]
    sources = source_values(model, dataset, where, 64)
    runs = Runs(model, dataset, where, torch.cat([dataset.train, dataset.test]))
    assert runs.stepped
    assert torch.allclose(runs.source_values(64)[test], sources[test], atol=1e-5)
    whole = evaluate(model, dataset, where, learned, sources, test, 64)
    resumed = evaluate(model, dataset, where, learned, sources, test, 64, runs)
    assert resumed["iia"] == whole["iia"] and resumed["logit_diff"] == pytest.approx(whole["logit_diff"], abs=1e-4)
    assert abs(fits["auto"].iia - fits["hooks"].iia) <= 2 / len(test)  # float rounding in training: two pairs at most


@pytest.mark.slow
def test_resumed_das_on_a_few_shot_gemma3_scores_what_whole_forwards_score(digit_tokenizer, tmp_path):
    """A random-weight Gemma 3 folder (final norm, QK-norm, sliding and global layers), few-shot prompts:
    the same held-out scores and training losses resumed as with one whole forward per interchange."""
    from hf_families import save_family

    model = ai.load_model(str(save_family("gemma3", digit_tokenizer, tmp_path, n_layers=4)))
    prompts = ai.tasks.arithmetic(model, op="+", a=range(10, 40), b=range(10, 40), template="{a}+{b}=", few_shot=2)
    dataset = causal.interchange_dataset(prompts, "carry_tens", n=160, seed=0)
    for site, layer, position in (("resid_post", 1, "final"), ("mlp_post", 3, ["b[1]", "final"])):
        fits = {engine: causal.das(model, dataset, site, layer, 2, positions=position, steps=4, progress=False,
                                   engine=engine)
                for engine in ("hooks", "auto")}
        assert fits["auto"].meta["engine"] == "stepped"
        for name, hooks in fits["hooks"].scores.items():
            auto = fits["auto"].scores[name]
            assert auto["iia"] == hooks["iia"] and auto["logit_diff"] == pytest.approx(hooks["logit_diff"], abs=1e-4)
        assert fits["auto"].history == pytest.approx(fits["hooks"].history, rel=1e-5)


def test_training_drops_only_subnormal_gradient_entries():
    from arithinterp.causal.fit import _flush_subnormal

    grad = torch.tensor([1e-39, -1e-40, 1.2e-38, 0.5, -2.0, 0.0])
    kept = grad.clone()
    kept[:2] = 0.0  # below the smallest normal float32, 1.18e-38
    assert torch.equal(_flush_subnormal(grad), kept)
