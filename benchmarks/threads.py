"""OpenMP's wait policy on a shared machine: a zoo-sized and a 270M-sized MLP block over the
machine's threads, with the runtime's default (spin a while, then sleep), threads that spin
while they wait (``ACTIVE``) and threads that sleep (``PASSIVE``, what ``import arithinterp``
sets unless told otherwise), on a quiet machine and beside CPU-bound processes (one per core).

    PYTHONPATH=. python benchmarks/threads.py [--repeats 5] [--quick]

Each measurement runs in a fresh process (the policy is read when torch loads); medians of
``--repeats`` timings are printed as a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
torch.manual_seed(0)
tokens, width, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
x = torch.randn(tokens, width)
w1, w2 = torch.randn(width, 4 * width) / width ** 0.5, torch.randn(4 * width, width) / width ** 0.5

def block():  # an MLP block's two matmuls and its nonlinearity, 50 times
    start = time.perf_counter()
    for _ in range(50):
        torch.nn.functional.gelu(x @ w1) @ w2
    return time.perf_counter() - start

block()
print(json.dumps([block() for _ in range(repeats)]))
"""

SHAPES = {"zoo (d 128, 64 tokens)": (64, 128), "270M (d 640, 272 tokens)": (272, 640)}


def _burn() -> None:  # a CPU-bound neighbour
    while True:
        pass


def measure(policy: str, tokens: int, width: int, repeats: int) -> float:
    """Median seconds of the block in a fresh process; ``policy`` "" leaves the runtime's default."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}  # every core
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", CHILD, str(tokens), str(width), str(repeats)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return statistics.median(json.loads(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the zoo shape only, 2 repeats (a smoke run)")
    args = parser.parse_args()
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    repeats = 2 if args.quick else args.repeats
    cores = os.cpu_count() or 1
    print(f"{cores} cores; median seconds of 50 MLP blocks over {repeats} timings, each setting in a fresh process")
    print("| shape | neighbours | default | ACTIVE (spin) | PASSIVE (sleep) | default / PASSIVE |")
    print("|---|---|---|---|---|---|")
    for neighbours in (0, cores):
        burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(neighbours)]
        for burner in burners:
            burner.start()
        try:
            for name, (tokens, width) in shapes.items():
                default, active, passive = (measure(p, tokens, width, repeats) for p in ("", "ACTIVE", "PASSIVE"))
                print(f"| {name} | {neighbours} | {default:.3f} | {active:.3f} | {passive:.3f} | "
                      f"{default / passive:.2f} |")
        finally:
            for burner in burners:
                burner.terminate()


if __name__ == "__main__":
    main()
