"""The shipped zoo: every model loads, reaches its target on its held-out split, and retrains."""

import json

import pytest
import torch
from safetensors.torch import load_file

import arithinterp as ai
from arithinterp.cli import main
from arithinterp.models.zoo import ZOO, evaluate, get_entry

# name -> (lowest, highest) held-out exact-match accuracy the model must reach
TARGETS = {
    "modadd-113": (0.995, 1.0),
    "add-100": (0.99, 1.0),
    "add-3digit": (0.99, 1.0),
    "add-3digit-weak": (0.75, 0.95),
    "add-cyclic": (0.99, 1.0),  # the lowest of its task families (addition, weekday, month)
}


def test_every_zoo_model_has_a_target():
    assert set(TARGETS) == set(ZOO)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_reaches_its_target(name):
    entry = get_entry(name)
    model = ai.load_model(f"zoo:{name}")
    assert not model.training
    result = evaluate(entry, model, limit=3000)
    low, high = TARGETS[name]
    assert low <= result["accuracy"] <= high, result
    # the card's full held-out measurement agrees with the target too
    assert low <= entry.card()["held_out_accuracy"] <= high


@pytest.mark.parametrize("name", sorted(ZOO))
def test_bridge_logits_equal_the_trained_module(name):
    """The shipped weights compute the same function inside the bridge as in the training module."""
    from transformer_lens.model_bridge.sources.native import NativeModel

    from arithinterp.models.train import bridge_config, logits_at

    entry = get_entry(name)
    model = ai.load_model(f"zoo:{name}")
    config = json.loads((entry.directory / "config.json").read_text())
    net = NativeModel(bridge_config(entry, config["d_vocab"], config["seed"]))
    net.load_state_dict(load_file(str(entry.directory / "model.safetensors")))
    net.eval()
    tokens = torch.randint(3, config["d_vocab"], (16, config["n_ctx"]))
    with torch.inference_mode():
        expected = net(tokens)
        assert (model(tokens) - expected).abs().max() <= 1e-4  # float32 summation order only
        # and the training-time fast path agrees with the full forward
        positions = torch.arange(config["n_ctx"] - 2, config["n_ctx"])
        assert (logits_at(net, tokens, positions) - expected[:, positions]).abs().max() <= 1e-5


def test_modadd_snapshots_load():
    steps = get_entry("modadd-113").snapshot_steps()
    assert len(steps) >= 8
    early = ai.load_model(f"zoo:modadd-113@step={steps[0]}")
    final = ai.load_model("zoo:modadd-113")
    tokens = torch.tensor([[3, 20, 120]])
    assert not torch.allclose(early(tokens), final(tokens))
    with pytest.raises(ai.ArithInterpError, match="no snapshot"):
        ai.load_model("zoo:modadd-113@step=1")


def test_shipped_checkpoints_are_small():
    total = sum(f.stat().st_size for name in ZOO for f in get_entry(name).directory.iterdir())
    assert total < 15 * 2**20


@pytest.mark.slow
def test_train_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "add-100"
    assert main(["train", "add-100", "--steps", "8", "--out", str(out), "--no-progress", "--json"]) == 0
    card = json.loads(capsys.readouterr().out)
    assert card["steps_run"] == 8 and 0.0 <= card["held_out_accuracy"] <= 1.0
    for f in ("model.safetensors", "config.json", "tokenizer.json", "card.json"):
        assert (out / f).exists()
    model = ai.load_model(str(out))  # a trained folder loads like any model
    assert model.cfg.n_layers == get_entry("add-100").config["n_layers"]


def test_train_rejects_unknown_model(capsys):
    with pytest.raises(SystemExit):
        main(["train", "add-1000"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.fixture()
def interrupted_training(monkeypatch, tmp_path):
    """Training that stops at its first step, the tokenizer already written (into the temp folder
    beside --out, which the test checks): the first forward raises KeyboardInterrupt."""
    from arithinterp.models import train as train_module

    written = []

    def interrupt(net, inputs, positions):
        written.extend(tmp_path.glob(".*.tmp/tokenizer.json"))
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "logits_at", interrupt)
    return written


def test_interrupted_train_command_leaves_no_out_folder(tmp_path, interrupted_training, capsys):
    out = tmp_path / "add-100"
    assert main(["train", "add-100", "--steps", "5", "--out", str(out), "--no-progress"]) == 130
    assert "arithinterp train: interrupted" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nor a half-written folder beside it
    assert interrupted_training, "training must have started, its tokenizer written"


def test_interrupted_train_command_keeps_the_folder_it_would_overwrite(tmp_path, interrupted_training):
    out = tmp_path / "add-100"
    out.mkdir()
    (out / "card.json").write_text('{"name": "previous"}')
    assert main(["train", "add-100", "--steps", "5", "--out", str(out), "--overwrite", "--no-progress"]) == 130
    assert [p.name for p in out.iterdir()] == ["card.json"]
    assert (out / "card.json").read_text() == '{"name": "previous"}'
    assert list(tmp_path.iterdir()) == [out]
    assert interrupted_training


def test_failed_training_leaves_out_as_it_was(tmp_path, monkeypatch):
    from arithinterp.models import train as train_module

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(train_module, "exact_match", fail)  # its first held-out check, mid-run
    with pytest.raises(RuntimeError, match="out of memory"):
        train_module.train("add-100", out=tmp_path / "add-100", steps=1, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_overwritten_folder_is_replaced_whole(tmp_path):
    from arithinterp.models.train import train

    out = tmp_path / "add-100"
    out.mkdir()
    (out / "notes.txt").write_text("from an earlier run")
    card = train("add-100", out=out, steps=1, progress=False, overwrite=True)
    assert card["steps_run"] == 1
    assert sorted(p.name for p in out.iterdir()) == ["card.json", "config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert list(tmp_path.iterdir()) == [out]  # no temp folder left beside it
