"""Executors: where the cells run — in this process, in a local process pool or as Ray tasks.

Each yields one outcome per job as it finishes; workers only compute, the driver writes.
"""

from __future__ import annotations

import os
from typing import Generator, Optional

from arithinterp.errors import ConfigError
from arithinterp.sweep.registry import ANALYSES
from arithinterp.sweep.worker import run_job


def run_local(jobs: list) -> Generator[dict, None, None]:
    for payload in jobs:
        yield run_job(payload)


def run_processes(jobs: list, workers: int) -> Generator[dict, None, None]:
    import concurrent.futures
    import multiprocessing

    # spawn, not fork: forking a process that already runs torch threads can deadlock
    context = multiprocessing.get_context("spawn")
    # no more processes than jobs: a huge --workers then starts only what is used (and fits a C int)
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=max(1, min(workers, len(jobs))), mp_context=context,
                                                  initializer=_exit_with_parent, initargs=(os.getpid(),))
    try:
        futures = {pool.submit(run_job, payload): payload[0].id for payload in jobs}
        for future in concurrent.futures.as_completed(futures):
            try:
                yield future.result()
            except Exception as error:  # the worker died (e.g. out of memory): this cell fails, the rest go on
                yield _lost(futures[future], error)
    finally:  # also when the driver stops early: drop the jobs not started instead of running them all
        pool.shutdown(wait=True, cancel_futures=True)


def _exit_with_parent(parent: int, interval: float = 0.5) -> None:
    """Run in each worker: exit as soon as the driver process is gone.

    A worker blocks on its job queue, whose pipe the other workers also hold open, so it would
    not notice a driver killed with SIGKILL and would live on holding its model's memory. A
    daemon thread watches the parent pid instead (portable; no signal set-up needed).
    """
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _lost(cell_id: str, error: BaseException) -> dict:
    return dict(id=cell_id, status="failed", seconds=None, frame=None, worker=None,
                error=f"the job was lost: {type(error).__name__}: {error}")


def check_picklable(names: set) -> None:
    import pickle

    for name in sorted(names):
        try:
            pickle.dumps(ANALYSES[name].fn)
        except Exception as error:
            raise ConfigError(
                f"executor: analysis {name!r} cannot be sent to worker processes ({error}); define its function "
                "at the top level of a module, or use executor 'local' or 'ray'"
            ) from error


def import_ray():
    try:
        import ray
    except ImportError as error:
        raise ConfigError("the 'ray' executor needs Ray: pip install 'arithinterp[ray]'") from error
    return ray


def run_ray(jobs: list, address: Optional[str], resources: dict) -> Generator[dict, None, None]:
    ray = import_ray()
    started = False
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        started = True
    try:
        env = {k: os.environ[k] for k in ("MKL_CBWR",) if k in os.environ}
        remote = ray.remote(run_job).options(num_cpus=resources["num_cpus"], num_gpus=resources["num_gpus"],
                                             max_retries=2,
                                          runtime_env=dict(env_vars=env))
        refs = {remote.remote(payload): payload[0].id for payload in jobs}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    yield ray.get(ref)
                except Exception as error:  # the task or its node died after Ray's retries
                    yield _lost(refs[ref], error)
    finally:
        if started:
            ray.shutdown()
