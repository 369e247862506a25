"""Reads and metrics on a model with a large vocabulary: nothing builds logits it does not need.

On Gemma 3 270M (vocabulary 262,144) the unembedding of one position is 1 MiB of float32 logits,
more than a layer's whole residual stream at that position 400 times over. This script measures

* ``time``: ``collect(resid_post)`` at the last layer against the layer before it, alternating in
  one process (medians of ``--runs``): a last-layer read must not run the unembedding;
* ``peak <what>``: in a fresh process per measurement, the resident set's largest increase over the
  loaded model during one call (sampled every 0.2 ms) and the process's ``ru_maxrss``: ``collect``
  at the last layer or the one before it, the report's probe reads (``resid_post`` at every layer and
  three positions on the model and on a random-init copy) and ``helix.patch_test``.

    python benchmarks/big_vocab.py [--model /work/gemma/gemma-3-270m-q4_k_m.gguf] [--prompts 900] [--runs 3]
                                   [--peaks before_last last probes patch_test]

Prompts: ``a + b`` over 10..39 × 10..39 in ``{a}+{b}=`` with a 3-shot prefix (``--few-shot``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from collect import PeakRSS  # noqa: E402

MIB = 2**20
PEAKS = ("before_last", "last", "probes", "patch_test")


def _setup(spec: str, n_prompts: int, few_shot: int):
    import arithinterp as ai
    from arithinterp.tasks import arithmetic

    torch.set_num_threads(1)
    model = ai.load_model(spec)
    prompts = arithmetic(model, a=range(10, 40), b=range(10, 40), template="{a}+{b}=", few_shot=few_shot)
    if n_prompts < len(prompts):  # a seeded sample over the whole grid (a helix fit needs many values of a)
        prompts = prompts[torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))[:n_prompts]]
    return model, prompts


def time_layers(spec: str, n_prompts: int, few_shot: int, runs: int) -> dict:
    """Seconds of ``collect`` at the last layer and the one before, alternating, in this process."""
    from arithinterp.activations import collect

    model, prompts = _setup(spec, n_prompts, few_shot)
    last = int(model.cfg.n_layers) - 1
    collect(model, prompts[:8], sites="resid_post", layers=[last], progress=False)  # warm-up
    seconds: dict[int, list[float]] = {last - 1: [], last: []}
    for _ in range(runs):
        for layer in (last - 1, last):
            start = time.perf_counter()
            collect(model, prompts, sites="resid_post", layers=[layer], progress=False)
            seconds[layer].append(time.perf_counter() - start)
    return dict(tokens=int(prompts.tokens.shape[1]), n=len(prompts), seconds={str(k): v for k, v in seconds.items()})


def peak(spec: str, n_prompts: int, few_shot: int, what: str) -> dict:
    """The peak of one call in this (fresh) process."""
    from arithinterp import helix
    from arithinterp.activations import collect
    from arithinterp.models import random_like

    model, prompts = _setup(spec, n_prompts, few_shot)
    last = int(model.cfg.n_layers) - 1
    collect(model, prompts[:8], sites="resid_post", layers=[last], progress=False)  # warm-up
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    def probe_reads() -> None:  # the report's probe reads, the random-init control built first as there
        control = random_like(model, 0)
        for each in (model, control):
            collect(each, prompts, sites="resid_post", positions=["a", "b", "final"], progress=False)

    call: Callable[[], object] = probe_reads
    if what in ("last", "before_last"):
        call = partial(collect, model, prompts, sites="resid_post", layers=[last if what == "last" else last - 1],
                       progress=False)
    elif what == "patch_test":
        layer = int(model.cfg.n_layers) // 2
        acts = collect(model, prompts, sites="resid_pre", layers=[layer], positions="a", progress=False)
        fit = helix.fit(acts, "a", periods=(2, 5, 10, 100), site="resid_pre", layer=layer, positions="a")
        call = partial(helix.patch_test, model, prompts.counterfactual(vary="a", seed=0), fit)
    with PeakRSS() as memory:
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return dict(seconds=seconds, increase=memory.increase, maxrss=maxrss, model=model_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="/work/gemma/gemma-3-270m-q4_k_m.gguf")
    parser.add_argument("--prompts", type=int, default=900)
    parser.add_argument("--patch-prompts", type=int, default=200)
    parser.add_argument("--few-shot", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=["time", "peak"], default=None)
    parser.add_argument("--peaks", nargs="+", choices=PEAKS, default=list(PEAKS),
                        help="the peak measurements to take, one fresh process each (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--in-process", action="store_true",
                        help="take every measurement in this process instead of a fresh one each (a quick check "
                             "that the script runs: the peaks then count what earlier measurements left)")
    args = parser.parse_args()
    if args.child:
        if args.child == "time":
            print(json.dumps(time_layers(args.model, args.prompts, args.few_shot, args.runs)))
        else:
            n = args.patch_prompts if args.child == "patch_test" else args.prompts
            print(json.dumps(peak(args.model, n, args.few_shot, args.child)))
        return

    def child(what: str) -> dict:
        if args.in_process:
            if what == "time":
                return time_layers(args.model, args.prompts, args.few_shot, args.runs)
            return peak(args.model, args.patch_prompts if what == "patch_test" else args.prompts, args.few_shot, what)
        command = [sys.executable, __file__, "--child", what, "--model", args.model, "--prompts", str(args.prompts),
                   "--patch-prompts", str(args.patch_prompts), "--few-shot", str(args.few_shot),
                   "--runs", str(args.runs)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        return json.loads(out.splitlines()[-1])

    if args.only in (None, "time"):
        timed = child("time")
        print(f"{args.model}: {timed['n']} prompts of {timed['tokens']} tokens, resid_post at the final position; "
              f"{args.runs} alternating runs in one process, one CPU thread")
        for layer, values in timed["seconds"].items():
            each = ", ".join(f"{v:.2f}" for v in values)
            print(f"  layer {layer}: median {statistics.median(values):.2f} s ({each})")
        layers = list(timed["seconds"])
        ratio = statistics.median(timed["seconds"][layers[1]]) / statistics.median(timed["seconds"][layers[0]])
        print(f"  last / before last: {ratio:.2f}")
    if args.only in (None, "peak"):
        for what in args.peaks:
            r = child(what)
            print(f"  {what}: {r['seconds']:.1f} s, peak increase {r['increase'] / MIB:,.0f} MiB over the loaded "
                  f"model ({r['model'] / MIB:,.0f} MiB of parameters), ru_maxrss {r['maxrss'] / MIB:,.0f} MiB")


if __name__ == "__main__":
    main()
