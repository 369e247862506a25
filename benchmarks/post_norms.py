"""Edges through norms on the branches (Gemma 2, Gemma 3), and what ``score_edges(method="auto")`` picks.

Agreement (default): random-weight Gemma 2 and Gemma 3 folders (norms on every attention and MLP
output, frozen at the base run's scales in every edge and gradient run), scored on held-out pairs
(operands 60-99 against the 10-59 the method was developed on): Pearson and Spearman correlation
of EAP and EAP-IG (``--steps``) with exact path patching of every edge alone (pair-mean scores),
wall times of exact patching and EAP-IG (medians of ``--runs``, one thread), the estimated cost
ratio exact / EAP-IG and what ``method="auto"`` picks.

Auto (``--auto``): the same times and estimate on the zoo models, the 4-layer d256 Llama folder of
``benchmarks/circuits.py --speed`` and the Gemma folders, for position-free and per-position
(``a, b, final``) graphs: how the estimated cost ratio, which ``auto`` compares with
``AUTO_RATIO``, stands against the measured one.

Real model (``--real PATH``): Gemma 3 270M (a GGUF) on ``{a}+{b}=`` with three shots, operands
10-39: what ``method="auto"`` picks, its time and top edges, and exact patching of 300 edges (the
top 100 and 200 drawn at random) against it.

    python benchmarks/post_norms.py [--pairs 20] [--runs 3] [--write docs/circuits.md]
    python benchmarks/post_norms.py --auto [--runs 3] [--write-auto docs/circuits.md]
    python benchmarks/post_norms.py --real /work/gemma/gemma-3-270m-q4_k_m.gguf [--real-pairs 8]
    python benchmarks/post_norms.py --quick
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from circuits import pearson, ranks, zoo_pairs  # noqa: E402  (benchmarks/circuits.py)
from patching import llama_model, median_time  # noqa: E402  (benchmarks/patching.py)

BEGIN, END = "<!-- post-norms:begin -->", "<!-- post-norms:end -->"
AUTO_BEGIN, AUTO_END = "<!-- post-norms-auto:begin -->", "<!-- post-norms-auto:end -->"
POSITIONS = ["a", "b", "final"]


def gemma_model(family: str, n_layers: int, d_model: int, seed: int = 0):
    """A random-weight Gemma 2 or Gemma 3 folder (4 heads of ``d_model / 4``, grouped keys and values,
    a gated MLP of ``2 d_model``; Gemma 2 with soft-capping, Gemma 3 with QK-norm and local/global
    layers of two rotary bases) saved with the package's number tokenizer and loaded."""
    import transformers as T

    import arithinterp as ai
    from arithinterp.models.tokenizers import number_tokenizer

    tokenizer = number_tokenizer(198)
    common = dict(vocab_size=len(tokenizer), hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=4,
                  head_dim=d_model // 4, intermediate_size=2 * d_model, max_position_embeddings=128,
                  sliding_window=16, initializer_range=0.2)
    if family == "gemma2":
        config = T.Gemma2Config(num_key_value_heads=2, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                **common)
    else:
        types = ["sliding_attention", "full_attention"] * (n_layers // 2) + ["sliding_attention"] * (n_layers % 2)
        config = T.Gemma3TextConfig(num_key_value_heads=1, layer_types=types, query_pre_attn_scalar=d_model // 4,
                                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                     "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                                    **common)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    directory = Path(tempfile.mkdtemp()) / f"{family}-{n_layers}L-d{d_model}"
    T.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return ai.load_model(str(directory))


def compare(model, pairs, graph, steps: int, runs: int) -> dict:
    """Exact patching and EAP / EAP-IG of every edge of ``graph``: correlations, times, the estimate."""
    from arithinterp.circuits import attribute_edges, patch_edges
    from arithinterp.circuits.planning import choose_method, edge_costs

    patch_edges(model, pairs, graph, edges=[0], progress=False)  # the stepper's one-time check
    t_exact, exact = median_time(lambda: patch_edges(model, pairs, graph, progress=False), runs)
    ref = exact["scores"].mean(0)
    out = dict(exact=t_exact, edges=graph.n_edges)
    for method in ("eap", "eap-ig"):
        t, got = median_time(lambda: attribute_edges(model, pairs, graph, method=method, ig_steps=steps,
                                                     progress=False), runs)
        est = got["scores"].mean(0)
        out[method] = dict(time=t, pearson=pearson(est, ref), spearman=pearson(ranks(est), ranks(ref)))
    costs = edge_costs(model, pairs, graph, steps)
    out.update(ratio=costs.ratio, pick=choose_method(costs))
    return out


def agreement(n_pairs: int, steps: int, runs: int, shapes: list) -> list[str]:
    from arithinterp.circuits import EdgeGraph
    from arithinterp.tasks import arithmetic

    lines = [f"One CPU thread, torch {torch.__version__}, EAP-IG steps = {steps}, times are medians of {runs} runs; "
             f"{n_pairs} held-out pairs varying `a` (operands 60-99), position-free graph, `logit_diff`.", "",
             "| model | prompts | edges | EAP Pearson / Spearman | EAP-IG Pearson / Spearman | exact (s) | EAP-IG (s) "
             "| measured ratio | estimated ratio | `auto` picks |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for family in ("gemma2", "gemma3"):
        for n_layers, d_model, few_shot in shapes:
            model = gemma_model(family, n_layers, d_model)
            prompts = arithmetic(model, a=range(60, 100, 3), b=range(40, 100, 5), few_shot=few_shot)
            pairs = prompts.counterfactual(vary="a", seed=1)[:n_pairs]
            got = compare(model, pairs, EdgeGraph.of(model), steps, runs)
            eap, ig = got["eap"], got["eap-ig"]
            name = {"gemma2": "Gemma 2", "gemma3": "Gemma 3"}[family]
            lines.append(f"| {name} {n_layers}L d{d_model} (random) | {len(pairs)} pairs of "
                         f"{pairs.clean.tokens.shape[1]} tokens ({few_shot}-shot) | {got['edges']} | "
                         f"{eap['pearson']:.3f} / {eap['spearman']:.3f} | {ig['pearson']:.3f} / {ig['spearman']:.3f} | "
                         f"{got['exact']:.2f} | {ig['time']:.2f} | {got['exact'] / ig['time']:.2f} | "
                         f"{got['ratio']:.2f} | {got['pick']} |")
            print(lines[-1], flush=True)
    return lines


def auto_table(steps: int, runs: int) -> list[str]:
    from arithinterp.circuits import EdgeGraph
    from arithinterp.tasks import arithmetic

    def cases():
        yield "`zoo:add-100`", *zoo_pairs("add-100", 100)
        yield "`zoo:add-3digit`", *zoo_pairs("add-3digit", 50)
        model = llama_model(4, 256, 8, 2, 688)
        yield "Llama 4L d256 (random)", model, arithmetic(model, a=range(100), b=range(100), few_shot=9
                                                          ).counterfactual(vary="a", seed=0)[:16]
        for family, name in (("gemma2", "Gemma 2"), ("gemma3", "Gemma 3")):
            model = gemma_model(family, 4, 256)
            yield f"{name} 4L d256 (random)", model, arithmetic(model, a=range(100), b=range(100), few_shot=9
                                                                ).counterfactual(vary="a", seed=0)[:16]

    lines = [f"One CPU thread, torch {torch.__version__}, EAP-IG steps = {steps}, medians of {runs} runs.", "",
             "| model | prompts | graph | edges | exact (s) | EAP-IG (s) | measured ratio | estimated ratio "
             "| `auto` picks |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for label, model, pairs in cases():
        for positions in (None, POSITIONS):
            got = compare(model, pairs, EdgeGraph.of(model, positions), steps, runs)
            ig = got["eap-ig"]
            lines.append(f"| {label} | {len(pairs)} pairs of {pairs.clean.tokens.shape[1]} tokens | "
                         f"{'position-free' if positions is None else ', '.join(positions)} | {got['edges']} | "
                         f"{got['exact']:.2f} | {ig['time']:.2f} | {got['exact'] / ig['time']:.2f} | "
                         f"{got['ratio']:.2f} | {got['pick']} |")
            print(lines[-1], flush=True)
    return lines


def real(path: str, n_pairs: int, steps: int, n_checked: int = 300) -> list[str]:
    """Gemma 3 270M: what ``auto`` picks, the time of what it runs, its top edges, and exact patching of
    ``n_checked`` edges (the top third by that score and the rest drawn at random) against it."""
    import arithinterp as ai
    from arithinterp.circuits import EdgeGraph, patch_edges, score_edges
    from arithinterp.circuits.planning import edge_costs
    from arithinterp.tasks import arithmetic

    start = time.perf_counter()
    model = ai.load_model(path)
    loaded = time.perf_counter() - start
    prompts = arithmetic(model, a=range(10, 40), b=range(10, 40), template="{a}+{b}=", few_shot=3)
    gen = torch.Generator().manual_seed(0)
    sample = prompts[torch.randperm(len(prompts), generator=gen)[:15 * n_pairs]]
    correct = sample.correct_only(model)
    pairs = correct.counterfactual(vary="a", seed=0)[:n_pairs]
    graph = EdgeGraph.of(model)
    costs = edge_costs(model, pairs, graph, steps)
    start = time.perf_counter()
    circuit = score_edges(model, pairs, "auto", ig_steps=steps, progress=False)
    took = time.perf_counter() - start
    scores = circuit.scores
    top = torch.argsort(scores.abs(), descending=True)[:n_checked // 3]
    others = torch.ones(graph.n_edges, dtype=torch.bool)
    others[top] = False
    drawn = torch.nonzero(others).flatten()
    drawn = drawn[torch.randperm(len(drawn), generator=gen)[:n_checked - len(top)]]
    chosen = torch.cat([top, drawn])
    start = time.perf_counter()
    exact = patch_edges(model, pairs, graph, edges=chosen.tolist(), progress=False)["scores"].mean(0)[chosen]
    exact_took = time.perf_counter() - start
    lines = [f"`{Path(path).name}` (loaded in {loaded:.0f} s, {model.cfg.n_layers} layers): {len(correct)} of "
             f"{len(sample)} sampled prompts answered correctly, {len(pairs)} pairs of "
             f"{pairs.clean.tokens.shape[1]} tokens varying `a`, {graph.n_edges} edges. Exact patching of every "
             f"edge is estimated at {costs.ratio:.1f}× EAP-IG's cost ({steps} steps), so `auto` runs "
             f"**{circuit.method}**: {took:.1f} s on one thread. Exact patching of {len(chosen)} edges (the top "
             f"{len(top)} by that score and {len(drawn)} drawn at random) took {exact_took:.1f} s "
             f"({exact_took / len(chosen) * graph.n_edges / took:.0f}× the EAP-IG time for all edges at that "
             f"rate); Pearson correlation with EAP-IG on them {pearson(exact, scores[chosen]):.3f}, on the random "
             f"ones alone {pearson(exact[len(top):], scores[drawn]):.3f}.", "",
             "| edge | EAP-IG score (mean logit diff) | exact |", "|---|---:|---:|"]
    lines += [f"| `{graph.edges[int(i)].name}` | {float(scores[i]):.3f} | {float(exact[k]):.3f} |"
              for k, i in enumerate(top[:10].tolist())]
    return lines


def write_block(path: Path, begin: str, end: str, text: str) -> None:
    doc = path.read_text()
    block = f"{begin}\n{text}\n{end}"
    if begin in doc:
        doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--write", type=Path, default=None)
    parser.add_argument("--auto", action="store_true", help="measured against estimated cost ratios, several models")
    parser.add_argument("--write-auto", type=Path, default=None)
    parser.add_argument("--real", default=None, help="a Gemma 3 GGUF file or folder")
    parser.add_argument("--real-pairs", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="4 pairs, one run, the 2-layer d64 folders only")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    if args.real:
        print("\n".join(real(args.real, args.real_pairs, args.steps)))
        return
    if args.auto:
        text = "\n".join(auto_table(args.steps, args.runs))
        print(text)
        if args.write_auto:
            write_block(args.write_auto, AUTO_BEGIN, AUTO_END,
                        f"Written by `python benchmarks/post_norms.py --auto --runs {args.runs}`.\n\n{text}")
        return
    shapes = [(2, 64, 2), (4, 256, 9)]
    if args.quick:
        args.pairs, args.runs, shapes = 4, 1, [(2, 64, 2)]
    text = "\n".join(agreement(args.pairs, args.steps, args.runs, shapes))
    print(text)
    if args.write:
        write_block(args.write, BEGIN, END,
                    f"Written by `python benchmarks/post_norms.py --runs {args.runs}`.\n\n{text}")


if __name__ == "__main__":
    main()
