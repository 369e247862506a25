"""The sweep driver: :func:`run_sweep` runs every unfinished cell of a config, one driver per
results directory, and reports what it did as a :class:`SweepRun`."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

from arithinterp.errors import ConfigError, OutputError
from arithinterp.outputs import check_writable_dir
from arithinterp.results import NON_NEGATIVE, Result, build_meta
from arithinterp.sweep.config import EXECUTORS, SweepConfig, load_config, plan
from arithinterp.sweep.executors import check_picklable, import_ray, run_local, run_processes, run_ray
from arithinterp.sweep.registry import ANALYSES
from arithinterp.sweep.worker import check_cells
from arithinterp.sweep.storage import (
    MANIFEST,
    RESULTS,
    clean_temp_files,
    write_cell,
    write_manifest,
    cell_path,
    check_cell_file,
    load_results,
    read_manifest,
    versions,
)


@dataclass(frozen=True)
class SweepRun(Result):
    """What a sweep run did: one entry per cell and the totals.

    Attributes:
        out: The results directory.
        config_hash: :meth:`SweepConfig.digest` of the config.
        cells: One dict per cell: ``id``, ``analysis``, ``model``, ``task``, ``params``, ``status``
            (``"done"``, ``"failed"``, ``"pending"``), ``seconds``, ``rows``, ``error``, ``this_run``.
        executor: ``"local"``, ``"processes"`` or ``"ray"``.
        seconds: The run's wall time.
        meta: Versions and the config.
    """

    out: str
    config_hash: str
    cells: list
    executor: str
    seconds: float
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _legal = {"executor": EXECUTORS, "seconds": NON_NEGATIVE}

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in self.counts().items())
        return f"SweepRun(out={self.out!r}, executor={self.executor!r}, {counts}, seconds={self.seconds:.1f})"

    def counts(self) -> dict:
        """Cells by outcome.

        Returns:
            ``total``, ``done`` (this run), ``skipped`` (done earlier), ``failed`` and ``pending``.
        """
        ran = [c for c in self.cells if c["this_run"]]
        return dict(total=len(self.cells), done=sum(c["status"] == "done" for c in ran),
                    skipped=sum(not c["this_run"] and c["status"] == "done" for c in self.cells),
                    failed=sum(c["status"] == "failed" for c in ran),
                    pending=sum(c["status"] == "pending" for c in self.cells))

    def summary(self) -> dict:
        """JSON-able totals and one row per analysis (cells done / skipped / failed, time)."""
        rows = []
        for name in dict.fromkeys(c["analysis"] for c in self.cells):
            mine = [c for c in self.cells if c["analysis"] == name]
            rows.append(dict(analysis=name, cells=len(mine),
                             done=sum(c["this_run"] and c["status"] == "done" for c in mine),
                             skipped=sum(not c["this_run"] and c["status"] == "done" for c in mine),
                             failed=sum(c["status"] == "failed" for c in mine),
                             seconds=round(sum(c["seconds"] or 0 for c in mine if c["this_run"]), 2)))
        errors = [dict(cell=c["id"], analysis=c["analysis"], error=(c["error"] or "").splitlines()[0])
                  for c in self.cells if c["status"] == "failed"]
        redone = [dict(cell=c["id"], analysis=c["analysis"], reason=c["recomputed"])
                  for c in self.cells if c.get("recomputed")]
        return dict(out=self.out, config_hash=self.config_hash, executor=self.executor, **self.counts(),
                    seconds=round(self.seconds, 2), analyses=rows, **(dict(errors=errors) if errors else {}),
                    **(dict(recomputed=redone) if redone else {}))

    def to_frame(self):
        """One row per cell: analysis, model, task, parameters (as JSON), status, seconds, rows."""
        import pandas as pd

        return pd.DataFrame([dict(cell=c["id"], analysis=c["analysis"], model=c["model"], task=c["task"],
                                  params=json.dumps(c["params"], sort_keys=True), status=c["status"],
                                  this_run=c["this_run"], seconds=c["seconds"], rows=c["rows"]) for c in self.cells])

    def plot(self, **kwargs):
        """Seconds per cell, coloured by status (see ``viz.sweep.plot_sweep_cells``)."""
        from arithinterp.viz.sweep import plot_sweep_cells

        return plot_sweep_cells(self.to_frame(), **kwargs)

    def results(self, analysis: Optional[str] = None):
        """The sweep's results (:func:`load_results`).

        Args:
            analysis: One analysis's name, or ``None`` for all.

        Returns:
            One DataFrame for an analysis, else ``{analysis: DataFrame}``.
        """
        return load_results(self.out, analysis)


@contextlib.contextmanager
def _driver_lock(out: Path) -> Iterator[None]:
    """One driver per results directory: ``OUT/.lock`` names the host and process holding it.

    A lock left by a killed driver on this host (its process is gone) is taken over; one held by
    a live process, or by another host, is an error (delete the file if that driver is gone).
    """
    path = out / ".lock"
    me = dict(host=platform.node(), pid=os.getpid())
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text() or "{}")
            except (OSError, json.JSONDecodeError):
                holder = {}
            if holder.get("host") == me["host"] and not _alive(holder.get("pid")):
                path.unlink(missing_ok=True)
                continue
            raise ConfigError(f"out: {out} is in use by another sweep ({holder or 'unknown holder'}); wait for it, "
                              f"or delete {path} if that run is gone") from None
        # the lock is the one file not written through outputs.write_file: its point is O_EXCL creation
        # (two drivers may race for it), which a temp-file-and-rename write cannot give
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(me))
        break
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _save_manifest(out: Path, manifest: dict) -> None:
    try:
        write_manifest(out, manifest)
    except OSError as error:
        raise OutputError(f"cannot write {out / 'manifest.json'}: {error.strerror or error}; make room (or fix the "
                          "folder) and rerun the same command: the finished cells' files are kept and the sweep "
                          "resumes") from None


def check_unfinished_cells(cfg: SweepConfig, cells: list) -> list:
    """Check the cells a run of ``cfg`` would compute (those without a results file yet) with
    :func:`~arithinterp.sweep.worker.check_cells`, writing nothing.

    The local executor checks on the device its cells run on and keeps the model its first cells
    need loaded; the others check on the CPU (the driver may have no GPU) and free the models.

    Args:
        cfg: The validated config.
        cells: Its cells (:func:`plan`).

    Returns:
        The cells to compute.

    Raises:
        ConfigError: A cell whose parameters its model or prompts cannot take, named with its
            analysis and parameters, the parameter, its value and what is accepted.
    """
    out = cfg.out_dir if cfg.out is not None else None
    todo = [c for c in cells if out is None or not cell_path(out, c).is_file()]
    local = cfg.executor == "local"
    check_cells(todo, cfg.base, cfg.device if local else "cpu", keep_loaded=local)
    return todo


def run_sweep(
    config: Union[str, Path, Mapping, SweepConfig],
    *,
    out: Union[str, Path, None] = None,
    executor: Optional[str] = None,
    workers: Optional[int] = None,
    address: Optional[str] = None,
    num_cpus: Optional[float] = None,
    num_gpus: Optional[float] = None,
    device: Optional[str] = None,
    progress: bool = True,
) -> SweepRun:
    """Run every unfinished cell of a sweep and write its results under ``out``.

    The config is validated before any job runs, and so is every cell to run: its parameters
    against its model and prompts (:func:`check_unfinished_cells`); a bad one refuses the whole
    run before anything is computed or written. Cells whose Parquet file exists are skipped;
    failed cells are recorded in the manifest and retried by the next run. Keyword arguments
    override the config (``executor``: ``"local"``, ``"processes"`` or ``"ray"``; ``address``:
    a Ray cluster such as ``"ray://head:10001"``; ``num_cpus`` / ``num_gpus``: per Ray job).
    One driver may use a results directory at a time (``OUT/.lock``).

    Args:
        config: A config file's path, a dict or a ``SweepConfig``.
        out: The results directory (default: the config's ``out``).
        executor: ``"local"``, ``"processes"`` or ``"ray"``.
        workers: Processes of the ``"processes"`` executor.
        address: A Ray cluster's address (default: start a local one).
        num_cpus: CPUs each Ray job requests.
        num_gpus: GPUs each Ray job requests.
        device: Where models run (``"cpu"``, ``"cuda"``).
        progress: Show a progress bar.

    Returns:
        What the run did, per cell.

    Raises:
        ConfigError: An invalid config or cell, a missing extra (pyarrow, ray), an analysis that cannot
            be pickled for ``"processes"``, or a results directory locked by another driver.
    """
    cfg = load_config(config, out=None if out is None else str(Path(out).expanduser().resolve()), executor=executor,
                      workers=workers, device=device, num_cpus=num_cpus, num_gpus=num_gpus, address=address)
    # MKL's float results can depend on buffer alignment, i.e. on what a process did before; its
    # conditional numerical reproducibility makes a cell's table bit-identical in any process, so a
    # resumed or distributed sweep matches an uninterrupted local one. Read when MKL first runs.
    os.environ.setdefault("MKL_CBWR", "AUTO")
    try:
        import pyarrow  # noqa: F401  (pandas writes Parquet through it)
    except ImportError as error:
        raise ConfigError("sweeps write Parquet tables, which needs pyarrow: pip install pyarrow") from error
    if cfg.executor == "ray":
        import_ray()  # a missing extra fails before anything is written
    if cfg.executor == "processes":
        check_picklable({a["name"] for a in cfg.analyses})
    cells = plan(cfg)
    out_dir = cfg.out_dir  # a missing 'out' is refused before any model loads
    check_unfinished_cells(cfg, cells)  # before anything is written: a refused run leaves 'out' as it was
    if out_dir.is_dir() and any(out_dir.iterdir()) and not any(
            (out_dir / name).exists() for name in (MANIFEST, RESULTS, ".lock")):
        raise ConfigError(f"out: {out_dir} holds files but no sweep's results ({MANIFEST}, {RESULTS}/); a sweep "
                          "writes into an empty folder or resumes its own: give another folder")
    out_dir = check_writable_dir(out_dir, "out")
    with _driver_lock(out_dir):
        return _run_cells(cfg, cells, out_dir, progress)


def _run_cells(cfg: SweepConfig, cells: list, out_dir: Path, progress: bool) -> SweepRun:
    from arithinterp.progress import progress_bar

    (out_dir / RESULTS).mkdir(exist_ok=True)
    clean_temp_files(out_dir)
    previous_manifest = {}
    with contextlib.suppress(ConfigError, json.JSONDecodeError):
        previous_manifest = read_manifest(out_dir)
    previous = previous_manifest.get("cells", {})
    entries, damaged = {}, []
    for cell in cells:
        path = cell_path(out_dir, cell)
        old = previous.get(cell.id, {})
        done, rows, digest, recomputed = path.is_file(), None, None, None
        if done:  # a file that fails its check (cut short, damaged, foreign) is not a finished cell
            problem, rows, digest = check_cell_file(path, old)
            if problem:
                path.unlink()
                done, recomputed = False, f"{path.relative_to(out_dir)}: {problem}"
                damaged.append(recomputed)
        entries[cell.id] = dict(
            analysis=cell.analysis, model=cell.model, task=cell.task["name"], params=cell.params,
            path=str(path.relative_to(out_dir)),
            status="done" if done else ("failed" if old.get("status") == "failed" else "pending"),
            seconds=old.get("seconds") if done else None, rows=rows if done else None, sha256=digest if done else None,
            error=None if done else old.get("error"), worker=old.get("worker") if done else None, this_run=False,
            **(dict(recomputed=recomputed) if recomputed else {}),
        )
    if damaged:
        warnings.warn(f"{len(damaged)} finished cell file(s) failed their check and are recomputed: "
                      + "; ".join(damaged[:3]) + ("; ..." if len(damaged) > 3 else ""), stacklevel=3)
    manifest = dict(config_hash=cfg.digest(), versions=versions(), executor=cfg.executor,
                    created=previous_manifest.get("created", time.time()), updated=time.time(),
                    config=dict(models=cfg.models, tasks=cfg.tasks, analyses=cfg.analyses), cells=entries)
    _save_manifest(out_dir, manifest)
    todo = [c for c in cells if entries[c.id]["status"] != "done"]
    # torch threads per job; at most the CPUs here (a num_cpus of 1e300 is a Ray request, not a thread count)
    threads = max(1, min(int(cfg.resources["num_cpus"]), os.cpu_count() or 1)) if cfg.executor != "local" else 0
    jobs = [(c, ANALYSES[c.analysis].fn, cfg.base, cfg.device, threads, ANALYSES[c.analysis].whole_sample)
            for c in todo]
    by_id = {c.id: c for c in todo}
    start = time.perf_counter()
    if jobs:
        runner = {"local": lambda: run_local(jobs), "processes": lambda: run_processes(jobs, cfg.workers),
                  "ray": lambda: run_ray(jobs, cfg.ray.get("address"), cfg.resources)}[cfg.executor]
        last_write = time.monotonic()
        bar = progress_bar(total=len(jobs), desc=f"sweep ({cfg.executor})", disable=not progress, unit="cell")
        stream = runner()
        try:
            for outcome in stream:
                cell = by_id[outcome["id"]]
                entry = entries[cell.id]
                if outcome["status"] == "done":
                    try:
                        entry["rows"], entry["sha256"] = write_cell(out_dir, cell, outcome["frame"])
                    except OSError as exc:  # a full disk, a lost mount: stop, keep what is finished
                        raise OutputError(
                            f"cannot write the results of cell {cell.id} ({cell.analysis}, model {cell.model}, task "
                            f"{cell.task['name']}) to {cell_path(out_dir, cell)}: {exc.strerror or exc}; "
                            "make room (or fix "
                            "the folder) and rerun the same command: finished cells are kept and the sweep resumes "
                            "from this cell"
                        ) from None
                    except Exception as exc:  # e.g. a table Arrow cannot store: the cell fails, the sweep goes on
                        outcome.update(status="failed",
                                       error=f"cannot write the results table: {type(exc).__name__}: {exc}")
                entry.update(status=outcome["status"], seconds=outcome["seconds"], error=outcome["error"],
                             worker=outcome["worker"], this_run=True)
                bar.update(1)
                bar.set_postfix_str(f"{cell.analysis} {outcome['status']}")
                if time.monotonic() - last_write > 1.0:  # Parquet files are the truth; the manifest may lag
                    _save_manifest(out_dir, manifest)
                    last_write = time.monotonic()
        except BaseException:
            bar.close()
            stream.close()  # stop the executor's pending jobs now, not when the traceback is freed
            with contextlib.suppress(OutputError):  # the first error says the most
                _save_manifest(out_dir, manifest)
            raise
        bar.close()
        _save_manifest(out_dir, manifest)
    run = SweepRun(out=str(out_dir), config_hash=cfg.digest(),
                   cells=[dict(id=c.id, **{k: v for k, v in entries[c.id].items() if k != "path"}) for c in cells],
                   executor=cfg.executor, seconds=time.perf_counter() - start,
                   meta=build_meta(versions=versions()))
    return run
