"""The addition case study's reproduction on ``zoo:add-100`` with the shipped transcoders.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/feature_paths.py

Prints markdown tables: (1) every feature of each layer labelled at the final position and sorted
into a last-digit and a magnitude path, then each path zeroed at the final position of held-out
prompts (the answer logit left, with a bootstrap interval over prompts, beside as many random
features); (2) the graphs of a sample of held-out prompts, aggregated per feature; (3) where the
labelled features' decoders point, against the output weights of neurons with the same label
family at the same layer (``neurons.classify``), and against as many unlabelled neurons.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--graphs", type=int, default=50)
    args = parser.parse_args()
    import arithinterp as ai
    from arithinterp.features import feature_paths, graph_sample, label_features, load_transcoders, path_ablation
    from arithinterp.features.paths import PATHS, path_of
    from arithinterp.models.zoo import get_entry, held_out_prompts

    model = ai.load_model("zoo:add-100")
    tc = load_transcoders("zoo:add-100")
    grid = ai.tasks.arithmetic(model, op="+", a=range(100), b=range(100), template="{a}+{b}=")
    tables = [label_features(model, grid, tc, layer) for layer in tc.layers]
    paths = feature_paths(tables)
    held = held_out_prompts(model, get_entry("add-100"), limit=args.prompts, seed=1)

    print("## Paths\n")
    for name in PATHS:
        print(f"- {name}: " + "; ".join(f"layer {layer}: {sorted(f)}" for layer, f in sorted(paths[name].items())))
    result = path_ablation(model, held, tc, paths, n_random=10)
    print(f"\n{len(held)} held-out prompts, zeroed at the final position\n")
    print("| features zeroed | n | mean answer logit | share left (95% CI) | top-1 accuracy |")
    print("|---|---|---|---|---|")
    for row in result.to_frame().to_dict("records"):
        print(f"| {row['arm']} | {row['n_features']} | {row['mean_logit']:.2f} | {row['share']:.3f} "
              f"[{row['share_low']:.3f}, {row['share_high']:.3f}] | {row['accuracy']:.3f} |")
    every = path_ablation(model, held, tc, paths, n_random=10, positions=None)
    print("\nzeroed at every position\n")
    print("| features zeroed | n | share left (95% CI) | top-1 accuracy |")
    print("|---|---|---|---|")
    for row in every.to_frame().to_dict("records"):
        print(f"| {row['arm']} | {row['n_features']} | {row['share']:.3f} "
              f"[{row['share_low']:.3f}, {row['share_high']:.3f}] | {row['accuracy']:.3f} |")

    # (2) graphs over a sample of prompts, labelled, and each kept feature's path
    labels, path_label = {}, {}
    for table in tables:
        for row in range(len(table.neuron)):
            names = table.neuron_labels(row)
            key = (int(table.layer[row]), int(table.neuron[row]))
            labels[key] = ", ".join(names[:2])
            found = {path_of(n, table.families[table.index(n)]) for n in names} - {None}
            path_label[key] = found.pop() if len(found) == 1 else ("both" if found else "")
    some = held[: min(args.graphs, len(held))]
    sample = graph_sample(model, some, tc, labels=labels, progress=False)
    frame = sample.to_frame()
    frame["path"] = [path_label.get((layer, f), "") for layer, f in zip(frame["layer"], frame["feature"])]
    scores = sample.score_frame()
    print(f"\n## Graphs of {len(some)} held-out prompts\n")
    print(f"kept nodes median {scores['n_kept'].median():.0f}, kept influence median "
          f"{scores['kept_influence'].median():.3f}, replacement median {scores['replacement'].median():.3f}, "
          f"completeness median {scores['completeness'].median():.3f}\n")
    print("| layer | feature | position | kept in | active in | mean influence | path | labels |")
    print("|---|---|---|---|---|---|---|---|")
    for row in frame.head(15).to_dict("records"):
        print(f"| {row['layer']} | {row['feature']} | {row['position']} "
              f"| {row['kept_fraction']:.2f} | {row['active_fraction']:.2f} "
              f"| {row['mean_influence']:.4f} | {row['path'] or '—'} | {row['label'] or '—'} |")
    kept = frame[frame["kept"] > 0]
    total = float(kept["mean_influence"].to_numpy().sum())
    print("\nmean influence of the features kept in at least one graph, share by path:")
    for name in (*PATHS, "both", ""):
        part = kept[kept["path"] == name]
        share = float(part["mean_influence"].to_numpy().sum()) / total
        print(f"- {name or 'unlabelled'}: {share:.3f} ({len(part)} features)")

    # (3) overlap with the neuron-level heuristics at the same layers
    neurons = ai.neurons.classify(model, grid, layers=tc.layers, top_k=200)
    W_out = torch.stack([model.blocks[layer].mlp.W_out.detach().float() for layer in tc.layers])  # [L, d_mlp, d]
    print("\n## Features and neurons with the same label family\n")
    print("| layer | family | features | neurons | mean max cos to those neurons | to as many unlabelled neurons |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(tc.layers):
        table = tables[i]
        in_layer = neurons.layer == layer
        for family in sorted(set(table.families)):
            columns = torch.tensor([h for h, f in enumerate(table.families) if f == family])
            feats = table.neuron[table.labels[:, columns].any(1)]
            ncols = torch.tensor([h for h, f in enumerate(neurons.families) if f == family])
            if not len(feats) or not len(ncols):
                continue
            has = neurons.labels[:, ncols].any(1) & in_layer
            with_family = neurons.neuron[has]
            without = neurons.neuron[in_layer & ~neurons.classified]
            if not len(with_family):
                print(f"| {layer} | {family} | {len(feats)} | 0 | — | — |")
                continue
            dec = torch.nn.functional.normalize(tc.W_dec[tc.index(layer), feats], dim=1)
            outs = torch.nn.functional.normalize(W_out[i], dim=1)
            near = (dec @ outs[with_family].T).abs().max(1).values.mean()
            draws = []
            for _ in range(20):
                pick = without[torch.randperm(len(without), generator=g)[:len(with_family)]]
                draws.append((dec @ outs[pick].T).abs().max(1).values.mean())
            print(f"| {layer} | {family} | {len(feats)} | {len(with_family)} | {float(near):.3f} "
                  f"| {float(torch.stack(draws).mean()):.3f} |")

    # (4) the EAP-IG component circuit (as in docs/circuits.md) and the MLPs the graphs' features sit in
    from arithinterp import circuits
    from arithinterp.models.zoo import ZOO, zoo_prompts

    pairs = zoo_prompts(model, ZOO["add-100"]).correct_only(model).counterfactual(vary="a", seed=0)[:100]
    scored = circuits.score_edges(model, pairs, "eap-ig", steps=5, progress=False)
    top = circuits.top_n(scored, 32)
    magnitude = scored.scores.abs()
    print("\n## EAP-IG component circuit (100 pairs varying a, top 32 edges) and the graphs' features\n")
    print(f"nodes of the top-32 circuit: {', '.join(top.nodes)}\n")
    print("| sender | share of all edges' abs EAP-IG score | share of top-32 edges | share of the graphs' "
          "feature influence |")
    print("|---|---|---|---|")
    feature_influence: dict[int, float] = {}
    for layer, influence in zip(frame["layer"].tolist(), frame["mean_influence"].tolist()):
        feature_influence[int(layer)] = feature_influence.get(int(layer), 0.0) + float(influence)
    for sender in dict.fromkeys(scored.senders):
        mask = torch.tensor([s == sender for s in scored.senders])
        graph_share = ""
        if sender.startswith("MLP"):
            layer = int(sender[3:])
            graph_share = f"{feature_influence.get(layer, 0.0) / sum(feature_influence.values()):.3f}"
        print(f"| {sender} | {float(magnitude[mask].sum() / magnitude.sum()):.3f} "
              f"| {int((mask & top.kept).sum())} of 32 | {graph_share or '—'} |")


if __name__ == "__main__":
    main()
