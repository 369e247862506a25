"""Ablations and decoding through the engine's stepper, against whole forwards, in one process.

Each row times one analysis two ways on the same model and prompts, alternating, one thread,
median of ``--runs``: the reference path (``engine="hooks"``: one whole forward per ablation cell;
decoding by re-running the prompt for every answer token) and the stepped path (cells stacked and
resumed at the ablated layer and position with the prompts' keys and values reused; each answer
token after the first at its own position). It reports both times, their ratio, and the largest
difference between the two results.

* ``digits``: ``patching.digit_ablation`` (every head × answer digit, mean ablation) on
  ``zoo:add-3digit`` (held-out prompts) and on a random-weight Llama folder (4 layers, d_model 256,
  digit tokenizer) with few-shot prompts; difference = per-prompt log-probability of the digit;
* ``neurons``: ``neurons.importance(method="mean-ablation")`` over every neuron of every layer
  (difference = scores) on ``zoo:add-100`` and the Llama folder; ``neurons.ablate_heuristic`` over
  every labelled heuristic of ``zoo:add-100``, and ``neurons.ablate_for_prompt`` (five k, both
  arms) on ``zoo:add-100`` and on 900 few-shot prompts of the Llama folder (difference = accuracies);
* ``decode``: ``PromptSet.evaluate`` on ``zoo:add-3digit`` and on a random-weight
  TransformerLens-native model (4 layers, d_model 256, digit tokenizer, few-shot prompts),
  against one plain forward of the prompts in the same batches (difference = generated tokens
  that differ).

    python benchmarks/ablations.py [--only digits neurons decode] [--runs 3] [--quick] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from evaluate import digit_tokenizer  # noqa: E402  (the digit-split tokenizer of the evaluate benchmark)
from patching import write_section  # noqa: E402

BEGIN, END = "<!-- ablations:begin -->", "<!-- ablations:end -->"
SECTIONS = ("digits", "neurons", "decode")


def llama_digits(quick: bool):
    """A random-weight Llama folder (4 layers, d_model 256; 2 layers, d_model 64 with ``quick``) with a
    digit tokenizer, loaded with ``load_model``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import arithinterp as ai

    tokenizer = digit_tokenizer(64)
    layers, d_model, d_mlp = (2, 64, 128) if quick else (4, 256, 688)
    config = LlamaConfig(vocab_size=64, hidden_size=d_model, intermediate_size=d_mlp, num_hidden_layers=layers,
                         num_attention_heads=8 if not quick else 4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.1, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    directory = Path(tempfile.mkdtemp()) / f"llama-{layers}L-d{d_model}-digits"
    LlamaForCausalLM(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return ai.load_model(str(directory)), f"Llama {layers}L d{d_model} (HF folder, digit tokens)"


def native_digits(quick: bool):
    """A random-weight TransformerLens-native model with a digit tokenizer (``boot_native``)."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    from arithinterp.models.tokenizers import digit_tokenizer as native_tokenizer, save_and_reload

    tokenizer = save_and_reload(native_tokenizer(), Path(tempfile.mkdtemp()))
    size = dict(d_model=64, d_head=16, n_heads=4, n_layers=2, d_mlp=256) if quick else \
        dict(d_model=256, d_head=64, n_heads=4, n_layers=4, d_mlp=1024)
    cfg = TransformerBridgeConfig(**size, n_ctx=256, d_vocab=len(tokenizer), act_fn="relu", normalization_type="LN",
                                  seed=0)
    model = TransformerBridge.boot_native(cfg, tokenizer=tokenizer).eval()
    return model, f"native {size['n_layers']}L d{size['d_model']} (digit tokens)"


def zoo(name: str):
    import arithinterp as ai
    from arithinterp.errors import ModelFileError

    try:
        return ai.load_model(f"zoo:{name}")
    except ModelFileError as error:
        print(f"skipping zoo:{name}: {error}")
        return None


def side_by_side(fast, slow, runs: int) -> tuple[float, object, float, object]:
    """Medians of ``runs`` alternating calls of ``fast`` and ``slow``: ``(fast s, its result, slow s, its result)``."""
    times: dict = {"fast": [], "slow": []}
    out: dict = {}
    for _ in range(runs):
        for name, fn in (("fast", fast), ("slow", slow)):
            start = time.perf_counter()
            out[name] = fn()
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["fast"]), out["fast"], statistics.median(times["slow"]), out["slow"]


def row(what: str, setup: str, slow: float, fast: float, diff: float, note: str = "") -> dict:
    return dict(what=what, setup=setup, slow=slow, fast=fast, diff=diff, note=note)


def digit_setups(zoo_limit: int, other: tuple, steps: tuple[int, int], few_shot: int, n: int) -> list[tuple]:
    """(model, label, prompts): zoo:add-3digit's held-out problems (when shipped), then ``other``
    (a (model, label) built here) on ``n`` few-shot 2-digit problems, operands 10..98 in ``steps``."""
    from arithinterp.models import zoo as zoo_lib
    from arithinterp.tasks import arithmetic

    setups = []
    model = zoo("add-3digit")
    if model is not None:
        setups.append((model, "zoo:add-3digit",
                       zoo_lib.held_out_prompts(model, zoo_lib.get_entry("add-3digit"), limit=zoo_limit)))
    model, label = other
    prompts = arithmetic(model, a=range(10, 99, steps[0]), b=range(10, 99, steps[1]), few_shot=few_shot,
                         answer_digits=3)
    return setups + [(model, label, prompts[:n])]


def bench_digits(args) -> list[dict]:
    from arithinterp.patching.components import parse_components
    from arithinterp.patching.digits import digit_scores

    setups = digit_setups(40 if args.quick else 500, llama_digits(args.quick), (7, 11), 3, 8 if args.quick else 24)
    rows = []
    for model, label, prompts in setups:
        cfg = model.cfg
        parsed = parse_components(model, [f"L{l}H{h}" for l in range(cfg.n_layers) for h in range(cfg.n_heads)],
                                  ("head",))
        digit_scores(model, prompts, parsed, "mean", 0, engine="stepped")  # the one-time stepper check
        def run(choice, model=model, prompts=prompts, parsed=parsed):
            return digit_scores(model, prompts, parsed, "mean", 0, engine=choice)

        fast, stepped, slow, hooked = side_by_side(lambda: run("stepped"), lambda: run("hooks"), args.runs)
        diff = float((stepped[1][..., 1] - hooked[1][..., 1]).abs().max())
        cells = len(parsed) * prompts.answer_tokens.shape[1]
        T = int(prompts.tokens.shape[1])
        rows.append(row("`patching.digit_ablation` (mean)", label, slow, fast, diff,
                        f"{len(prompts)} prompts of {T} tokens, {cells} cells"))
    return rows


def bench_neurons(args) -> list[dict]:
    from arithinterp import neurons
    from arithinterp.tasks import arithmetic

    rows = []
    model = zoo("add-100")
    setups = []
    if model is not None:
        prompts = arithmetic(model, a=range(100), b=range(100))
        pairs = prompts.counterfactual(vary="a", seed=0)[:: 1000 if args.quick else 150]
        setups.append((model, "zoo:add-100", pairs))
    model, label = llama_digits(args.quick)
    pairs = arithmetic(model, a=range(10, 99, 7), b=range(10, 99, 11), few_shot=3).counterfactual(
        vary="a", seed=0, distinct_first_token=True)[: 2 if args.quick else 6]
    setups.append((model, label, pairs))
    for model, label, pairs in setups:
        def run(choice, model=model, pairs=pairs):
            return neurons.importance(model, pairs, method="mean-ablation", top_k=None, engine=choice).scores

        run("stepped")
        fast, stepped, slow, hooked = side_by_side(lambda: run("stepped"), lambda: run("hooks"), args.runs)
        n = model.cfg.n_layers * model.cfg.d_mlp
        rows.append(row("`neurons.importance` (mean-ablation)", label, slow, fast,
                        float((stepped - hooked).abs().max()),
                        f"{len(pairs)} pairs of {pairs.clean.tokens.shape[1]} tokens, {n} neurons"))
    model = zoo("add-100")
    if model is not None:
        prompts = arithmetic(model, a=range(0, 100, 10 if args.quick else 2), b=range(0, 100, 10 if args.quick else 2))
        table = neurons.classify(model, prompts, top_k=20 if args.quick else 50)
        names = [n for n, c in zip(table.names, table.labels.sum(0).tolist()) if c >= 1]

        def heuristics(choice):
            result = neurons.ablate_heuristic(model, prompts, table, names, engine=choice)
            return torch.stack([result.associated_after, result.other_after]).nan_to_num(-1)

        heuristics("stepped")
        fast, stepped, slow, hooked = side_by_side(lambda: heuristics("stepped"), lambda: heuristics("hooks"),
                                                   args.runs)
        rows.append(row("`neurons.ablate_heuristic`", "zoo:add-100", slow, fast,
                        float((stepped - hooked).abs().max()), f"{len(prompts)} prompts, {len(names)} heuristics"))
        rows.append(for_prompt_row(model, "zoo:add-100", prompts, table, args.runs))
    model, label = llama_digits(args.quick)
    step = 9 if args.quick else 3
    prompts = arithmetic(model, a=range(10, 99, step), b=range(10, 99, step), few_shot=3)
    table = neurons.classify(model, prompts, top_k=20 if args.quick else 50)
    rows.append(for_prompt_row(model, label, prompts, table, args.runs))
    return rows


def for_prompt_row(model, label: str, prompts, table, runs: int) -> dict:
    """``neurons.ablate_for_prompt`` (k = 1, 2, 5, 10, 20: ten cells and the unablated run) both ways."""
    from arithinterp import neurons

    def for_prompt(choice):
        result = neurons.ablate_for_prompt(model, prompts, table, engine=choice)
        return torch.stack([result.heuristic_correct, result.control_correct])

    for_prompt("stepped")
    fast, stepped, slow, hooked = side_by_side(lambda: for_prompt("stepped"), lambda: for_prompt("hooks"), runs)
    return row("`neurons.ablate_for_prompt`", label, slow, fast, float((stepped - hooked).abs().max()),
               f"{len(prompts)} prompts of {prompts.tokens.shape[1]} tokens, 5 k × 2 arms")


def bench_decode(args) -> list[dict]:
    from arithinterp.engine import decode
    from arithinterp.tasks.evaluation import _batches as evaluation_batches

    setups = digit_setups(100 if args.quick else 2000, native_digits(args.quick), (3, 3), 5, 40 if args.quick else 400)
    rows = []
    for model, label, prompts in setups:
        def forward(model=model, prompts=prompts):  # one plain forward of every prompt, in evaluate's batches
            with torch.inference_mode():
                for idx in evaluation_batches(prompts, model, None, 1, prompts.answer_tokens.shape[1]):
                    model(prompts.unpadded(idx))

        def evaluate(mode, model=model, prompts=prompts):
            decode._MODES[model] = mode  # "full": the plain forward, the prompt re-run for every answer token
            try:
                return prompts.evaluate(model).generated_tokens
            finally:
                decode._MODES[model] = "stepped"

        prompts.evaluate(model)
        assert decode.decode_mode(model) == "stepped"
        fast, stepped, slow, plain = side_by_side(lambda: evaluate("stepped"), lambda: evaluate("full"), args.runs)
        one, _, _, _ = side_by_side(forward, lambda: None, args.runs)
        k = prompts.answer_tokens.shape[1]
        rows.append(row("`PromptSet.evaluate`", label, slow, fast, float((stepped != plain).sum()),
                        f"{len(prompts)} prompts of {prompts.tokens.shape[1]} tokens, {k} answer tokens; one forward "
                        f"{one:.2f} s: stepped = {fast / one:.2f} × one forward ({fast / one / k:.2f} per answer "
                        f"token), before {slow / one:.2f} ×"))
    return rows


def table(rows: list[dict], runs: int) -> str:
    lines = ["| analysis | setup | whole forwards s | stepped s | speed-up | max diff | what |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['setup']} | {r['slow']:.2f} | {r['fast']:.2f} | {r['slow'] / r['fast']:.1f}× "
                     f"| {r['diff']:.1e} | {r['note']} |")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines += ["", f"Medians of {runs} alternating runs, one thread; load average (1 min) at the end: {load:.2f} on "
              f"{os.cpu_count()} CPUs. Max diff: log-probabilities (digit ablation), scores (importance), accuracies "
              "(ablate_heuristic), generated tokens that differ (evaluate)."]
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small smoke run: 1 run, few prompts, tiny models")
    parser.add_argument("--write", type=Path, default=None, help="write the table into this markdown file")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 1
    torch.set_num_threads(1)
    benches = dict(digits=bench_digits, neurons=bench_neurons, decode=bench_decode)
    rows = [r for name in args.only for r in benches[name](args)]
    text = table(rows, args.runs)
    print(text)
    if args.write:
        write_section(args.write, text, (BEGIN, END), "Ablations and decoding through the stepper",
                      f"python benchmarks/ablations.py --runs {args.runs}")
    return rows


if __name__ == "__main__":
    main()
