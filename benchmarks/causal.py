"""Benchmark: distributed alignment search — the acceptance numbers of ``docs/causal.md``.

Parts (each prints a markdown table; run them one at a time, they are short):

* ``planted`` — the hand-built model of ``arithinterp.causal.planted`` (``sum_mod_10`` in a known
  plane): principal-angle cosines, IIA of DAS / Boundless DAS / each baseline, the shuffled control.
* ``zoo`` — one zoo model and variable at the given ``[site:]layer:position`` cells (``+`` joins
  positions swapped together): held-out IIA with its 95% interval for DAS and every baseline, the
  controls at the first cell (the shuffled copy; for a carry also the parity of a·b), and the
  seconds per fit (one fit = training + scoring DAS and the baselines).

    python benchmarks/causal.py planted
    python benchmarks/causal.py zoo --model zoo:add-3digit --variable carry_2 --cells 0:b[1],1:answer[0] --k 2
    python benchmarks/causal.py zoo --variable carry_2 --cells "mlp_post:0:b[1]+answer[0]" --k 4 --per-position
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
    fit = causal.das(model, dataset, "resid_post", 0, "final", 2, steps=steps, progress=False)
    seconds = time.perf_counter() - start
    boundless = causal.das(model, dataset, "resid_post", 0, "final", method="boundless", steps=400, lr=2e-2,
                           baselines=(), progress=False)
    control = causal.interchange_dataset(prompts, "sum_mod_10", n=600, seed=0, shuffle=True)
    shuffled = causal.das(model, control, "resid_post", 0, "final", 2, steps=steps, baselines=(), progress=False)
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


def zoo(model_name: str, variable: str, cells: list[tuple[str, int, str]], k: int, steps: int, limit: int,
        n: int, seed: int, per_position: bool = False, reachable_only: bool = False) -> None:
    model = ai.load_model(model_name)
    from arithinterp.models.zoo import get_entry

    entry = get_entry(model_name)
    rng = random.Random(seed)
    a = [rng.randrange(*entry.task.a_range) for _ in range(limit)]
    b = [rng.randrange(*entry.task.b_range) for _ in range(limit)]
    prompts = ai.tasks.prompts_for_pairs(model, entry.task.op, a, b, entry.task.template,
                                         answer_digits=entry.task.answer_digits).correct_only(model)
    dataset = causal.interchange_dataset(prompts, variable, n=n, seed=seed)
    print(f"{model_name} {variable}: {len(prompts)} correct prompts, {len(dataset.train)} train / "
          f"{len(dataset.test)} held-out pairs, k={k}, {steps} steps, per_position={per_position}, "
          f"reachable_only={reachable_only}")
    print("\n| site L @ position | intervention | k | held-out IIA [95% CI] | logit diff | s / fit |")
    print("|---|---|---|---|---|---|")
    for i, (site, layer, spec) in enumerate(cells):
        position = spec.split("+") if "+" in spec else spec
        separate = per_position and isinstance(position, list)

        def fit_on(pairs: causal.InterchangeDataset, baselines: tuple[str, ...] = causal.BASELINES) -> causal.DASResult:
            return causal.das(model, pairs, site, layer, position, k, steps=steps, seed=seed, baselines=baselines,
                              reachable_only=reachable_only, per_position=separate, progress=False)

        cell = f"| {site} L{layer} @{spec} "
        start = time.perf_counter()
        fit = fit_on(dataset)
        seconds = time.perf_counter() - start
        for name, s in fit.scores.items():
            print(cell + row(name, s) + (f" {seconds:.1f} |" if name == "das" else " |"))
        if fit.meta["unreachable"]["test"]:
            print(f"{cell}| unreachable pairs left out: {fit.meta['unreachable']} |")
        if i > 0:
            continue
        controls: dict[str, Optional[str]] = {"shuffled copy": None}  # label -> value_from (None: shuffled)
        if variable.startswith("carry_") and "product_parity" in dataset.causal_model.names:
            controls["parity of a·b"] = "product_parity"
        for label, source in controls.items():
            control = causal.interchange_dataset(prompts, variable, n=n, seed=seed, shuffle=source is None,
                                                 value_from=source)
            result = fit_on(control, ("random",))
            print(cell + row(f"das on the {label} (chance {result.chance:.3f})", result.scores["das"]) + " |")
            print(cell + row(f"random on the {label}", result.scores["random"]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description="distributed alignment search: the acceptance numbers")
    parser.add_argument("part", choices=("planted", "zoo"))
    parser.add_argument("--model", default="zoo:add-3digit")
    parser.add_argument("--variable", default="carry_2")
    parser.add_argument("--cells", default="0:b[1]", help="comma-separated layer:position cells")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--limit", type=int, default=2000, help="prompts drawn before keeping the correct ones")
    parser.add_argument("--pairs", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-position", action="store_true", help="each joined position its own subspace")
    parser.add_argument("--reachable-only", action="store_true", help="score only the pairs a cell can reach")
    args = parser.parse_args()
    if args.part == "planted":
        planted(args.steps)
        return
    cells = []
    for c in args.cells.split(","):
        parts = c.split(":", 2) if not c.split(":", 1)[0].isdigit() else ["resid_post"] + c.split(":", 1)
        cells.append((parts[0], int(parts[1]), parts[2]))
    zoo(args.model, args.variable, cells, args.k, args.steps, args.limit, args.pairs, args.seed,
        per_position=args.per_position, reachable_only=args.reachable_only)


if __name__ == "__main__":
    main()
