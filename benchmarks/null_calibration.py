"""Benchmark: how many neurons the heuristic classifier labels on null maps, and on planted ones.

Nikankin et al. 2025 label a neuron with a heuristic when its top-k score reaches 0.6. On a small
grid with many heuristics of a few cells each that threshold labels a large share of pure-noise
neurons. :func:`arithinterp.neurons.classify_maps` now also requires the score to beat the
neuron's cell-shuffled maps at a false-discovery rate (exact hypergeometric p-values,
Benjamini-Hochberg over neurons x heuristics). This script measures, before (``fdr=None``: the
threshold alone) and after (``fdr=0.05``):

* Gaussian-noise K and KV maps of N neurons (default 1,500) on the 10 x 10 digit grid, a 30 x 30
  grid and the 100 x 100 two-digit grid, top-k only and with the bottom-k too (gated MLPs);
* the real maps of every MLP neuron of ``zoo:add-100`` (2 x 512 neurons, 100 x 100 grid, and its
  10 x 10 and 30 x 30 corners), and the same maps with each neuron's cells shuffled;
* planted-heuristic maps (one heuristic per neuron plus noise of the same size): the share of
  planted neurons that get their planted label.

Prints one markdown table. Every random choice is seeded.

    python benchmarks/null_calibration.py [--neurons 1500] [--seed 0] [--no-zoo] [--grids 10,30,100]
"""

from __future__ import annotations

import argparse
import time

import torch

from arithinterp import neurons as nn


def noise_maps(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, size, size, generator=g), torch.randn(n, size, size, generator=g)


def shuffle_cells(maps: torch.Tensor, seed: int) -> torch.Tensor:
    """Each neuron's map with its cells permuted by its own seeded permutation."""
    n = maps.shape[0]
    order = torch.rand(n, maps[0].numel(), generator=torch.Generator().manual_seed(seed)).argsort(1)
    return maps.reshape(n, -1).gather(1, order).reshape(maps.shape)


def planted_maps(n: int, size: int, seed: int, amplitude: float) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Noise maps with one planted heuristic per neuron (cycling through a few of each kind)."""
    k_maps, kv_maps = noise_maps(n, size, seed)
    a, b = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    r = a + b
    if size == 10:
        masks = {"a mod 2 = 1": a % 2 == 1, "b mod 3 = 1": b % 3 == 1, "a = b": a == b,
                 "result mod 10 = 3": r % 10 == 3, "result = 12": r == 12}
    else:
        masks = {"a mod 7 = 3": a % 7 == 3, "b in [50, 100)": b >= 50, "a = b": a == b,
                 "result mod 10 = 4": r % 10 == 4, "result in [60, 90)": (r >= 60) & (r < 90)}
    names = [list(masks)[i % len(masks)] for i in range(n)]
    for i, name in enumerate(names):
        target = k_maps if name[0] in "ab" else kv_maps
        target[i] += amplitude * masks[name].float()
    return k_maps, kv_maps, names


def fraction_labelled(k_maps, kv_maps, size, bottom, fdr, seed) -> tuple[float, float]:
    start = time.perf_counter()
    table = nn.classify_maps(k_maps, kv_maps, range(size), range(size), "+", bottom=bottom, fdr=fdr, seed=seed,
                             shuffle_control=False)
    return float(table.classified.float().mean()), time.perf_counter() - start


def recovery(k_maps, kv_maps, names, size, bottom, fdr, seed) -> float:
    table = nn.classify_maps(k_maps, kv_maps, range(size), range(size), "+", bottom=bottom, fdr=fdr, seed=seed,
                             shuffle_control=False)
    hits = torch.stack([table.labels[i, table.index(name)] for i, name in enumerate(names)])
    return float(hits.float().mean())


def zoo_maps() -> tuple[torch.Tensor, torch.Tensor]:
    """K and KV maps of every MLP neuron of zoo:add-100 over the 100 x 100 grid."""
    import arithinterp as ai
    from arithinterp.tasks import arithmetic

    model = ai.load_model("zoo:add-100")
    prompts = arithmetic(model, "+", a=range(100), b=range(100), template="{a}+{b}=")
    d_mlp, layers = int(model.cfg.d_mlp), int(model.cfg.n_layers)
    layer = torch.arange(layers).repeat_interleave(d_mlp)
    neuron = torch.arange(d_mlp).repeat(layers)
    result = nn.maps(model, prompts, neurons=(layer, neuron))
    return result.k_maps, result.kv_maps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--neurons", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-zoo", action="store_true", help="skip the zoo:add-100 maps")
    parser.add_argument("--grids", default="10,30,100", help="grid sizes, comma-separated (default 10,30,100)")
    args = parser.parse_args()
    grids = [int(g) for g in args.grids.split(",")]
    torch.set_num_threads(1)
    n, seed = args.neurons, args.seed

    print("| maps | grid | neurons | bottom-k | labelled, 0.6 alone | labelled, 0.6 + FDR 0.05 | s (FDR run) |")
    print("|---|---|---:|---|---:|---:|---:|")

    def row(label, k_maps, kv_maps, size, bottom):
        before, _ = fraction_labelled(k_maps, kv_maps, size, bottom, None, seed)
        after, seconds = fraction_labelled(k_maps, kv_maps, size, bottom, 0.05, seed)
        print(f"| {label} | {size} x {size} | {k_maps.shape[0]:,} | {'yes' if bottom else 'no'} | "
              f"{before:.3f} | {after:.4f} | {seconds:.1f} |", flush=True)

    for size in grids:
        k_maps, kv_maps = noise_maps(n, size, seed)
        for bottom in (False, True):
            row("Gaussian noise", k_maps, kv_maps, size, bottom)
    if not args.no_zoo:
        k_full, kv_full = zoo_maps()
        for size in grids:
            k_maps, kv_maps = k_full[:, :size, :size].contiguous(), kv_full[:, :size, :size].contiguous()
            row("zoo:add-100, real", k_maps, kv_maps, size, False)
            row("zoo:add-100, cell-shuffled", shuffle_cells(k_maps, seed), shuffle_cells(kv_maps, seed + 1), size, False)

    print()
    print("| planted maps | grid | neurons | bottom-k | amplitude / noise sd | recovered, 0.6 alone | recovered, 0.6 + FDR 0.05 |")
    print("|---|---|---:|---|---:|---:|---:|")
    for size, amplitude in [(s, a) for s, a in ((10, 3.0), (10, 2.0), (100, 4.0), (100, 2.0)) if s in grids]:
        k_maps, kv_maps, names = planted_maps(n, size, seed + 7, amplitude)
        for bottom in (False, True):
            before = recovery(k_maps, kv_maps, names, size, bottom, None, seed)
            after = recovery(k_maps, kv_maps, names, size, bottom, 0.05, seed)
            print(f"| one heuristic per neuron | {size} x {size} | {n:,} | {'yes' if bottom else 'no'} | {amplitude:g} | "
                  f"{before:.3f} | {after:.3f} |", flush=True)


if __name__ == "__main__":
    main()
