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


def main() -> None:
    import arithinterp as ai
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:add-100")
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = ai.load_model(args.model)
    prompts = arithmetic(model, "+", range(100), range(100), "{a}+{b}=")[: args.prompts]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    collect(model, prompts[:64], sites="resid_post", progress=False)  # warm-up

    times, increases, returned = [], [], 0
    for _ in range(args.runs):
        with PeakRSS() as memory:
            start = time.perf_counter()
            acts = collect(model, prompts, sites="resid_post", positions="final", batch_size=args.batch_size, progress=False)
            times.append(time.perf_counter() - start)
        returned = acts.nbytes()
        increases.append(memory.increase)
        del acts

    cache_times, cache_increases = [], []
    for _ in range(args.runs):
        with PeakRSS() as memory, torch.inference_mode():
            start = time.perf_counter()
            _, cache = model.run_with_cache(prompts.tokens, names_filter=lambda n: n.endswith("hook_resid_post"))
            kept = torch.stack([cache[f"blocks.{l}.hook_resid_post"][:, -1] for l in range(model.cfg.n_layers)], 1)
            cache_times.append(time.perf_counter() - start)
        cache_increases.append(memory.increase)
        del cache, kept

    mib = 2**20
    increase = statistics.median(increases)
    ratio = (model_bytes + increase) / (model_bytes + returned)
    print(f"model {args.model}: {len(prompts)} prompts, resid_post x {model.cfg.n_layers} layers, final position\n")
    print("| method | median time (s) | median peak increase (MiB) | returned (MiB) | model (MiB) | (model + peak) / (model + returned) |")
    print("|---|---|---|---|---|---|")
    print(f"| `collect` (batch {args.batch_size}) | {statistics.median(times):.3f} | {increase / mib:.2f} | "
          f"{returned / mib:.2f} | {model_bytes / mib:.2f} | {ratio:.2f} |")
    cache_ratio = (model_bytes + statistics.median(cache_increases)) / (model_bytes + returned)
    print(f"| `run_with_cache` (one batch, resid_post hooks only) | {statistics.median(cache_times):.3f} | "
          f"{statistics.median(cache_increases) / mib:.2f} | {returned / mib:.2f} | {model_bytes / mib:.2f} | {cache_ratio:.2f} |")


if __name__ == "__main__":
    main()
