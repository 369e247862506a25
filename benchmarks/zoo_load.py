"""Time to load each zoo model after ``import arithinterp`` (median of repeated loads).

    python benchmarks/zoo_load.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    start = time.perf_counter()
    import arithinterp as ai
    from arithinterp.models.zoo import ZOO

    import_seconds = time.perf_counter() - start
    ai.load_model(f"zoo:{next(iter(ZOO))}")  # first load pays one-off lazy imports; reported separately
    print(f"import arithinterp: {import_seconds:.2f} s\n")
    print("| model | median load (s) | max load (s) | checkpoint size (MiB) |")
    print("|---|---|---|---|")
    total = 0
    for name, entry in ZOO.items():
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            ai.load_model(f"zoo:{name}")
            times.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in entry.directory.iterdir())
        total += size
        print(f"| `zoo:{name}` | {statistics.median(times):.3f} | {max(times):.3f} | {size / 2**20:.2f} |")
    print(f"\ntotal shipped checkpoint size: {total / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
