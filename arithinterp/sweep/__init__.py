"""Config-driven, resumable sweeps: models × tasks × analyses × parameters.

A sweep is declared in a TOML or YAML file (or a dict) and expands into *cells*: one model, one
task, one analysis and one value of each of its parameters. Each cell is one job; its tidy table
is written atomically to ``OUT/results/<analysis>/<cell-id>.parquet`` where the cell id is a
stable hash of the cell's full spec, so

* re-running a config skips the cells already on disk, and a run killed at any moment resumes
  to the same tables an uninterrupted run writes (every random choice is seeded from the spec);
* ``OUT/manifest.json`` records the config hash, package versions and each cell's status and
  timing; :func:`load_results` concatenates the cells into one tidy table per analysis.

Jobs run in-process (``executor="local"``), in a local process pool (``"processes"``) or as Ray
tasks with per-job CPU/GPU requests on an existing cluster or a local one (``"ray"``). Workers only
compute; the driver writes every file, so the results directory needs to exist on the driver only.

Analyses come from a registry users extend with :func:`register_analysis`; each takes
``(model, prompts, **params)`` and returns a pandas DataFrame. See ``docs/sweep.md``.

Submodules (their public names are all importable from ``arithinterp.sweep`` itself):

* ``registry`` — :class:`Param`, :class:`Analysis`, :func:`register_analysis`, :func:`checking`, the
  built-in analyses and their checks, :func:`list_analyses` (every analysis's parameters).
* ``config`` — :class:`SweepConfig`, :func:`read_config_file`, :func:`load_config`; :class:`Cell`
  and :func:`plan`, the cells a config expands into.
* ``worker`` — :func:`run_cell`: one cell in whichever process the executor chose
  (:func:`build_prompts`, model cache, seeding); ``check_cells``: every cell's parameters against
  its model and prompts, before the first cell runs.
* ``storage`` — the results directory: :func:`cell_path`, atomic Parquet writes, :func:`tidy`,
  the manifest (:func:`read_manifest`, :func:`versions`), :func:`load_results`.
* ``executors`` — local, process-pool and Ray executors.
* ``runner`` — the driver: :func:`run_sweep`, its lock on the results directory, :class:`SweepRun`.
* ``plots`` — :func:`figures` and :func:`plot_sweep`.
* ``cli`` — the ``sweep`` subcommand (:func:`add_cli`, :func:`run_cli`) and :func:`main`
  (``python -m arithinterp.sweep``).
"""

from arithinterp.sweep.cli import add_cli, main, run_cli
from arithinterp.sweep.config import (
    DEVICES,
    EXECUTORS,
    Cell,
    SweepConfig,
    load_config,
    plan,
    read_config_file,
)
from arithinterp.sweep.plots import figures, plot_sweep
from arithinterp.sweep.registry import (
    ANALYSES,
    Analysis,
    Param,
    ablation_analysis,
    accuracy_analysis,
    checking,
    list_analyses,
    patching_analysis,
    probes_analysis,
    register_analysis,
)
from arithinterp.sweep.runner import SweepRun, run_sweep
from arithinterp.sweep.storage import (
    MANIFEST,
    RESULTS,
    STATUSES,
    cell_path,
    load_results,
    read_manifest,
    tidy,
    versions,
)
from arithinterp.sweep.worker import build_prompts, run_cell

__all__ = [
    "run_sweep",
    "load_results",
    "load_config",
    "read_config_file",
    "plan",
    "register_analysis",
    "checking",
    "list_analyses",
    "run_cell",
    "build_prompts",
    "cell_path",
    "tidy",
    "read_manifest",
    "versions",
    "figures",
    "plot_sweep",
    "add_cli",
    "run_cli",
    "main",
    "SweepConfig",
    "SweepRun",
    "Cell",
    "Param",
    "Analysis",
    "ANALYSES",
    "accuracy_analysis",
    "patching_analysis",
    "ablation_analysis",
    "probes_analysis",
    "EXECUTORS",
    "DEVICES",
    "STATUSES",
    "MANIFEST",
    "RESULTS",
]
