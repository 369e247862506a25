"""Building prompt sets: ``tasks.arithmetic`` against tokenizing the same texts with TransformerLens.

    python benchmarks/prompts.py [--runs 5] [--models add-100 add-3digit] [--few-shot 3]

For each zoo model, the prompts of a 100 × 100 operand grid (and their 3-shot versions) are built three
ways in one process, alternating, one CPU thread:

* TransformerLens: ``model.to_tokens(texts)``, token ids only (padded), the reference floor: no
  answers, operand positions or checks;
* the tokenizer's call: ``tasks.arithmetic`` reading ids and offsets through the tokenizer's own
  ``__call__``, the cyclic garbage collector running;
* ``tasks.arithmetic`` as it is: a fast tokenizer read through its Rust backend, the collector paused.

Reported: the median seconds of each, the speed-up over the tokenizer's call, and whether the three
prompt sets hold identical tokens (TransformerLens's rows compared without their padding, whose
token may differ).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

GRIDS = {"add-100": range(100), "add-3digit": range(100, 1000, 9)}  # 100 operand values a side each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(GRIDS), choices=list(GRIDS))
    parser.add_argument("--few-shot", type=int, default=3)
    parser.add_argument("--side", type=int, default=100, help="operand values per side (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import arithinterp as ai
    from arithinterp.tasks import arithmetic, encoding, generators

    def the_tokenizers_call(build):
        """``build()`` with ids and offsets from the tokenizer's own call, the collector running."""
        saved = encoding._direct_backend, generators.encode_prompts
        encoding._direct_backend = lambda tokenizer, texts: None
        generators.encode_prompts = encoding.encode_prompts.__wrapped__  # without the collector's pause
        try:
            return build()
        finally:
            encoding._direct_backend, generators.encode_prompts = saved

    print("| model | prompts | TransformerLens `to_tokens` | tokenizer's call | arithinterp | speed-up | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        model = ai.load_model(f"zoo:{name}")
        values = GRIDS[name][: args.side]
        for few_shot in (0, args.few_shot):
            def ours():  # few-shot prompts are longer than the zoo's context: built from the tokenizer alone
                return arithmetic(model if not few_shot else model.tokenizer, a=values, b=values, few_shot=few_shot)

            prompts = ours()
            texts = list(prompts.texts)

            def tl():
                return model.to_tokens(texts, prepend_bos=prompts.prepend_bos, padding_side="left", truncate=False)

            times: dict = {"tl": [], "called": [], "ours": []}
            for _ in range(args.runs):  # alternating, so a slow spell of the machine hits all three
                for key, fn in (("tl", tl), ("called", lambda: the_tokenizers_call(ours)), ("ours", ours)):
                    gc.collect()
                    start = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - start)
            reference = tl()
            width = prompts.tokens.shape[1]
            same = torch.equal(the_tokenizers_call(ours).tokens, prompts.tokens) and all(
                torch.equal(reference[i, reference.shape[1] - n:], prompts.tokens[i, width - n:])
                for i, n in enumerate(prompts.lengths.tolist()))
            t_tl, slow, fast = (statistics.median(times[key]) for key in ("tl", "called", "ours"))
            print(f"| `zoo:{name}`{f', {few_shot}-shot' if few_shot else ''} | {len(prompts):,} | {t_tl:.3f} s | "
                  f"{slow:.3f} s | {fast:.3f} s | **{slow / fast:.1f}×** | {'yes' if same else 'NO'} |")
    print(f"\nMedian of {args.runs} runs each, one CPU thread, alternating in one process; speed-up = the "
          "tokenizer's call / arithinterp.")


if __name__ == "__main__":
    main()
