"""This package's files against the reference tools: the half that runs here (see benchmarks/peers.md).

    PYTHONPATH=. python benchmarks/peers.py export OUT   # write graphs, transcoders, a DAS subspace, data
    (peers venv) python benchmarks/peers_reference.py OUT  # circuit-tracer, SAELens, pyvene on them
    PYTHONPATH=. python benchmarks/peers.py compare OUT  # read circuit-tracer's .pt graphs back here

``export`` writes, for zoo:add-100 and its shipped transcoders: the transcoders in circuit-tracer's
and SAELens's layouts; for each prompt the graph (``zero_positions=(0,)``, as circuit-tracer's
default) as circuit-tracer's viewer JSON, its edges in circuit-tracer's node order and its answer
tokens; the model's logits on those prompts; a DAS fit's subspace as a pyvene save (for a
TransformerLens model) with the held-out pairs as token ids and this package's IIA. ``compare``
reads the ``.pt`` graphs the reference wrote and prints the largest edge difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

PROMPTS = ["36+59=", "12+7=", "81+18=", "45+45="]


def export(out: Path, steps: int) -> None:
    from safetensors.torch import save_file

    from arithinterp import causal
    from arithinterp.causal.scoring import batches
    from arithinterp.features import (
        load_transcoders, write_circuit_tracer_graph, write_circuit_tracer_transcoders, write_saelens,
    )
    from arithinterp.features.graph import prompt_graph
    from arithinterp.features.graph_files import circuit_tracer_order
    from arithinterp.models import load_model
    from arithinterp.models.zoo import task_prompts

    out.mkdir(parents=True, exist_ok=True)
    model = load_model("zoo:add-100")
    transcoders = load_transcoders("zoo:add-100")
    write_circuit_tracer_transcoders(transcoders, out / "ct_transcoders", model_name="zoo:add-100")
    write_saelens(transcoders, out / "saelens", model_name="zoo:add-100")
    graphs = []
    for i, prompt in enumerate(PROMPTS):
        graph = prompt_graph(model, prompt, transcoders, n_logits=3, zero_positions=(0,), progress=False)
        write_circuit_tracer_graph(graph, out / "ours" / f"g{i}.json")
        order = circuit_tracer_order(graph)
        tokens = [n["token_id"] for n in sorted(graph.nodes, key=lambda n: n["position"]) if n["kind"] == "embedding"]
        logits = [n["token_id"] for n in graph.nodes if n["kind"] == "logit"]
        save_file({"edges": graph.edges[order][:, order].contiguous(), "tokens": torch.tensor(tokens),
                   "logit_tokens": torch.tensor(logits)}, str(out / "ours" / f"g{i}.safetensors"))
        graphs.append(dict(prompt=prompt, file=f"g{i}", n_nodes=len(graph.nodes), scores=graph.scores))
    tokens = model.to_tokens(PROMPTS)
    with torch.inference_mode():
        save_file({"tokens": tokens, "logits": model(tokens).float().contiguous()}, str(out / "logits.safetensors"))
    # DAS as docs/causal.md runs it: the carry into the hundreds in layer 0's MLP neurons, one
    # 4-dimensional subspace at each of two tokens (so two pyvene interventions)
    model3 = load_model("zoo:add-3digit")
    prompts = task_prompts(model3, "zoo:add-3digit", limit=2000).correct_only(model3)
    dataset = causal.interchange_dataset(prompts, "carry_hundreds", n=1200, seed=0)
    position = ["b[1]", "answer[0]"]
    fit = causal.das(model3, dataset, site="mlp_post", layer=0, positions=position, k=4, per_position=True, steps=steps,
                     baselines=(), progress=False)
    causal.write_pyvene(fit, out / "das")
    rows = {name: [] for name in ("base", "source", "position", "target")}
    first = set()
    for batch in batches(dataset, dataset.test, position, 4096):
        rows["base"].append(batch.base_tokens)
        rows["source"].append(batch.source_tokens)
        rows["position"].append(batch.position)
        rows["target"].append(batch.targets)
        first.add(batch.first_answer)
    assert len(first) == 1, "one prompt length here"
    save_file({name: torch.cat(value).contiguous() for name, value in rows.items()}, str(out / "das_pairs.safetensors"))
    summary = dict(graphs=graphs, das=dict(variable=fit.variable, site=fit.site, layer=fit.layer,
                                           position=fit.position, k=fit.k, iia=fit.iia, n=fit.scores["das"]["n"],
                                           steps=steps, first_answer=first.pop(), model="zoo:add-3digit"))
    (out / "ours.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["das"]))


def compare(out: Path) -> None:
    from safetensors.torch import load_file

    from arithinterp.features import read_circuit_tracer_graph
    from arithinterp.features.graph_files import circuit_tracer_order
    from arithinterp.models import load_model

    model = load_model("zoo:add-100")
    print("| prompt | nodes | max abs edge difference (our graph read back from circuit-tracer's .pt) |")
    print("|---|---|---|")
    for i, prompt in enumerate(PROMPTS):
        path = out / "reference" / f"g{i}.pt"
        if not path.is_file():
            print(f"| {prompt} | no {path} | |")
            continue
        graph = read_circuit_tracer_graph(path, model)
        ours = load_file(str(out / "ours" / f"g{i}.safetensors"))["edges"]
        theirs = graph.edges[circuit_tracer_order(graph)][:, circuit_tracer_order(graph)]
        print(f"| {prompt} | {len(graph.nodes)} | {float((theirs - ours).abs().max()):.3g} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["export", "compare"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=200, help="DAS training steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    export(args.out, args.steps) if args.mode == "export" else compare(args.out)


if __name__ == "__main__":
    sys.exit(main())
