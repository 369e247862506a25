"""Edge scores: EAP and EAP-IG against exact edge (path) patching on the zoo models.

For each model: correctly answered prompts ``{a}+{b}=``, pairs that vary ``a`` (answers differ),
metric ``logit_diff`` (clean − corrupt answer logit at the final position, the first answer token).
Every edge of the position-free graph (embeddings, heads' q/k/v inputs, MLPs, logits) is scored

* exactly: each edge patched alone (``circuits.patch_edges``, all edges stacked along the batch);
* by EAP (Syed et al. 2023) and EAP-IG with ``--steps`` interpolations (Hanna et al. 2024).

Reported: Pearson and Spearman correlation of the mean (over pairs) edge scores with the exact
ones, wall time (median of ``--runs``, one thread), forward/backward passes per batch, and the
smallest top-k circuit by EAP-IG ranking whose normalised faithfulness (complement ablated by
resampling the corrupt prompt) reaches 0.9, with its size as a fraction of all edges.

Speed (``--speed``): every edge of a random-weight 4-layer d256 Llama-family model (8 heads, 2
key/value heads, d_mlp 688; a local Hugging Face folder loaded with ``load_model``) on few-shot
prompts, scored by EAP-IG in one batch: wall time, forward/backward passes, peak memory (the
largest resident-set increase), and the same for exact patching of every edge.

Exact edges, before and after (``--exact``): exact patching of every edge alone
(``circuits.patch_edges``) and a faithfulness curve (``circuits.faithfulness_curve``, complement
resampled) with whole stacked forwards (``engine="hooks"``, the reference) and through the block
stepper (the default), side by side in one process, on that Llama setup and on a zoo model:
medians of ``--runs`` repeats, their ratio, and the largest score difference.

    python benchmarks/circuits.py [--pairs 100] [--steps 5] [--runs 3] [--write docs/circuits.md]
    python benchmarks/circuits.py --speed [--write-speed docs/benchmarks.md]
    python benchmarks/circuits.py --exact [--runs 3] [--exact-width 256] [--write-exact docs/benchmarks.md]
    python benchmarks/circuits.py --quick

Neurons as receivers (``--neurons``): on each zoo model, every edge into every ``--neuron-step``-th
neuron of the last MLP (from the embeddings, every head and the earlier MLPs) patched exactly
alone (``circuits.patch_neuron_edges``) and scored by EAP and EAP-IG (``attribute_edges(neurons=...)``):
Pearson and Spearman of the pair-mean scores, and the exactness of the exact path (every sender's
edge into one neuron at once against a whole forward with that neuron's activation patched).

    python benchmarks/circuits.py --neurons [--zoo-pairs 50] [--neuron-step 4]
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import torch
from patching import median_time  # benchmarks/patching.py: the same median timing

BEGIN, END = "<!-- circuits:begin -->", "<!-- circuits:end -->"
SPEED_BEGIN, SPEED_END = "<!-- circuits-speed:begin -->", "<!-- circuits-speed:end -->"
EXACT_BEGIN, EXACT_END = "<!-- circuits-exact:begin -->", "<!-- circuits-exact:end -->"


def ranks(x: torch.Tensor) -> torch.Tensor:
    return torch.argsort(torch.argsort(x)).double()


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


def zoo_pairs(name: str, n_pairs: int):
    """The zoo model ``name`` and ``n_pairs`` seeded counterfactual pairs varying ``a``, drawn from
    its correctly answered prompts (also the pairs ``benchmarks/ig_activations.py`` scores)."""
    import arithinterp as ai
    from arithinterp.models.zoo import ZOO, zoo_prompts

    model = ai.load_model(f"zoo:{name}")
    entry = ZOO[name]
    task = entry.task
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(task.a_range[0], task.a_range[1], (4 * n_pairs,), generator=gen).tolist()
    b = torch.randint(task.b_range[0], task.b_range[1], (4 * n_pairs,), generator=gen).tolist()
    pairs = zoo_prompts(model, entry, a, b).correct_only(model).counterfactual(vary="a", seed=0)
    return model, pairs[torch.randperm(len(pairs), generator=gen)[:n_pairs]]


def bench(name: str, n_pairs: int, steps: int, runs: int) -> list[str]:
    from arithinterp.circuits import EdgeGraph, attribute_edges, faithfulness_curve, patch_edges, score_edges

    model, pairs = zoo_pairs(name, n_pairs)
    graph = EdgeGraph.of(model)
    t_exact, exact = median_time(lambda: patch_edges(model, pairs, graph, progress=False), runs)
    ref = exact["scores"].mean(0)
    rows = []
    for method, k in (("eap", None), ("eap-ig", steps)):
        t, got = median_time(lambda: attribute_edges(model, pairs, graph, method=method, ig_steps=k or 1, batch_size=len(pairs), progress=False), runs)
        est = got["scores"].mean(0)
        rows.append((method if k is None else f"{method} ({k} steps)", pearson(est, ref), pearson(ranks(est), ranks(ref)), t, got["passes_per_batch"]))
    circuit = score_edges(model, pairs, "eap-ig", ig_steps=steps, batch_size=len(pairs), progress=False)
    n = circuit.n_edges
    sizes = sorted({0, n, *[max(1, round(n * f)) for f in (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5)]})
    curve = faithfulness_curve(model, pairs, circuit, sizes=sizes)
    smallest = curve.smallest(0.9)
    lines = [f"**`zoo:{name}`** — {len(pairs)} pairs, {graph.n_edges} edges, exact patching {t_exact:.2f} s ({exact['forwards']} stacked forwards)", "",
             "| method | Pearson vs exact | Spearman vs exact | time (s) | passes per batch |", "|---|---:|---:|---:|---:|"]
    for method, p, s, t, passes in rows:
        lines.append(f"| {method} | {p:.3f} | {s:.3f} | {t:.2f} | {passes} |")
    lines += ["", "Faithfulness of the top-k edges by EAP-IG (complement resampled from the corrupt prompt): "
              + ", ".join(f"{int(k)}: {float(v):.3f}" for k, v in zip(curve.sizes, curve.faithfulness)), "",
              f"Smallest top-k circuit reaching 0.9: {smallest} edges ({smallest / n:.1%} of {n})" if smallest is not None else "No top-k circuit reaches 0.9.", ""]
    return lines


def speed(n_pairs: int, steps: int, few_shot: int, runs: int) -> list[str]:
    from patching import PeakMemory, llama_model  # benchmarks/patching.py

    from arithinterp.circuits import EdgeGraph, attribute_edges, patch_edges
    from arithinterp.tasks import arithmetic

    model = llama_model(4, 256, 8, 2, 688)
    prompts = arithmetic(model, a=range(100), b=range(100), few_shot=few_shot)
    pairs = prompts.counterfactual(vary="a", seed=0)[:n_pairs]
    graph = EdgeGraph.of(model)
    T = pairs.clean.tokens.shape[1]
    lines = [f"**Llama 4L d256 (HF folder, random weights)** — {len(pairs)} pairs of {T} tokens ({few_shot}-shot prefix), "
             f"{graph.n_edges} edges, one CPU thread, median of {runs} runs", "",
             "| method | time (s) | passes per batch | peak memory (MiB) | Pearson vs exact |", "|---|---:|---:|---:|---:|"]
    with PeakMemory() as mem:
        t_exact, exact = median_time(lambda: patch_edges(model, pairs, graph, progress=False), runs)
    ref = exact["scores"].mean(0)
    for method in ("eap", "eap-ig"):
        with PeakMemory() as m:
            t, got = median_time(lambda: attribute_edges(model, pairs, graph, method=method, ig_steps=steps, batch_size=len(pairs), progress=False), runs)
        label = method if method == "eap" else f"eap-ig ({steps} steps)"
        lines.append(f"| {label} | {t:.2f} | {got['passes_per_batch']} | {m.peak:.0f} | {pearson(got['scores'].mean(0), ref):.3f} |")
    lines.append(f"| exact, every edge alone | {t_exact:.2f} | {exact['forwards']} stacked forwards | {mem.peak:.0f} | 1 |")
    return lines


def exact_cases(n_pairs: int, few_shot: int, zoo_pairs: int, width: int = 256):
    """(label, model, pairs): the Llama 4L d256 speed setup (``width`` narrows it: the same heads and
    edges, d_mlp in proportion) and ``zoo:add-3digit``."""
    from patching import llama_model  # benchmarks/patching.py

    import arithinterp as ai
    from arithinterp.models.zoo import ZOO, zoo_prompts
    from arithinterp.tasks import arithmetic

    model = llama_model(4, width, 8, 2, width * 688 // 256)
    prompts = arithmetic(model, a=range(100), b=range(100), few_shot=few_shot)
    yield f"Llama 4L d{width} (HF folder, random weights)", model, prompts.counterfactual(vary="a", seed=0)[:n_pairs]
    model = ai.load_model("zoo:add-3digit")
    entry = ZOO["add-3digit"]
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(entry.task.a_range[0], entry.task.a_range[1], (4 * zoo_pairs,), generator=gen).tolist()
    b = torch.randint(entry.task.b_range[0], entry.task.b_range[1], (4 * zoo_pairs,), generator=gen).tolist()
    pairs = zoo_prompts(model, entry, a, b).correct_only(model).counterfactual(vary="a", seed=0)[:zoo_pairs]
    yield "`zoo:add-3digit`", model, pairs


def exact_speed(n_pairs: int, few_shot: int, zoo_pairs: int, runs: int, width: int = 256) -> list[str]:
    """Whole forwards (``engine="hooks"``) against the stepped default, repeat by repeat."""
    import statistics
    import time

    from arithinterp.circuits import EdgeGraph, faithfulness_curve, patch_edges, score_edges

    lines = [f"One CPU thread, torch {torch.__version__}; each repeat times the whole-forward reference and the "
             f"stepped default one after the other; medians of {runs} repeats.", "",
             "| model | prompts | analysis | whole forwards (s) | stepped (s) | speed-up | forwards (whole / stepped) "
             "| largest score difference |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for label, model, pairs in exact_cases(n_pairs, few_shot, zoo_pairs, width):
        graph = EdgeGraph.of(model)
        T = pairs.clean.tokens.shape[1]
        circuit = score_edges(model, pairs, "eap", progress=False)
        n = circuit.n_edges
        sizes = sorted({0, n, *[2**i for i in range(n.bit_length()) if 2**i < n]})
        analyses = (
            (f"every edge alone ({graph.n_edges} edges)",
             lambda engine: patch_edges(model, pairs, graph, engine=engine, progress=False),
             lambda got: got["scores"], lambda got: got["forwards"]),
            (f"faithfulness, {len(sizes)} sizes",
             lambda engine: faithfulness_curve(model, pairs, circuit, sizes=sizes, engine=engine),
             lambda got: got.metric_circuit, lambda got: got.meta["forwards"]),
        )
        patch_edges(model, pairs, graph, edges=[0], progress=False)  # the stepper's one-time check
        for name, fn, scores, forwards in analyses:
            times: dict = {"hooks": [], "auto": []}
            got: dict = {}
            for _ in range(runs):
                for engine in ("hooks", "auto"):
                    start = time.perf_counter()
                    got[engine] = fn(engine)
                    times[engine].append(time.perf_counter() - start)
            slow, fast = statistics.median(times["hooks"]), statistics.median(times["auto"])
            gap = float((scores(got["auto"]) - scores(got["hooks"])).abs().max())
            lines.append(f"| {label} | {len(pairs)} pairs of {T} tokens | {name} | {slow:.2f} | {fast:.2f} | "
                         f"**{slow / fast:.1f}×** | {forwards(got['hooks'])} / {forwards(got['auto'])} | {gap:.1e} |")
            print(lines[-1], flush=True)
    return lines


def write_block(path: Path, begin: str, end: str, text: str) -> None:
    doc = path.read_text()
    block = f"{begin}\n{text}\n{end}"
    if begin in doc:
        doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(doc)


def neuron_receivers(models: list, n_pairs: int, step: int, steps: int) -> list[str]:
    """EAP / EAP-IG of the edges into MLP neurons against exact patching of each (see the docstring)."""
    import time

    from arithinterp.circuits import attribute_edges, patch_neuron_edges
    from arithinterp.circuits.neurons import neuron_inputs
    from arithinterp.engine import Write, Read, run
    from arithinterp.engine.edges import EdgeForward, Layout, sender_outputs

    lines = [f"One CPU thread, {n_pairs} pairs per model (varying `a`, correctly answered), `logit_diff`, position-free "
             f"graph, EAP-IG steps = {steps}; every {step}th neuron of the last MLP as a receiver.", "",
             "| model | edges into neurons | Pearson EAP / EAP-IG | Spearman EAP / EAP-IG | exact path (s) "
             "| EAP / EAP-IG (s) | exactness |", "|---|---:|---|---|---:|---|---:|"]
    for name in models:
        model, pairs = zoo_pairs(name, n_pairs)
        layer = model.cfg.n_layers - 1
        chosen = {layer: list(range(0, model.cfg.d_mlp, step))}
        start = time.perf_counter()
        exact = patch_neuron_edges(model, pairs, neurons=chosen, progress=False)
        exact_s = time.perf_counter() - start
        ref = exact["scores"].mean(0)
        got, seconds = {}, {}
        for method in ("eap", "eap-ig"):
            start = time.perf_counter()
            out = attribute_edges(model, pairs, method=method, ig_steps=steps, progress=False, neurons=chosen)
            seconds[method] = time.perf_counter() - start
            col = {e: i for i, e in enumerate(out["neuron_receiver_edges"])}
            got[method] = out["neuron_receiver_scores"][:, [col[e] for e in exact["edges"]]].mean(0)
        # exactness: every sender's edge into one neuron at once = patching its activation from the clean run
        idx = torch.arange(len(pairs))
        base, source = pairs.corrupt.unpadded(idx), pairs.clean.unpadded(idx)
        n_up = Layout.of(model).senders_before(layer, "mlp")
        source_send, _, _ = sender_outputs(model, source)
        B, T = base.shape
        neuron = chosen[layer][1]
        with torch.inference_mode():
            every = EdgeForward(model).run(base, values=source_send, neurons=neuron_inputs(model, [(layer, neuron)]),
                                           neuron_weights=lambda _l: torch.ones(1, B, T, 1, n_up))["logits"][0, :, -1]
            post = run(model, source, reads=[Read("mlp_post", layer)], logits="none").reads[0]
            patched = run(model, base, writes=[Write("mlp_post", layer, units=[neuron],
                                                                   value=post[:, :, [neuron]])]).logits
        assert patched is not None
        gap = float((every.float() - patched.float()).abs().max() / patched.float().abs().max())
        lines.append(
            f"| zoo:{name} | {len(ref):,} | {pearson(got['eap'], ref):.3f} / {pearson(got['eap-ig'], ref):.3f} "
            f"| {pearson(ranks(got['eap']), ranks(ref)):.3f} / {pearson(ranks(got['eap-ig']), ranks(ref)):.3f} "
            f"| {exact_s:.1f} | {seconds['eap']:.1f} / {seconds['eap-ig']:.1f} | {gap:.1e} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", default="add-100,add-3digit")
    parser.add_argument("--write", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="20 pairs of zoo:add-100, one run")
    parser.add_argument("--speed", action="store_true", help="the Llama 4L d256 speed setup instead of the zoo comparison")
    parser.add_argument("--speed-pairs", type=int, default=16)
    parser.add_argument("--few-shot", type=int, default=9)
    parser.add_argument("--write-speed", type=Path, default=None)
    parser.add_argument("--exact", action="store_true", help="exact edges: whole forwards against the stepped default")
    parser.add_argument("--zoo-pairs", type=int, default=50)
    parser.add_argument("--exact-width", type=int, default=256, help="--exact: the Llama setup's d_model (a quick check)")
    parser.add_argument("--write-exact", type=Path, default=None)
    parser.add_argument("--neurons", action="store_true", help="MLP neurons as receivers: attribution against exact")
    parser.add_argument("--neuron-step", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    if args.neurons:
        print("\n".join(neuron_receivers(args.models.split(","), args.zoo_pairs, args.neuron_step, args.steps)))
        return
    if args.exact:
        text = "\n".join(exact_speed(args.speed_pairs, args.few_shot, args.zoo_pairs, args.runs, args.exact_width))
        print(text)
        if args.write_exact:
            write_block(args.write_exact, EXACT_BEGIN, EXACT_END, "## Circuits: exact edges through the stepper\n\n"
                        f"Written by `python benchmarks/circuits.py --exact --runs {args.runs} --write-exact "
                        f"{args.write_exact}`.\n\n{text}")
        return
    if args.quick:
        args.pairs, args.runs, args.models = 20, 1, "add-100"
    if args.speed:
        text = "\n".join(speed(args.speed_pairs, args.steps, args.few_shot, args.runs))
        print(text)
        if args.write_speed:
            doc = args.write_speed.read_text()
            block = f"{SPEED_BEGIN}\n## Circuits: edge scores\n\nWritten by `python benchmarks/circuits.py --speed --write-speed {args.write_speed}`.\n\n{text}\n{SPEED_END}"
            if SPEED_BEGIN in doc:
                doc = re.sub(re.escape(SPEED_BEGIN) + ".*?" + re.escape(SPEED_END), lambda _: block, doc, flags=re.S)
            else:
                doc = doc.rstrip("\n") + "\n\n" + block + "\n"
            args.write_speed.write_text(doc)
        return
    lines = [f"One CPU thread, torch {torch.__version__}, EAP-IG steps = {args.steps}, median of {args.runs} runs.", ""]
    for name in args.models.split(","):
        lines += bench(name, args.pairs, args.steps, args.runs)
    text = "\n".join(lines)
    print(text)
    if args.write:
        doc = args.write.read_text()
        block = f"{BEGIN}\n{text}\n{END}"
        args.write.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, doc, flags=re.S))


if __name__ == "__main__":
    main()
