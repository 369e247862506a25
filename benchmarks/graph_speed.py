"""Attribution graphs on Gemma 3 270M against circuit-tracer's ``attribute``: the same model, prompt
and transcoders, one thread each, timed in alternating rounds.

    PYTHONPATH=. python benchmarks/graph_speed.py export OUT [--transcoders DIR]
    PYTHONPATH=. python benchmarks/graph_speed.py run OUT --reference-python /work/peers-venv/bin/python

``export`` (the ``gemma3`` extra) writes, from ``pkg:gemma-3-270m``:

* ``OUT/hf``: the model's de-quantized float32 weights as a Hugging Face folder (``config.json``
  with the fields transformers 4.57 reads too, ``model.safetensors``, the tokenizer), which this
  package loads as it loads any local folder and TransformerLens 2.18 builds
  ``HookedTransformer.from_pretrained("google/gemma-3-270m", hf_model=...)`` from;
* ``OUT/transcoders``: the transcoders, this package's layout: ``--transcoders DIR`` (a trained
  set), or by default random TopK ones of the shape of Gemma's (``--features`` 1,024 per layer,
  k = 32, unit decoder rows, no skip): a graph's cost depends on how many features are active,
  not on what they mean;
* ``OUT/ct_transcoders``: the same transcoders in circuit-tracer's layout;
* ``OUT/prompt.safetensors``: the ``{a}+{b}=`` prompt of 36 + 59 after 3 solved examples (2-digit
  operands, seeded) and its final logits.

``run`` loads the model from ``OUT/hf`` (its logits checked against the exported ones), starts
``benchmarks/graph_speed_reference.py`` in the reference environment (``--reference-python``; see
benchmarks/peers.md) and, once both have made one warm-up graph, alternates rounds — ours, then
circuit-tracer's, ``--rounds`` times — so that the machine's load falls on both alike. Both graphs
use the same settings: the top answer token as the one output (``n_logits=1``), position 0 zeroed
(circuit-tracer's default), ``max_feature_nodes=1000`` (circuit-tracer's default there), 32
targets per backward and four backwards per influence update (circuit-tracer's ``update_interval``
4 at ``batch_size=32``), so that both choose the same features. (circuit-tracer's own default,
``batch_size=512``, runs its forward on 512 copies of the prompt and keeps them for the backwards:
far past this machine's memory for Gemma 3 270M.) Prints medians, each round's ratio, the load
average, and the two graphs side by side (the same nodes, the largest edge difference).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MAX_FEATURE_NODES = 1000
BATCH = 32
A, B, SHOTS, TEMPLATE = 36, 59, 3, "{a}+{b}="


def export(out: Path, transcoders_dir: str | None, n_features: int) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import arithinterp as ai
    from arithinterp.checks import fingerprint
    from arithinterp.features import Transcoders, load_transcoders, write_circuit_tracer_transcoders
    from arithinterp.models import packaged_path
    from arithinterp.tasks import few_shot_prefix, prompts_for_pairs

    path = packaged_path("pkg:gemma-3-270m").resolve()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32,
                                              local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path), local_files_only=True)
    folder = out / "hf"
    folder.mkdir(parents=True, exist_ok=True)
    # the unembedding is tied to the embedding: written once
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = ["Gemma3ForCausalLM"]
    # transformers 4.57 reads the rotary bases from these fields (5.x from rope_parameters)
    rope = config.get("rope_parameters") or {}
    config.update(rope_theta=rope.get("full_attention", {}).get("rope_theta", 1e6),
                  rope_local_base_freq=rope.get("sliding_attention", {}).get("rope_theta", 1e4),
                  rope_scaling=None, sliding_window_pattern=6)
    (folder / "config.json").write_text(json.dumps(config, indent=1, default=str))
    tokenizer.save_pretrained(str(folder))
    probe = tokenizer("12+7=19\n36+59=", return_tensors="pt").input_ids
    with torch.inference_mode():  # before a bridge is built over the same model class
        gguf_logits = hf(probe).logits[0, -1].float()

    model = ai.load_model(str(folder))
    shots = few_shot_prefix(SHOTS, "+", TEMPLATE, range(10, 100), range(10, 100), None, seed=0)
    prompt = prompts_for_pairs(model, "+", [A], [B], TEMPLATE, few_shot=shots)
    tokens = prompt.unpadded(torch.arange(1))[0][None]  # [1, T]
    with torch.inference_mode():
        logits = model(tokens)[0, -1].float()
        gap = float((model(probe)[0, -1].float() - gguf_logits).abs().max())
    print(f"this package's model from the folder against the GGUF's: final logits max abs difference {gap:.3g}")
    save_file({"tokens": tokens[0].contiguous(), "logits": logits.contiguous()}, str(out / "prompt.safetensors"))

    if transcoders_dir:
        transcoders = load_transcoders(transcoders_dir)
    else:
        L, d = int(model.cfg.n_layers), int(model.cfg.d_model)
        g = torch.Generator().manual_seed(0)
        W_dec = torch.randn(L, n_features, d, generator=g)
        transcoders = Transcoders(
            W_enc=torch.randn(L, d, n_features, generator=g) / d**0.5, b_enc=torch.zeros(L, n_features),
            W_dec=W_dec / W_dec.norm(dim=-1, keepdim=True), b_dec=torch.zeros(L, d), W_skip=torch.zeros(L, d, d),
            layers=list(range(L)), k=32, metrics={},
            meta=dict(model="pkg:gemma-3-270m", fingerprint=fingerprint(model), kind="random TopK"))
    transcoders.save(out / "transcoders", overwrite=True)
    write_circuit_tracer_transcoders(transcoders, out / "ct_transcoders", model_name="google/gemma-3-270m",
                                     overwrite=True)
    summary = dict(prompt=model.to_string(tokens[0]), tokens=int(tokens.shape[1]),
                   transcoders=transcoders_dir or f"random TopK, {transcoders.n_features} features, k=32")
    (out / "export.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


class Reference:
    """circuit-tracer's side, in its own process: one JSON line back per command."""

    def __init__(self, python: str, out: Path):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        self.process = subprocess.Popen([python, str(ROOT / "benchmarks" / "graph_speed_reference.py"), str(out)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self._answer()

    def _answer(self) -> dict:
        assert self.process.stdout is not None
        for line in self.process.stdout:  # the tools' own messages are passed over
            if line.startswith("@@ "):
                return json.loads(line[3:])
        raise RuntimeError(f"the reference process ended (exit {self.process.wait()})")

    def ask(self, *words) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.ask("quit")
        self.process.wait()


def timed(fn) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def run(out: Path, python: str | None, rounds: int, compare_graphs: bool) -> None:
    from safetensors.torch import load_file

    import arithinterp as ai
    from arithinterp.features import load_transcoders
    from arithinterp.features.graph import prompt_graph

    torch.set_num_threads(1)
    reference = Reference(python, out) if python else None
    exported = load_file(str(out / "prompt.safetensors"))
    model = ai.load_model(str(out / "hf"))
    tokens = exported["tokens"]
    with torch.inference_mode():
        gap = float((model(tokens[None])[0, -1].float() - exported["logits"]).abs().max())
    transcoders = load_transcoders(str(out / "transcoders"))
    summary = json.loads((out / "export.json").read_text())
    print(f"Gemma 3 270M (float32), {summary['tokens']}-token prompt {summary['prompt']!r}, {summary['transcoders']}; "
          f"this package's model against the exported logits: {gap:.3g}")
    if reference is not None:
        print(f"circuit-tracer's side: {json.dumps(reference.ready)}")

    def ours():
        return prompt_graph(model, tokens, transcoders, n_logits=1, zero_positions=(0,),
                            max_feature_nodes=MAX_FEATURE_NODES, batch_size=BATCH, progress=False)

    timed(ours)  # warm-up
    if reference is not None:
        reference.ask("round", BATCH)
    rows: dict[str, list] = {"ours": [], f"circuit-tracer `attribute`, batch_size={BATCH}": []}
    loads = [os.getloadavg()[0]]
    for _ in range(rounds):
        wall, cpu, graph = timed(ours)
        rows["ours"].append((wall, cpu))
        if reference is not None:
            answer = reference.ask("round", BATCH)
            rows[f"circuit-tracer `attribute`, batch_size={BATCH}"].append((answer["seconds"], answer["cpu"]))
        loads.append(os.getloadavg()[0])
    print(f"\n{rounds} rounds, alternating; load average (1 min) {min(loads):.1f}-{max(loads):.1f} "
          f"on {os.cpu_count()} cores\n")
    print("| graph | wall s, median (rounds) | CPU s, median (rounds) | ours faster: wall | ours faster: CPU |")
    print("|---|---|---|---|---|")
    for name, times in rows.items():
        if not times:
            continue
        cells = []
        for i in (0, 1):  # wall, then CPU: each round's ratio to ours in the same round, then their median
            values = [t[i] for t in times]
            cells.append(f"{statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})")
        for i in (0, 1):
            ratios = [t[i] / o[i] for t, o in zip(times, rows["ours"])]
            cells.append("" if name == "ours" else
                         f"**{statistics.median(ratios):.1f}×** ({', '.join(f'{r:.1f}' for r in ratios)})")
        print(f"| {name} | {' | '.join(cells)} |")
    s = graph.scores
    print(f"\nours: {s['n_expanded_features']} of {s['n_active_features']} active features expanded; exactness "
          f"{s['max_abs_error']:.2g} (features), {s['max_rel_error_logits']:.2g} relative (logits)")
    if reference is not None:
        if compare_graphs:
            compare(graph, reference, out)
        reference.close()


def compare(graph, reference: Reference, out: Path) -> None:
    """Our graph against circuit-tracer's at the same settings: nodes and edges."""
    from safetensors.torch import load_file

    from arithinterp.features.graph_files import circuit_tracer_order

    reference.ask("save", out / "reference_graph.safetensors", BATCH)
    theirs = load_file(str(out / "reference_graph.safetensors"))
    order = circuit_tracer_order(graph)
    nodes = [graph.nodes[i] for i in order.tolist()]
    ours_features = {(n["layer"], n["position"], n["feature"]) for n in nodes if n["kind"] == "feature"}
    their_features = {tuple(row) for row in theirs["selected"].tolist()}
    same = ours_features == their_features
    print(f"\ncircuit-tracer (batch_size={BATCH}) against ours: {len(their_features)} / {len(ours_features)} features "
          f"expanded, the same: {same}; active {int(theirs['n_active'])} / {graph.scores['n_active_features']}")
    edges = graph.edges[order][:, order]
    if same and edges.shape == theirs["adjacency"].shape:
        gap = (edges - theirs["adjacency"]).abs()
        scale = edges.abs().max()
        print(f"edges: max abs difference {float(gap.max()):.3g} on edges up to {float(scale):.3g} "
              f"({float(gap.max() / scale):.2g} of the largest); {int((edges != 0).sum())} non-zero edges here, "
              f"{int((theirs['adjacency'] != 0).sum())} there")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["export", "run"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--transcoders", default=None, metavar="DIR", help="trained transcoders (default: random)")
    parser.add_argument("--features", type=int, default=1024, help="features per layer of the random transcoders")
    parser.add_argument("--reference-python", default=None, help="the reference environment's python")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-compare", action="store_true",
                        help="skip the graphs' side-by-side comparison (one more circuit-tracer graph)")
    args = parser.parse_args()
    if args.what == "export":
        export(args.out, args.transcoders, args.features)
    else:
        run(args.out, args.reference_python, args.rounds, not args.no_compare)


if __name__ == "__main__":
    main()
