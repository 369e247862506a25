"""Benchmark: distributed alignment search — the acceptance numbers of ``docs/causal.md``.

Parts (each prints a markdown table; run them one at a time, they are short):

* ``planted`` — the hand-built model of ``arithinterp.causal.planted`` (``sum_mod_10`` in a known
  plane): principal-angle cosines, IIA of DAS / Boundless DAS / each baseline, the shuffled control.
* ``zoo`` — one zoo model and variable at the given ``[site:]layer:position`` cells (``+`` joins
  positions swapped together; ``--per-position`` gives each its own subspace) and each ``k``:
  held-out IIA with its 95% interval for DAS and every baseline, the controls at the first cell (the
  shuffled copy; for a carry also the parity of a·b; with ``--boundless`` Boundless DAS), and the
  seconds per fit (one fit = training + scoring DAS and the baselines); ``--history`` prints the
  training loss, ``--reachable-only`` scores only the pairs a cell can reach.
* ``separability`` — how far the sum's representation splits into a units and a tens part.
* ``planted-helix`` — DAS on a planted helix of the sum (:func:`~arithinterp.causal.planted.planted_helix_model`).

    python benchmarks/causal.py planted
    python benchmarks/causal.py zoo --model zoo:add-3digit --variable carry_hundreds --cells 0:b[1],1:answer[0] --k 2
    python benchmarks/causal.py zoo --model zoo:add-100 --variable sum_mod_10 --cells resid_post:1:final --k 2,4,5
    python benchmarks/causal.py zoo --variable carry_hundreds --cells "mlp_post:0:b[1]+answer[0]" --k 4 --per-position
    python benchmarks/causal.py separability --model zoo:add-100
    python benchmarks/causal.py planted-helix --k 5,1 --steps 150 --pairs 800
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Optional

import arithinterp as ai
from arithinterp import causal


def row(name: str, s: dict) -> str:
    return f"| {name} | {s['k']} | {s['iia']:.3f} [{s['low']:.3f}, {s['high']:.3f}] | {s['logit_diff']:+.2f} |"


def planted(steps: int) -> None:
    import tempfile
    from pathlib import Path

    from arithinterp.causal.planted import planted_model, planted_plane
    from arithinterp.models.tokenizers import number_tokenizer, save_and_reload

    tokenizer = save_and_reload(number_tokenizer(198), Path(tempfile.mkdtemp()))
    model = planted_model(tokenizer)
    prompts = ai.tasks.arithmetic(model, op="+", a=range(10), b=range(10), template="{a}+{b}=")
    dataset = causal.interchange_dataset(prompts, "sum_mod_10", n=600, seed=0)
    start = time.perf_counter()
    fit = causal.das(model, dataset, "resid_post", 0, 2, positions="final", steps=steps, progress=False)
    seconds = time.perf_counter() - start
    boundless = causal.das(model, dataset, "resid_post", 0, positions="final", method="boundless", steps=400, lr=2e-2,
                           baselines=(), progress=False)
    control = causal.interchange_dataset(prompts, "sum_mod_10", n=600, seed=0, shuffle=True)
    shuffled = causal.das(model, control, "resid_post", 0, 2, positions="final", steps=steps, baselines=(),
                          progress=False)
    cos = causal.principal_angle_cosines(fit.basis, planted_plane())
    cos_b = causal.principal_angle_cosines(boundless.basis, planted_plane())
    print(f"planted sum_mod_10, resid_post L0 @final, {len(dataset.test)} held-out pairs, {steps} steps, "
          f"fit {seconds:.1f} s")
    print(f"principal-angle cosines DAS: {', '.join(f'{c:.4f}' for c in cos)}; "
          f"Boundless (k={boundless.k}): {', '.join(f'{c:.4f}' for c in cos_b)}")
    print("\n| intervention | k | held-out IIA [95% CI] | logit diff |\n|---|---|---|---|")
    for name, s in fit.scores.items():
        print(row(name, s))
    print(row("boundless", boundless.scores["boundless"]))
    print(row(f"das on shuffled labels (chance {control.chance:.3f})", shuffled.scores["das"]))
    print(f"\nchance (balanced pairs): {dataset.chance:.3f}")


def zoo(model_name: str, variable: str, cells: list[tuple[str, int, str]], ks: list[int], steps: int, limit: int,
        n: int, seed: int, base: int = 10, lr: float = 1e-2, baselines: tuple[str, ...] = causal.BASELINES,
        boundless: bool = False, history: bool = False, control: bool = True, per_position: bool = False,
        reachable_only: bool = False) -> None:
    model = ai.load_model(model_name)
    from arithinterp.models.zoo import get_entry

    entry = get_entry(model_name)
    rng = random.Random(seed)
    a = [rng.randrange(*entry.task.a_range) for _ in range(limit)]
    b = [rng.randrange(*entry.task.b_range) for _ in range(limit)]
    prompts = ai.tasks.prompts_for_pairs(model, entry.task.op, a, b, entry.task.template,
                                         answer_digits=entry.task.answer_digits).correct_only(model)
    causal_model = causal.single_token_addition(base) if base != 10 else None
    dataset = causal.interchange_dataset(prompts, variable, causal_model, n=n, seed=seed)
    print(f"{model_name} {variable}: {len(prompts)} correct prompts, {len(dataset.train)} train / "
          f"{len(dataset.test)} held-out pairs ({dataset.meta}), k={ks}, {steps} steps, lr {lr}, "
          f"per_position={per_position}, reachable_only={reachable_only}")
    print("\n| site L @ position | intervention | k | held-out IIA [95% CI] | logit diff | s / fit |")
    print("|---|---|---|---|---|---|")
    for i, (site, layer, spec) in enumerate(cells):
        position = spec.split("+") if "+" in spec else spec
        separate = per_position and isinstance(position, list)

        def fit_on(pairs: causal.InterchangeDataset, k: int, baselines: tuple[str, ...]) -> causal.DASResult:
            return causal.das(model, pairs, site, layer, k, positions=position, steps=steps, lr=lr, seed=seed,
                              baselines=baselines, reachable_only=reachable_only, per_position=separate, progress=False)

        cell = f"| {site} L{layer} @{spec} "
        for j, k in enumerate(ks):
            start = time.perf_counter()
            fit = fit_on(dataset, k, baselines if j == 0 else ("random",))
            seconds = time.perf_counter() - start
            for name, s in fit.scores.items():
                if j == 0 or name in ("das", "random"):
                    print(cell + row(name, s) + (f" {seconds:.1f} |" if name == "das" else " |"))
            if fit.meta["unreachable"]["test"]:
                print(f"{cell}| unreachable pairs left out: {fit.meta['unreachable']} |")
            if history:  # the training loss, to see whether it converged
                h = fit.history
                marks = ", ".join(f"{t}: {h[t]:.2f}" for t in sorted({0, len(h) // 4, len(h) // 2, 3 * len(h) // 4,
                                                                      len(h) - 1}))
                print(cell + f"| loss (k={k}, step: loss) {marks}; train IIA {fit.train_iia:.3f} | | | | |")
        if i > 0:
            continue
        controls: dict[str, Optional[str]] = {"shuffled copy": None} if control else {}  # label -> value_from
        if control and variable.startswith("carry_") and "product_parity" in dataset.causal_model.names:
            controls["parity of a·b"] = "product_parity"
        for label, source in controls.items():
            pairs = causal.interchange_dataset(prompts, variable, causal_model, n=n, seed=seed,
                                               shuffle=source is None, value_from=source)
            result = fit_on(pairs, ks[0], ("random",))
            print(cell + row(f"das on the {label} (chance {result.chance:.3f})", result.scores["das"]) + " |")
            print(cell + row(f"random on the {label}", result.scores["random"]) + " |")
        if boundless:
            fit = causal.das(model, dataset, site, layer, positions=position, method="boundless", steps=2 * steps,
                             lr=lr, baselines=(), seed=seed, progress=False)
            print(cell + row("boundless", fit.scores["boundless"]) + " |")


def separability(model_name: str, limit: int) -> None:
    """How far the sum's representation at the final position splits into a units part plus a tens
    part: R² of the per-sum means (what the sum explains) against R² of the best additive fit
    ``f(sum mod 10) + g(sum // 10)`` (a subspace interchange of either needs that split)."""
    import torch

    from arithinterp.activations import collect

    model = ai.load_model(model_name)
    prompts = ai.tasks.arithmetic(model, op="+", a=range(100), b=range(100), template="{a}+{b}=")[:limit]
    sites = ["resid_mid", "resid_post", "mlp_out", "mlp_post"]
    layers = list(range(model.cfg.n_layers))
    acts = collect(model, prompts, sites=sites, layers=layers, positions=["final"], progress=False)
    total = prompts.a + prompts.b
    print(f"{model_name}: {len(prompts)} prompts, the final position\n")
    print("| site | layer | R² of the sum | R² of f(sum mod 10) + g(sum // 10) "
          "| R² of f(sum mod 100) + g(sum // 100) |")
    print("|---|---|---|---|---|")
    for site in sites:
        for layer in layers:
            x = acts.get(site, layer, "final").double()
            ss = ((x - x.mean(0)) ** 2).sum()

            def r2(*labels: torch.Tensor) -> float:
                design = torch.cat([torch.nn.functional.one_hot(v, int(v.max()) + 1).double()[:, (1 if i else 0):]
                                    for i, v in enumerate(labels)], dim=1)
                fitted = design @ torch.linalg.lstsq(design, x).solution
                return float(1 - ((x - fitted) ** 2).sum() / ss)

            print(f"| {site} | {layer} | {r2(total):.3f} | {r2(total % 10, total // 10):.3f} | "
                  f"{r2(total % 100, total // 100):.3f} |")


def planted_helix(steps: int, ks: list[int], n: int, only: str = "") -> None:
    """DAS on :func:`arithinterp.causal.planted.planted_helix_model`: the planted subspaces against
    the learned ones, and each split's IIA (the units digit's 5 planted dims cap it below 1)."""
    import tempfile
    from pathlib import Path

    from arithinterp.causal.planted import planted_helix_model, planted_helix_subspace
    from arithinterp.models.tokenizers import number_tokenizer, save_and_reload

    tokenizer = save_and_reload(number_tokenizer(198), Path(tempfile.mkdtemp()))
    model = planted_helix_model(tokenizer)
    prompts = ai.tasks.arithmetic(model, op="+", a=range(100), b=range(100), template="{a}+{b}=")
    print("| variable | intervention | k | held-out IIA [95% CI] | logit diff | cosines with the planted subspace |")
    print("|---|---|---|---|---|---|")
    for base, variable, planted_name in ((10, "sum_mod_10", "sum_mod_10"), (100, "magnitude", "hundreds"),
                                         (100, "sum_mod_100", "sum_mod_100")):
        if only and variable != only:
            continue
        dataset = causal.interchange_dataset(prompts, variable, causal.single_token_addition(base), n=n, seed=0)
        truth = planted_helix_subspace(planted_name)
        where = causal.Site("resid_post", 0, "final")
        from arithinterp.causal.scoring import evaluate, source_values

        sources = source_values(model, dataset, where, 256)
        oracle = evaluate(model, dataset, where, causal.FixedSubspace(truth), sources, dataset.test, 256)
        oracle["k"] = truth.shape[1]
        name = f"{variable} (base {base})"
        print(f"| {name} " + row("planted subspace", oracle) + " 1 |")
        for k in sorted({truth.shape[1], *ks}):  # the planted dimension and the ones asked for
            fit = causal.das(model, dataset, "resid_post", 0, k, positions="final", steps=steps, baselines=("random",),
                             progress=False)
            cos = causal.principal_angle_cosines(fit.basis, truth)
            print(f"| {name} " + row("das", fit.scores["das"]) + f" {', '.join(f'{c:.3f}' for c in cos)} |")
            print(f"| {name} " + row("random", fit.scores["random"]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description="distributed alignment search: the acceptance numbers")
    parser.add_argument("part", choices=("planted", "zoo", "separability", "planted-helix"))
    parser.add_argument("--model", default="zoo:add-3digit")
    parser.add_argument("--variable", default="carry_hundreds")
    parser.add_argument("--cells", default="0:b[1]",
                        help="comma-separated [site:]layer:position cells (site default resid_post)")
    parser.add_argument("--k", default="2", help="dimensions interchanged; a comma-separated list fits each")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--limit", type=int, default=2000, help="prompts drawn before keeping the correct ones")
    parser.add_argument("--pairs", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base", type=int, default=10, help="single-token addition split at this base (10 or 100)")
    parser.add_argument("--baselines", default=",".join(causal.BASELINES), help="baselines at each cell's first k")
    parser.add_argument("--boundless", action="store_true", help="Boundless DAS at the first cell too")
    parser.add_argument("--history", action="store_true", help="print the training loss of each fit")
    parser.add_argument("--no-control", action="store_true", help="skip the controls (shuffled copy, parity of a·b)")
    parser.add_argument("--per-position", action="store_true", help="each joined position its own subspace")
    parser.add_argument("--reachable-only", action="store_true", help="score only the pairs a cell can reach")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    if args.part == "planted":
        planted(args.steps)
        return
    if args.part == "separability":
        separability(args.model, args.limit)
        return
    if args.part == "planted-helix":
        names = ("sum_mod_10", "magnitude", "sum_mod_100")  # --variable picks one of them (default: all)
        planted_helix(args.steps, ks, args.pairs, args.variable if args.variable in names else "")
        return
    cells = []
    for c in args.cells.split(","):
        parts = c.split(":")
        site, layer, position = ("resid_post", *parts) if len(parts) == 2 else parts
        cells.append((site, int(layer), position))
    baselines = tuple(b for b in args.baselines.split(",") if b)
    zoo(args.model, args.variable, cells, ks, args.steps, args.limit, args.pairs, args.seed, args.base, args.lr,
        baselines, args.boundless, args.history, not args.no_control, args.per_position, args.reachable_only)


if __name__ == "__main__":
    main()
