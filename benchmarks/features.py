"""Feature circuits: the shipped transcoders' quality and the attribution graph's cost and scores.

    PYTHONPATH=. python benchmarks/features.py            # zoo models and the Llama-family folder
    PYTHONPATH=. python benchmarks/features.py --no-llama # zoo models only
    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/features.py --no-zoo --no-llama --gemma3 DIR
        # Gemma 3 270M over the transcoders in DIR (`arithinterp train-transcoders pkg:gemma-3-270m --out DIR`;
        # `--gemma3 cache`: the ones cached by that command without --out)

Prints markdown tables: per shipped transcoder set, the card's held-out numbers (FVU, L0, dead
features, training wall time) and the replacement model measured here on held-out problems; per
graph, the wall time (median of repeats), nodes kept, the kept share of the features' influence,
replacement score, completeness and the exactness error (edges + bias against the model's values).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from patching import median_time  # noqa: E402  (benchmarks/patching.py: the same median timing)


def zoo_rows(runs: int, held_out: int) -> None:
    from arithinterp.features import load_transcoders
    from arithinterp.features.graph import prompt_graph
    from arithinterp.features.replacement import replacement_metrics
    from arithinterp.features.shipped import RECIPES, WEIGHTS_DIR
    from arithinterp.models import load_model
    from arithinterp.models.zoo import get_entry, held_out_prompts

    print("| transcoders | layer | FVU | L0 | dead | train wall s | replacement top-1 agreement | KL (nats) |")
    print("|---|---|---|---|---|---|---|---|")
    graphs = []
    for name in RECIPES:
        if not (WEIGHTS_DIR / name / "result.json").exists():
            print(f"| zoo:{name} | not shipped | | | | | | |")
            continue
        import json

        card = json.loads((WEIGHTS_DIR / name / "card.json").read_text())
        model = load_model(f"zoo:{name}")
        tc = load_transcoders(f"zoo:{name}")
        prompts = held_out_prompts(model, get_entry(name), limit=held_out, seed=1)
        measured = replacement_metrics(model, prompts, tc).as_dict()
        for layer, row in zip(tc.layers, card["layers"]):
            print(f"| zoo:{name} | {layer} | {row['fvu']:.4f} | {row['l0']:.2f} | {row['dead_fraction']:.3f} | "
                  f"{card['wall_seconds']:.0f} | {measured['agreement']:.4f} ({measured['n_positions']} positions) | "
                  f"{measured['kl']:.4f} |")
        prompt = "36+59=" if name == "add-100" else "136+259="
        graphs.append((f"zoo:{name}", model, prompt, tc))
    print()
    print("| model | prompt | tokens | graph s (median) | features expanded / active | kept nodes | kept influence | "
          "replacement | completeness | exactness: features | logits | error / terms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, model, prompt, tc in graphs:
        seconds, graph = median_time(lambda: prompt_graph(model, prompt, tc, progress=False), runs)
        _graph_row(label, prompt, graph, seconds)


def _graph_row(label, prompt, graph, seconds) -> None:
    s = graph.scores
    print(f"| {label} | `{prompt!r}` | {len(graph.tokens)} | {seconds:.3f} | "
          f"{s['n_expanded_features']} / {s['n_active_features']} | "
          f"{s['n_kept']} | {s['kept_influence']:.3f} | {s['replacement']:.3f} | {s['completeness']:.3f} | "
          f"{s['max_abs_error']:.2e} | {s['max_abs_error_logits']:.2e} ({s['max_rel_error_logits']:.1e} rel) | "
          f"{s['max_error_of_terms']:.1e} |")


def llama_row(runs: int) -> None:
    """A random-weight 4-layer d256 Llama folder (rotary, grouped-query, gated MLP), a 40-token
    few-shot prompt, transcoders briefly trained on random prompts (the graph's cost does not depend
    on their quality); checks the model's weights are untouched."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import arithinterp as ai
    from arithinterp.features import train_transcoders
    from arithinterp.features.graph import MAX_FEATURE_NODES, prompt_graph
    from arithinterp.models.tokenizers import number_tokenizer
    from arithinterp.tasks import prompts_for_pairs

    tokenizer = number_tokenizer(198)
    directory = Path(tempfile.mkdtemp()) / "llama-4L-d256"
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, intermediate_size=688, max_position_embeddings=128,
                         initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    model = ai.load_model(str(directory))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 100, (300,), generator=g), torch.randint(0, 100, (300,), generator=g)
    prompts = prompts_for_pairs(model, "+", a.tolist(), b.tolist(), "{a}+{b}=")
    tc = train_transcoders(model, prompts, n_features=256, k=16, steps=50, batch_size=512, progress=False)
    shots = "".join(f"{x}+{y}={x + y}\n" for x, y in [(12, 7), (30, 41), (5, 66), (23, 23), (8, 90), (44, 1),
                                                         (17, 17), (60, 9)])
    prompt = shots + "36+59="
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for cap in (MAX_FEATURE_NODES, None):
        seconds, graph = median_time(lambda: prompt_graph(model, prompt, tc, max_feature_nodes=cap, progress=False),
                                     runs)
        untouched = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        _graph_row(f"Llama 4L d256 (weights untouched: {untouched})", "8-shot 36+59=", graph, seconds)


def gemma3_transcoders(model, directory: str):
    """The transcoders in ``directory``, or the model's cached ones for ``"cache"``."""
    from arithinterp.features import load_transcoders
    from arithinterp.features.cache import require_transcoders

    return require_transcoders(model) if directory == "cache" else load_transcoders(directory)


def held_out_prompts(model):
    """The transcoder plan's held-out prompts (operands and few-shot prefixes never trained on) that
    the model answers correctly."""
    from arithinterp.features.plan import plan_prompts, plan_transcoders

    return plan_prompts(model, plan_transcoders(model))[1].correct_only(model)


def gemma3_rows(directory: str, runs: int, n_prompts: int = 3) -> None:
    """Graphs of Gemma 3 270M's held-out 3-shot 2-digit prompts (:func:`plan_prompts`) that the
    model answers correctly (the first ``n_prompts``), with the default ``max_feature_nodes`` and half of it."""
    from arithinterp.features.graph import MAX_FEATURE_NODES, prompt_graph
    from arithinterp.models import load_model

    model = load_model("pkg:gemma-3-270m")
    tc = gemma3_transcoders(model, directory)
    prompts = held_out_prompts(model)
    for i in range(n_prompts):
        one = prompts[i : i + 1]
        text = one.texts[0].splitlines()[-1]
        for cap in (MAX_FEATURE_NODES, MAX_FEATURE_NODES // 2):
            tokens = one.unpadded(torch.arange(1))[0]
            seconds, graph = median_time(lambda: prompt_graph(model, tokens, tc, max_feature_nodes=cap,
                                                              progress=False), runs)
            _graph_row("pkg:gemma-3-270m, 3-shot", text, graph, seconds)
    # the same first prompt on the model in float64: what is left of the exactness check is the precision's
    model64 = load_model("pkg:gemma-3-270m", dtype="float64")
    tokens = prompts[:1].unpadded(torch.arange(1))[0]
    seconds, graph = median_time(lambda: prompt_graph(model64, tokens, tc, progress=False), runs)
    _graph_row("pkg:gemma-3-270m in float64, 3-shot", prompts[:1].texts[0].splitlines()[-1], graph, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--held-out", type=int, default=2000, help="held-out problems for the replacement model")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--no-zoo", action="store_true")
    parser.add_argument("--gemma3", default=None, metavar="DIR", help="Gemma 3 270M's transcoders (not shipped)")
    args = parser.parse_args()
    if not args.no_zoo:
        zoo_rows(args.runs, args.held_out)
    if not args.no_llama:
        llama_row(args.runs)
    if args.gemma3:
        gemma3_rows(args.gemma3, args.runs)


if __name__ == "__main__":
    main()
