"""The graph viewer's pages in Chromium: size, time to open, and how fast the pruning slider redraws.

    PYTHONPATH=. python benchmarks/viewer.py                 # zoo graphs, Gemma 3-sized synthetic graph and circuit
    PYTHONPATH=. python benchmarks/viewer.py --screenshots docs/img   # and the docs' screenshots
    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/viewer.py --gemma3 DIR
        # also a 3-shot graph of Gemma 3 270M over the transcoders in DIR (1,000 features expanded)

For each page: its size; the time from navigation to the page's ``ready`` flag (median of
``--runs`` opens, each in a fresh page); and the slider's latency, from the input event to the next
painted frame (median and largest of ``--moves`` moves across the slider's range), and the CPU
time the browser's threads spent on them per move (from a trace: what the moves cost whatever
else the machine runs, where wall-clock times grow with its load). Beside each,
the plotly figure ``.plot()`` draws of the same result (static; plotly.js inlined), opened until its
SVG is drawn. Chromium is Debian's (``/usr/bin/chromium``, no GPU), driven by playwright.

The synthetic pages have a 3-shot Gemma 3 270M graph's shape: 34 tokens, 18 layers, 1,000
expanded features, an error node per layer and position, every edge a real graph can have (a
source in an earlier layer at the same or an earlier position: 422,578 non-zero edges), heavy-tailed
weights, pruned by the package's own pruning; and the 5,644-edge graph of an 18-layer model with 4
query heads and 1 key/value head, scored at random with the top 10% kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

MOVE = """async (k) => {
  const slider = document.getElementById('slider');
  const start = performance.now();
  slider.value = String(k);
  slider.dispatchEvent(new Event('input'));
  await new Promise((done) => requestAnimationFrame(() => setTimeout(done, 0)));
  return performance.now() - start;
}"""
VIEWPORT = {"width": 1400, "height": 820}  # the tests' viewport


def synthetic_graph(n_tokens: int = 34, n_layers: int = 18, n_features: int = 1000, seed: int = 0):
    """An AttributionGraph of a 3-shot Gemma 3 graph's shape (see the module docstring)."""
    from arithinterp.features.graph import AttributionGraph, _prune_scores

    g = torch.Generator().manual_seed(seed)
    T, L = n_tokens, n_layers
    layer = torch.randint(0, L, (n_features,), generator=g)
    position = torch.randint(0, T, (n_features,), generator=g)
    index = torch.randint(0, 16384, (n_features,), generator=g)
    order = sorted(range(n_features), key=lambda i: (int(layer[i]), int(position[i]), int(index[i])))
    activation = torch.rand(n_features, generator=g) * 5
    nodes = [dict(kind="embedding", layer=-1, position=p, feature=-1, activation=0.0) for p in range(T)]
    nodes += [dict(kind="feature", layer=int(layer[i]), position=int(position[i]), feature=int(index[i]),
                   activation=float(activation[i])) for i in order]
    nodes += [dict(kind="error", layer=lay, position=p, feature=-1, activation=1.0)
              for lay in range(L) for p in range(T)]
    nodes += [dict(kind="logit", layer=L, position=T - 1, feature=42, activation=10.0)]
    N = len(nodes)
    layers = torch.tensor([n["layer"] for n in nodes])
    positions = torch.tensor([n["position"] for n in nodes])
    is_target = torch.tensor([n["kind"] in ("feature", "logit") for n in nodes])
    is_source = ~torch.tensor([n["kind"] == "logit" for n in nodes])
    possible = (is_target[:, None] & is_source[None, :] & (layers[None, :] < layers[:, None])
                & (positions[None, :] <= positions[:, None]))
    weights = torch.randn(N, N, generator=g) * torch.exp(torch.randn(N, N, generator=g) * 1.5 - 3)
    edges = torch.where(possible, weights, torch.zeros(()))
    scores, influence = _prune_scores(edges.double(), nodes, torch.zeros(1), torch.tensor([0]), N - 1,
                                      N - 1 - L * T, 0.8, 100)
    tokens = [f"t{p}" for p in range(T)]
    for i, node in enumerate(nodes):
        node.update(influence=float(influence[i]), label="", token=tokens[node["position"]],
                    token_id=100 + node["position"])
    nodes[-1].update(probability=1.0, token="5", token_id=42)
    scores.update(n_active_features=17_850, n_expanded_features=n_features)
    return AttributionGraph(nodes=nodes, edges=edges, bias=torch.zeros(N), values=torch.zeros(N),
                            prompt=" ".join(tokens), tokens=tokens, scores=scores, meta={})


def synthetic_circuit(n_layers: int = 18, n_heads: int = 4, n_kv_heads: int = 1, kept: float = 0.1, seed: int = 0):
    """A Circuit over an 18-layer, 4-head (1 key/value head) model's 5,644 edges, scored at random."""
    from arithinterp.circuits import top_n
    from arithinterp.circuits.circuit import Circuit
    from arithinterp.circuits.graph import EdgeGraph
    from arithinterp.engine.edges import Layout

    layout = dict(n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, has_mlp=True, parallel=False,
                  d_model=640)
    graph = EdgeGraph(Layout(**layout))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(graph.n_edges, generator=g) * torch.exp(torch.randn(graph.n_edges, generator=g) * 1.5 - 3)
    circuit = Circuit(scores=scores, pair_scores=scores[None], kept=torch.ones(graph.n_edges, dtype=torch.bool),
                      edges=[e.name for e in graph.edges], senders=[e.sender for e in graph.edges],
                      receivers=[e.receiver for e in graph.edges], channels=[e.channel for e in graph.edges],
                      positions=[e.position for e in graph.edges], nodes=[n.name for n in graph.nodes],
                      method="eap-ig", metric="logit_diff", meta=dict(layout=layout, graph_positions=None,
                                                                      extraction="all", n_pairs=1))
    return top_n(circuit, int(kept * graph.n_edges))


def gemma3_graph(directory: str):
    """The graph of the first correctly answered held-out 3-shot prompt of Gemma 3 270M's transcoder
    plan, over the transcoders in ``directory`` (``"cache"``: the cached ones)."""
    from features import gemma3_transcoders, held_out_prompts

    from arithinterp.features.graph import prompt_graph
    from arithinterp.models import load_model

    model = load_model("pkg:gemma-3-270m")
    transcoders = gemma3_transcoders(model, directory)
    prompts = held_out_prompts(model)
    return prompt_graph(model, prompts[:1].unpadded(torch.arange(1))[0], transcoders, progress=False)


class Browser:
    def __init__(self, playwright):
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is None:
            sys.exit("Debian's chromium is not installed (scripts/setup.sh installs it as root)")
        self.browser = playwright.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])

    def open(self, path: Path, ready: str):
        """A fresh page at ``path``; the ms from navigation to ``ready`` being true."""
        context = self.browser.new_context(viewport=VIEWPORT, offline=True)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function(ready, timeout=60_000)
        ms = page.evaluate("performance.now()")
        if errors:
            raise RuntimeError(f"{path.name}: {errors}")
        return context, page, ms


def measure(browser: Browser, name: str, view, figure, folder: Path, runs: int, moves: int) -> dict:
    page_file = folder / f"{name}.html"
    view.to_html(page_file, overwrite=True)
    opens = []
    for _ in range(runs):
        context, page, _ = browser.open(page_file, "document.documentElement.dataset.ready === 'true'")
        opens.append(page.evaluate("graphView.readyMs"))
        context.close()
    context, page, _ = browser.open(page_file, "document.documentElement.dataset.ready === 'true'")
    count, default = view.data["slider"]["count"], view.data["slider"]["default"]
    stops = [count, count // 2, default, count // 4, count, 3 * count // 4, default, count // 8]
    trace = folder / f"{name}.trace.json"
    browser.browser.start_tracing(page=page, path=str(trace), categories=["toplevel"])
    latencies = [page.evaluate(MOVE, stops[i % len(stops)]) for i in range(moves)]
    browser.browser.stop_tracing()
    context.close()
    row = dict(page=name, nodes=len(view.data["nodes"]["id"]), links=len(view.data["links"]["source"]),
               mb=page_file.stat().st_size / 1e6, open_ms=statistics.median(opens),
               slider_ms=statistics.median(latencies), slider_max_ms=max(latencies),
               slider_cpu_ms=cpu_ms(trace) / moves)
    if figure is not None:
        figure_file = folder / f"{name}-plotly.html"
        figure.write_html(str(figure_file), include_plotlyjs=True)
        times = []
        for _ in range(runs):
            context, _, ms = browser.open(figure_file, "document.querySelector('.plotly .main-svg') !== null")
            times.append(ms)
            context.close()
        row.update(figure_mb=figure_file.stat().st_size / 1e6, figure_open_ms=statistics.median(times))
    return row


def cpu_ms(trace: Path) -> float:
    """The CPU time of every task the browser's threads ran while traced (all processes), in ms:
    what the moves cost whatever else the machine was doing."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    by_thread: dict[tuple, list] = {}
    for e in events:
        if e.get("ph") == "X" and "tdur" in e:
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    total = 0.0
    for slices in by_thread.values():  # the outermost slices of each thread (nested ones are inside them)
        end = -1.0
        for e in sorted(slices, key=lambda e: (e["ts"], -e.get("dur", 0))):
            if e["ts"] >= end:
                total += e["tdur"]
                end = e["ts"] + e.get("dur", 0)
    return total / 1000


def screenshot(browser: Browser, view, path: Path) -> None:
    """The page as the tests open it (their viewport), written to ``path``."""
    with tempfile.TemporaryDirectory() as folder:
        page_file = Path(folder) / "page.html"
        view.to_html(page_file)
        context, page, _ = browser.open(page_file, "document.documentElement.dataset.ready === 'true'")
        path.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(path))
        context.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="opens per page (default: 5)")
    parser.add_argument("--moves", type=int, default=16, help="slider moves per page (default: 16)")
    parser.add_argument("--gemma3", default=None, metavar="DIR", help="Gemma 3 270M's transcoders (not shipped)")
    parser.add_argument("--screenshots", default=None, metavar="DIR", help="write the docs' screenshots here")
    parser.add_argument("--smoke", action="store_true", help="a small synthetic graph and circuit only")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    from arithinterp.features import load_transcoders
    from arithinterp.features.graph import prompt_graph
    from arithinterp.models import load_model

    cases = []
    if args.smoke:
        graph = synthetic_graph(n_tokens=8, n_layers=4, n_features=60)
        cases.append(("synthetic graph, 8 tokens, 4 layers, 60 features", graph.show(), None))
        circuit = synthetic_circuit(n_layers=4)
        cases.append(("synthetic circuit, 4 layers", circuit.show(), None))
    else:
        for spec, prompt in (("zoo:add-100", "47+38="), ("zoo:add-3digit", "136+259=")):
            graph = prompt_graph(load_model(spec), prompt, load_transcoders(spec), progress=False)
            cases.append((f"{spec} graph of {prompt!r}", graph.show(), graph.plot()))
        graph = synthetic_graph()
        cases.append(("synthetic Gemma 3-sized graph: 34 tokens, 18 layers, 1,000 features", graph.show(),
                      graph.plot()))
        circuit = synthetic_circuit()
        cases.append((f"synthetic {circuit.n_edges:,}-edge circuit: 18 layers, 4 heads", circuit.show(),
                      circuit.plot()))
    if args.gemma3:
        graph = gemma3_graph(args.gemma3)
        cases.append(("pkg:gemma-3-270m 3-shot graph (1,000 features expanded)", graph.show(), graph.plot()))
    load = os.getloadavg()[0]
    with sync_playwright() as p, tempfile.TemporaryDirectory() as folder:
        browser = Browser(p)
        rows = [measure(browser, name, view, figure, Path(folder), args.runs, args.moves)
                for name, view, figure in cases]
        if args.screenshots:
            shots = Path(args.screenshots)
            model = load_model("zoo:add-100")
            graph = prompt_graph(model, "47+38=", load_transcoders("zoo:add-100"), progress=False)
            screenshot(browser, graph.show(), shots / "graph-47+38.png")
            if args.gemma3:
                screenshot(browser, cases[-1][1], shots / "graph-gemma3.png")
        browser.browser.close()
    print(f"Chromium {VIEWPORT['width']}x{VIEWPORT['height']}, no GPU; load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores")
    print()
    print(f"| page | nodes | links in page | page MB | open ms (median of {args.runs}) | "
          f"slider ms (median / largest of {args.moves} moves) | browser CPU ms per move | "
          "plotly figure: MB, open ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        figure = f"{r['figure_mb']:.2f} MB, {r['figure_open_ms']:.0f} ms" if "figure_mb" in r else "–"
        print(f"| {r['page']} | {r['nodes']:,} | {r['links']:,} | {r['mb']:.2f} | {r['open_ms']:.0f} | "
              f"{r['slider_ms']:.0f} / {r['slider_max_ms']:.0f} | {r['slider_cpu_ms']:.0f} | {figure} |")


if __name__ == "__main__":
    main()
