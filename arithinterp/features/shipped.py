"""Transcoders shipped for the zoo models, and the seeded recipe that makes them.

``arithinterp train-transcoders zoo:add-100`` runs :func:`train_shipped`: the recipe below on the
first ``limit`` prompts of the model's task (a seeded sample), written to ``--out`` (default
``features/weights/NAME/``, which ships filled: it is replaced only with ``--overwrite``) as a saved
:class:`~arithinterp.features.Transcoders` with ``card.json``, the numbers measured on the held-out
prompts when it was made.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

from arithinterp.errors import ModelFileError, ModelSpecError, accepted
from arithinterp.features.transcoder import Transcoders
from arithinterp.outputs import check_target, writes
from arithinterp.types import PathLike, checked

WEIGHTS_DIR = Path(__file__).parent / "weights"


@dataclass(frozen=True)
class TranscoderRecipe:
    limit: int = 10000  # task prompts (every position of each is a training row)
    n_features: int = 96
    k: int = 16
    steps: int = 800
    batch_size: int = 2048
    lr: float = 2e-3
    held_out: float = 0.1
    seed: int = 0


# dictionary sizes fitted to what the tasks hold (add-100: ~18,000 distinct MLP inputs per layer):
# larger dictionaries leave features that fire on a handful of training rows and never on held-out ones
RECIPES: dict[str, TranscoderRecipe] = {
    "add-100": TranscoderRecipe(n_features=64, steps=400),
    "add-3digit": TranscoderRecipe(n_features=96, steps=800),
}


def _name(spec: str) -> str:
    name = spec.removeprefix("zoo:")
    if name not in RECIPES:
        raise ModelSpecError(f"no transcoder recipe for {spec!r}; transcoders ship for {accepted(RECIPES)}")
    return name


def shipped_path(spec: str) -> Path:
    """The folder of the transcoders shipped for zoo model ``spec``."""
    path = WEIGHTS_DIR / _name(spec)
    if not (path / "result.json").exists():
        raise ModelFileError(f"no transcoders are shipped for {spec} at {path}; make them with "
                             f"`arithinterp train-transcoders {spec}`")
    return path


@checked
def load_transcoders(path: PathLike, *, unsealed: bool = False) -> Transcoders:
    """Load transcoders saved with ``.save(path)``, or shipped ones by zoo name.

    Args:
        path: The folder ``.save`` wrote, or ``"zoo:NAME"`` (``"zoo:add-100"``).
        unsealed: Also load a folder without the seal (saved by an earlier version), with a warning
            (see :meth:`~arithinterp.results.Result.load`); save it again to seal it.

    Returns:
        The transcoders.

    Raises:
        ModelFileError: No transcoders are shipped for that zoo model.
        ResultFileError: The folder does not hold transcoders, or is damaged.
    """
    if isinstance(path, str) and path.startswith("zoo:"):
        path = shipped_path(path)
    return Transcoders.load(Path(path), unsealed=unsealed)



@writes
def train_shipped(spec: str, out: Optional[Union[str, Path]] = None, seed: Optional[int] = None,
                  steps: Optional[int] = None, progress: bool = True,
                  overwrite: bool = False) -> tuple[Transcoders, dict[str, Any]]:
    """Train a zoo model's transcoders with its recipe, save them with their card; returns both.

    ``out``: the folder to write (default: ``transcoders/NAME`` in the current directory: the
    package's shipped weights, which every later user reads, are replaced only when ``out`` names
    them). A folder that already holds files is refused before training unless ``overwrite=True``."""
    import time

    from arithinterp.features.training import train_transcoders
    from arithinterp.models import load_model
    from arithinterp.models.zoo import task_prompts

    name = _name(spec)
    recipe = RECIPES[name]
    target = check_target(Path(out) if out else Path("transcoders") / name, overwrite=overwrite, what="out",
                          folder=True)  # before training
    seed = recipe.seed if seed is None else seed
    steps = recipe.steps if steps is None else steps
    model = load_model(f"zoo:{name}")
    prompts = task_prompts(model, f"zoo:{name}", recipe.limit, seed)
    start = time.perf_counter()
    transcoders = train_transcoders(model, prompts, n_features=recipe.n_features, k=recipe.k, steps=steps,
                                    batch_size=recipe.batch_size, lr=recipe.lr, held_out=recipe.held_out, seed=seed,
                                    progress=progress)
    wall = round(time.perf_counter() - start, 1)
    import torch

    card = dict(model=f"zoo:{name}", recipe={**asdict(recipe), "seed": seed, "steps": steps},
                command=f"arithinterp train-transcoders zoo:{name}", wall_seconds=wall,
                torch_threads=torch.get_num_threads(), layers=transcoders.metrics["layers"],
                replacement=transcoders.metrics["replacement"])
    path = transcoders.save(target, overwrite=overwrite, extra_files={"card.json": json.dumps(card, indent=1)})
    return transcoders, dict(card, out=str(path))
