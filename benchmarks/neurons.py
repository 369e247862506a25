"""Benchmark: heuristic classification of many neurons over a 100 x 100 addition grid.

Times :func:`arithinterp.neurons.classify_maps` on N neurons (default 16,384) with K and KV maps,
median of repeated runs, next to a plain reference scorer in the same process (rank the cells,
then one [neurons, cells] top-k mask per distinct k, matmul with the predicate matrix) on a
subset of the neurons, and checks both give the same scores. Prints a markdown table.

    python benchmarks/neurons.py [--neurons 16384] [--runs 3] [--reference-neurons 512] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from arithinterp import neurons as nn


def synthetic_maps(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ReLU maps [n, 100, 100]: every 4th neuron carries a planted heuristic, the rest noise."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.arange(100)
    a, b = torch.meshgrid(grid, grid, indexing="ij")
    masks = [(a % 7 == 3), (b >= 50), (a + b) % 10 == 4, ((a + b) >= 60) & ((a + b) < 90)]
    k_maps = torch.relu(torch.randn(n, 100, 100, generator=g))
    kv_maps = torch.relu(torch.randn(n, 100, 100, generator=g))
    for i in range(0, n, 4):
        j = (i // 4) % len(masks)
        target = k_maps if j < 2 else kv_maps
        target[i] += 2 * masks[j].float()
    return k_maps, kv_maps


def reference_scores(maps: torch.Tensor, predicates: torch.Tensor) -> torch.Tensor:
    """Plain top-k scoring: rank cells, one top-k mask per distinct k, matmul with predicates."""
    ranks = torch.argsort(torch.argsort(maps, dim=1, descending=True), dim=1)
    k = predicates.sum(0)
    out = torch.empty(maps.shape[0], predicates.shape[1])
    for value in torch.unique(k).tolist():
        cols = torch.nonzero(k == value).flatten()
        out[:, cols] = (ranks < value).float() @ predicates[:, cols].float() / value
    return out


def fast_scores(maps: torch.Tensor, heuristics, kind: str) -> torch.Tensor:
    grid = heuristics.grid
    atoms = [nn.scoring._dense_ids(grid.a), nn.scoring._dense_ids(grid.b)] if kind == "K" else [nn.scoring._dense_ids(grid.result)]
    return nn.score_maps(maps, heuristics.predicates[:, heuristics.kind(kind)], atoms=atoms)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--neurons", type=int, default=16384)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reference-neurons", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    k_maps, kv_maps = synthetic_maps(args.neurons)
    times, cpu = [], []
    for _ in range(args.runs):
        start, start_cpu = time.perf_counter(), time.process_time()
        table = nn.classify_maps(k_maps, kv_maps, range(100), range(100), "+")
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    fast, fast_cpu = statistics.median(times), statistics.median(cpu)
    n_heuristics = len(table.names)

    # reference vs fast on a subset: same scores, time per neuron
    heuristics = nn.build_heuristics(range(100), range(100), "+")
    m = min(args.reference_neurons, args.neurons)
    sub = {"K": k_maps[:m].reshape(m, -1), "KV": kv_maps[:m].reshape(m, -1)}
    ref_time = fast_time = 0.0
    worst = 0.0
    for kind, maps in sub.items():
        cols = heuristics.kind(kind)
        start = time.perf_counter()
        ref = reference_scores(maps, heuristics.predicates[:, cols])
        ref_time += time.perf_counter() - start
        start = time.perf_counter()
        got = fast_scores(maps, heuristics, kind)
        fast_time += time.perf_counter() - start
        worst = max(worst, float((ref - got).abs().max()))

    print(f"## Heuristic classification: {args.neurons} neurons x 100 x 100 grid (a + b), "
          f"{n_heuristics} heuristics, {args.threads} thread(s)\n")
    print("| implementation | neurons | median wall s (runs) | neurons / s | projected s for all |")
    print("|---|---:|---:|---:|---:|")
    print(f"| `classify_maps` (K + KV maps) | {args.neurons} | {fast:.2f} ({args.runs}; CPU {fast_cpu:.2f}) | {args.neurons / fast:,.0f} | {fast:.2f} |")
    print(f"| `score_maps` only, subset | {m} | {fast_time:.2f} (1) | {m / fast_time:,.0f} | {fast_time * args.neurons / m:.1f} |")
    print(f"| plain reference (mask per k + matmul), subset | {m} | {ref_time:.2f} (1) | {m / ref_time:,.0f} | {ref_time * args.neurons / m:.1f} |")
    print(f"\nlargest score difference fast vs reference on the subset: {worst:.2g} "
          "(ties between equal ReLU zeros are broken by a random permutation in the fast scorer "
          "and by index in the reference)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"1-minute load average at the end: {load:.1f} on {os.cpu_count()} cores (wall time grows with it)")
    print(f"labelled neurons: {int(table.classified.sum())} of {args.neurons} "
          f"(planted: {len(range(0, args.neurons, 4))})")


if __name__ == "__main__":
    main()
