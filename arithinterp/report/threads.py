"""How many threads the report's torch work runs on: the CPUs this process may use (its CPU
affinity and its cgroup's CPU quota), less those that other processes keep busy.

A thread pool wider than the CPUs free to it is slower than a narrow one, not just no faster:
torch's OpenMP threads meet at a barrier after every operation, and a thread whose CPU another
process holds makes the others wait for it (a layer of four probe fits on Gemma 3 270M took 4 s
on one thread and 36-106 s on two at a load of 4 on two cores). So each part of the report
counts the free CPUs just before it starts (:func:`free_cpus`, over a short window of
``/proc/stat``) and runs on that many threads (:func:`choose_threads`).

The thread count changes how fast the report runs, never what it finds: the report's numbers
must not depend on it. Matrix products are where they would — a BLAS splits a product's sums
differently over two threads than over one — so the package asks Intel MKL for strict
conditional numerical reproducibility (``MKL_CBWR=AUTO,STRICT``, set in ``arithinterp/__init__``
before the first product: MKL reads it once), under which its products give the same bits on any
number of threads. :func:`products_thread_invariant` checks that it took (it cannot once a
product has run, or with another BLAS); where it did not, the report keeps one thread count for
the whole run (:func:`usable_cpus`) and says so.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Optional

# The share of a CPU that must be free before the report adds a thread for it: a CPU that another
# process holds half the time would still stall every barrier half the time.
FREE_SHARE = 0.75
WINDOW = 0.2  # seconds over which the CPUs' idle time is read


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup"), own: Optional[str] = None) -> Optional[float]:
    """The CPUs this process's cgroup may use by its quota, or ``None`` when it has none.

    Reads cgroup v2's ``cpu.max`` (``"QUOTA PERIOD"``, or ``"max PERIOD"`` for no quota) in the
    process's own cgroup and each one above it, else cgroup v1's ``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us``; the smallest quota found counts.

    Args:
        root: Where the cgroup file system is mounted.
        own: The process's cgroup path (default: read from ``/proc/self/cgroup``).

    Returns:
        The quota in CPUs (``1.5`` for 150 ms per 100 ms), or ``None``.
    """
    if own is None:
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            lines = []
        own = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), "/")
    quotas = []
    here = (root / own.lstrip("/")).resolve() if own else root
    for folder in (here, *here.parents):
        if folder != root and root not in folder.parents:
            break
        quotas.append(_v2_quota(folder / "cpu.max"))
    quotas.append(_v1_quota(root / "cpu"))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _v2_quota(path: Path) -> Optional[float]:
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: Path) -> Optional[float]:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity), by number."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may use at once: its affinity, within its cgroup's quota (a
    quota of 1.5 CPUs gives one: a second thread would wait half of each period).

    Returns:
        At least 1.
    """
    count = len(allowed_cpus())
    quota = cgroup_cpus()
    if quota is not None:
        count = min(count, math.floor(quota))
    return max(1, count)


def _busy_ticks(cpus: list[int]) -> Optional[tuple[int, int]]:
    """``(busy, total)`` clock ticks of ``cpus`` since boot, from ``/proc/stat``; ``None`` where unreadable."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{i}" for i in cpus}
    busy = total = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            idle = ticks[3] + ticks[4]
            busy += sum(ticks) - idle
            total += sum(ticks)
    return (busy, total) if total else None


def free_cpus(window: float = WINDOW) -> Optional[float]:
    """How many of this process's CPUs other processes leave idle, measured over ``window`` seconds
    (this process's own CPU time in the window is not counted as busy).

    Args:
        window: Seconds to measure over.

    Returns:
        Free CPUs (a float, ``0`` to the allowed CPUs), or ``None`` where ``/proc/stat`` cannot be read.
    """
    cpus = allowed_cpus()
    before, own_before = _busy_ticks(cpus), time.process_time()
    time.sleep(window)
    after, own_after = _busy_ticks(cpus), time.process_time()
    if before is None or after is None or after[1] <= before[1]:
        return None
    busy, total = after[0] - before[0], after[1] - before[1]
    seconds_per_tick = window * len(cpus) / total  # total ticks of every CPU over the window
    others = max(busy * seconds_per_tick - (own_after - own_before), 0.0) / window  # CPUs busy with others
    return max(len(cpus) - others, 0.0)


def choose_threads(free: Optional[float] = None) -> int:
    """Threads for the next part of the report: the usable CPUs (:func:`usable_cpus`) that are at
    least :data:`FREE_SHARE` free (``free``, default measured now by :func:`free_cpus`), at least one.

    Args:
        free: Free CPUs, when already measured.

    Returns:
        The thread count.
    """
    usable = usable_cpus()
    if free is None:
        free = free_cpus()
    if free is None:
        return usable
    return max(1, min(usable, math.floor(free + 1 - FREE_SHARE)))


def products_thread_invariant() -> bool:
    """Whether a matrix product gives the same bits on one thread as on all usable ones (see the
    module's docstring): the shapes are a few prompts' rows times a layer's weights, where
    MKL's default splits differ by thread count.

    Returns:
        ``True`` when they agree, or when only one CPU is usable.
    """
    import torch

    usable = usable_cpus()
    if usable < 2:
        return True
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(640, 2048, generator=generator)
    rows = [torch.randn(n, 640, generator=generator) for n in (1, 3, 7, 33)]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, usable):
            torch.set_num_threads(threads)
            results.append([r @ weights for r in rows])
    finally:
        torch.set_num_threads(before)
    return all(torch.equal(a, b) for a, b in zip(*results))
