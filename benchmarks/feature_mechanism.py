"""How far a model's transcoders carry its addition, on held-out prompts, each number beside its control.

    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/feature_mechanism.py zoo:add-100
    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/feature_mechanism.py pkg:gemma-3-270m --prompts 20

The model's transcoders are its shipped or cached ones (``arithinterp train-transcoders MODEL``).
The held-out prompts are the transcoder plan's (operand pairs and few-shot prefixes never trained
on) that the model answers correctly. Prints markdown:

1. the card's held-out replacement model (top-1 agreement, KL) and per-layer FVU / dead features;
2. over the graphs of ``--prompts`` held-out prompts: where the answer logit's direct inputs come
   from (features / token embeddings / error nodes; median and range), and the share of the kept
   features' influence in labelled supernodes beside the same graphs labelled from operand plots
   whose grid cells are shuffled (the null);
3. the swap test on the held-out prompts beside random features of the same size.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=20, help="held-out prompts graphed (default 20)")
    parser.add_argument("--swap-prompts", type=int, default=40, help="held-out prompts of the swap test")
    parser.add_argument("--role", default="final", help="the position the swap test acts at")
    args = parser.parse_args()

    from arithinterp.errors import AnalysisError
    from arithinterp.features import attribution_graph
    from arithinterp.features.cache import require_transcoders
    from arithinterp.features.plan import plan_prompts, plan_transcoders, transcoder_plots
    from arithinterp.features.steering import swap_test
    from arithinterp.features.supernodes import label_graph, labelled_share, supernodes
    from arithinterp.models import load_model

    torch.manual_seed(0)
    model = load_model(args.model)
    transcoders = require_transcoders(model)
    held_out = plan_prompts(model, plan_transcoders(model))[1].correct_only(model)
    plots = transcoder_plots(model, transcoders, progress=False)
    cells = torch.randperm(len(plots.a), generator=torch.Generator().manual_seed(1))
    null = dataclasses.replace(plots, values=plots.values[cells], features=plots.features[cells])

    replacement = transcoders.metrics.get("replacement", {})
    print(f"## {args.model}: {transcoders.n_features} features per layer, k={transcoders.k}, "
          f"{len(held_out)} held-out prompts answered correctly\n")
    print(f"Held-out replacement model: top-1 agreement {replacement.get('agreement', float('nan')):.3f} "
          f"(KL {replacement.get('kl', float('nan')):.3f} nats) over {replacement.get('n_positions', 0)} positions\n")
    print("| layer | FVU | dead |\n|---|---|---|")
    for layer, row in enumerate(transcoders.metrics.get("layers", [])):
        print(f"| {layer} | {row.get('fvu', float('nan')):.4f} | {row.get('dead_fraction', float('nan')):.2f} |")

    shares: dict[str, list[float]] = {"feature": [], "embedding": [], "error": [], "labelled": [], "null": []}
    seconds = []
    for i in range(min(args.prompts, len(held_out))):
        prompt = held_out[i : i + 1]
        start = time.perf_counter()
        graph = attribution_graph(model, prompt, transcoders, progress=False)
        seconds.append(time.perf_counter() - start)
        for kind in ("feature", "embedding", "error"):
            shares[kind].append(graph.scores[f"logit_inputs_{kind}"])
        shares["labelled"].append(labelled_share(supernodes(graph, label_graph(graph, plots, prompt), prompt, plots)))
        shares["null"].append(labelled_share(supernodes(graph, label_graph(graph, null, prompt), prompt, null)))
    print(f"\nGraphs of {len(seconds)} held-out prompts (median graph {statistics.median(seconds):.1f} s):\n")
    print("| measure | median (range) |\n|---|---|")
    for kind in ("feature", "embedding", "error"):
        print(f"| answer logit's direct inputs from {kind} nodes | {_spread(shares[kind])} |")
    print(f"| kept features' influence in labelled supernodes | {_spread(shares['labelled'])} |")
    print(f"| the same, labels from shuffled operand plots (null) | {_spread(shares['null'])} |")

    try:
        swap = swap_test(model, held_out[: args.swap_prompts], transcoders, plots, role=args.role, progress=False)
    except AnalysisError as why:  # too few labelled token groups to swap one for another
        print(f"\nSwap test at {args.role!r}: does not apply: {why}")
        return
    print(f"\nSwap test at {args.role!r} on {int(swap.meta['n_tested'])} held-out problems: answer became the "
          f"swapped-in token in {swap.as_predicted:.0%} (random features of the same size: "
          f"{swap.as_predicted_control:.0%}); answer changed at all {swap.changed:.0%} (random: "
          f"{swap.changed_control:.0%}); labelled token groups: {swap.groups}")


if __name__ == "__main__":
    main()
