"""Time and peak memory of ``PromptSet.evaluate`` on a real-sized Llama-family model.

A random-weight Llama of SmolLM-135M's shape (30 layers, d_model 576, 9 heads / 3 key-value
heads, d_mlp 1536, vocabulary 49,152, tied embeddings) with a digit-split tokenizer (one token
per digit, like SmolLM, Llama 2, Gemma, Qwen), saved with ``save_pretrained`` and loaded with
``load_model(path)``; 400 two-digit addition prompts with a 5-example few-shot prefix.

* time: ``evaluate`` against one plain forward per answer token (``K`` × the time of one
  ``model(tokens)`` over every prompt, in the same batches);
* memory: peak resident set size increase during ``evaluate`` against one plain forward of one
  batch through the decoder (hidden states only): the ratio (model + evaluate's peak increase)
  / (model + one batch's increase). Each measurement runs in a fresh process; RSS is sampled
  every 0.2 ms.

    python benchmarks/evaluate.py [--prompts 400] [--shots 5] [--runs 1] [--layers 30 --d-model 576 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from collect import PeakRSS  # noqa: E402  (the same RSS sampler as the collect benchmark)


def digit_tokenizer(vocab_size: int):
    """One token per digit plus operators, padded with filler words to ``vocab_size`` entries."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<bos>", "<pad>", *"0123456789", "+", "-", "*", "/", "%", "="]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"\d|[^\d\s]"), behavior="isolated")]
    )
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<pad>", pad_token="<pad>")


def build(folder: Path, args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = digit_tokenizer(args.vocab)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_mlp,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's shape, SmolLM-135M's by default (what :func:`build` reads)."""
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--d-model", type=int, default=576)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--d-mlp", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)


def prompts_for(model, n: int, shots: int):
    import random

    from arithinterp.tasks import prompts_for_pairs

    rng = random.Random(0)
    pairs = [(rng.randrange(10, 100), rng.randrange(10, 100)) for _ in range(n)]
    return prompts_for_pairs(model, "+", [p[0] for p in pairs], [p[1] for p in pairs], "{a}+{b}=", few_shot=shots)


def measure(mode: str, folder: str, n: int, shots: int) -> dict:
    """One measurement in this fresh process."""
    import arithinterp as ai
    from arithinterp.engine.decode import _hf_parts, batch_size_for, decode_mode

    torch.set_num_threads(1)
    model = ai.load_model(folder)
    prompts = prompts_for(model, n, shots)
    prompts[:2].evaluate(model)  # warm-up: lazy imports, first kernels, the decode-path check
    length = int(prompts.lengths.max())
    k = prompts.answer_tokens.shape[1]
    batch = batch_size_for(model, length, n_read=1, n_new=k)
    batches = [chunk for group in prompts.length_groups() for chunk in group.split(batch)]
    with PeakRSS() as memory, torch.inference_mode():
        start = time.perf_counter()
        if mode == "evaluate":
            evaluation = prompts.evaluate(model)
        elif mode == "forward":  # the plain forward (full logits) over every prompt, once
            for idx in batches:
                model(prompts.unpadded(idx), return_type="logits")
        else:  # "one_batch": the decoder's hidden states for the largest batch, nothing else
            decoder = _hf_parts(model)[0]
            decoder(input_ids=prompts.unpadded(max(batches, key=len)), use_cache=False)
        seconds = time.perf_counter() - start
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = dict(seconds=seconds, increase=memory.increase, model=model_bytes, k=k, batch=batch, length=length,
               mode=decode_mode(model), load=os.getloadavg()[0])
    if mode == "evaluate":
        out["accuracy"] = evaluation.accuracy
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--runs", type=int, default=1)
    add_shape_arguments(parser)
    parser.add_argument("--child", choices=["evaluate", "forward", "one_batch"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--in-process", action="store_true",
                        help="take every measurement in this process instead of a fresh one each (a quick check "
                             "that the script runs: the peaks then count what earlier measurements left)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.folder, args.prompts, args.shots)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        build(folder, args)

        def runs(mode: str) -> list[dict]:
            if args.in_process:
                return [measure(mode, str(folder), args.prompts, args.shots) for _ in range(args.runs)]
            command = [sys.executable, __file__, "--child", mode, "--folder", str(folder),
                       "--prompts", str(args.prompts), "--shots", str(args.shots)]
            return [json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
                    for _ in range(args.runs)]

        results = {mode: runs(mode) for mode in ("evaluate", "forward", "one_batch")}
    seconds = {m: statistics.median(r["seconds"] for r in rs) for m, rs in results.items()}
    increase = {m: statistics.median(r["increase"] for r in rs) for m, rs in results.items()}
    first = results["evaluate"][0]
    mib, model_bytes, k = 2**20, first["model"], first["k"]
    reference = k * seconds["forward"]
    loads = [r["load"] for rs in results.values() for r in rs]
    print(f"random Llama, {args.layers} layers, d_model {args.d_model}, vocabulary {args.vocab}, digit-split; "
          f"{args.prompts} prompts, {args.shots}-shot prefix ({first['length']} tokens at most), {k} answer tokens; "
          f"decode path {first['mode']!r}, batch {first['batch']}; median of {args.runs} fresh process(es); "
          f"load average {min(loads):.1f}-{max(loads):.1f}\n")
    print("| measurement | median time (s) | median peak RSS increase (MiB) |")
    print("|---|---|---|")
    print(f"| `evaluate` | {seconds['evaluate']:.2f} | {increase['evaluate'] / mib:.1f} |")
    print(f"| one plain forward over every prompt | {seconds['forward']:.2f} | {increase['forward'] / mib:.1f} |")
    print(f"| one batch through the decoder (hidden states) | {seconds['one_batch']:.2f} | {increase['one_batch'] / mib:.1f} |")
    print(f"\nmodel {model_bytes / mib:.1f} MiB; accuracy {first['accuracy']:.3f}")
    print(f"time: evaluate / ({k} × one forward) = {seconds['evaluate']:.2f} / {reference:.2f} = "
          f"**{seconds['evaluate'] / reference:.2f}**")
    print(f"memory: (model + evaluate's peak increase) / (model + one batch) = "
          f"{(model_bytes + increase['evaluate']) / mib:.1f} / {(model_bytes + increase['one_batch']) / mib:.1f} = "
          f"**{(model_bytes + increase['evaluate']) / (model_bytes + increase['one_batch']):.2f}**")


if __name__ == "__main__":
    main()
