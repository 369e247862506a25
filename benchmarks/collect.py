"""Peak memory and time of ``collect`` versus keeping a full ``run_with_cache``.

2,000 prompts, ``resid_post`` at every layer, final position. Memory is the process's resident
set size sampled every 0.2 ms by a background thread; the baseline is taken after the model is
loaded and a warm-up batch has run, so the allocator's pools are already there. The acceptance
ratio is (model + peak increase) / (model + returned tensors).

    python benchmarks/collect.py [--model zoo:add-100] [--prompts 2000] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Context manager recording the peak resident set size while it is open."""

    def __enter__(self):
        self.peak = self.start = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def increase(self) -> int:
        return self.peak - self.start


def measure(method: str, model_spec: str, n_prompts: int, batch_size: int) -> dict:
    """One measurement in this (fresh) process: time, peak RSS increase, returned bytes."""
    import arithinterp as ai
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    torch.set_num_threads(1)
    model = ai.load_model(model_spec)
    prompts = arithmetic(model, "+", range(100), range(100), "{a}+{b}=")[:n_prompts]
    collect(model, prompts[:8], sites="resid_post", progress=False)  # warm-up: lazy imports, first kernels
    hooks = [f"blocks.{layer}.hook_resid_post" for layer in range(model.cfg.n_layers)]
    with PeakRSS() as memory:
        start = time.perf_counter()
        if method == "collect":
            acts = collect(model, prompts, sites="resid_post", positions="final", batch_size=batch_size or None,
                           progress=False)
            returned = acts.nbytes()
        else:
            with torch.inference_mode():
                _, cache = model.run_with_cache(prompts.tokens, names_filter=lambda n: n in hooks)
                kept = torch.stack([cache[h][:, -1] for h in hooks], 1)
            returned = kept.numel() * kept.element_size()
        seconds = time.perf_counter() - start
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(seconds=seconds, increase=memory.increase, returned=returned, model=model_bytes)


def main() -> None:
    import json
    import subprocess
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:add-100")
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=0, help="0 = collect's automatic choice")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", choices=["collect", "run_with_cache"], help=argparse.SUPPRESS)
    parser.add_argument("--in-process", action="store_true",
                        help="take every measurement in this process instead of a fresh one each (a quick check "
                             "that the script runs: the peaks then count what earlier measurements left)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.model, args.prompts, args.batch_size)))
        return

    def runs(method: str) -> list[dict]:
        if args.in_process:
            return [measure(method, args.model, args.prompts, args.batch_size) for _ in range(args.runs)]
        # a fresh process per run, so the allocator's earlier growth cannot hide this run's peak
        command = [sys.executable, __file__, "--child", method, "--model", args.model,
                   "--prompts", str(args.prompts), "--batch-size", str(args.batch_size)]
        return [json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
                for _ in range(args.runs)]

    mib = 2**20
    print(f"model {args.model}: {args.prompts} prompts, resid_post at every layer, final position; "
          f"median of {args.runs} fresh processes\n")
    print("| method | median time (s) | median peak RSS increase (MiB) | returned (MiB) | model (MiB) | "
          "(model + peak increase) / (model + returned) |")
    print("|---|---|---|---|---|---|")
    for method, label in (("collect", f"`collect` (batch {args.batch_size or 'auto'})"),
                          ("run_with_cache", "`run_with_cache`, one batch, resid_post hooks only")):
        results = runs(method)
        seconds = statistics.median(r["seconds"] for r in results)
        increase = statistics.median(r["increase"] for r in results)
        returned, model_bytes = results[0]["returned"], results[0]["model"]
        ratio = (model_bytes + increase) / (model_bytes + returned)
        print(f"| {label} | {seconds:.3f} | {increase / mib:.2f} | {returned / mib:.2f} | {model_bytes / mib:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
