"""Transcoders shipped for the zoo models: data files in ``features/weights/NAME/``, each with the
``card.json`` that says how it was made and what it measured on held-out prompts.

Any model's transcoders, a zoo model's included, are made by ``arithinterp train-transcoders MODEL``
(:mod:`arithinterp.features.plan`), which writes them to the user's cache; :func:`load_transcoders`
reads a saved folder, or a shipped set by zoo name.
"""

from __future__ import annotations

from pathlib import Path

from arithinterp.errors import ModelSpecError, accepted
from arithinterp.features.transcoder import Transcoders
from arithinterp.types import PathLike, checked

WEIGHTS_DIR = Path(__file__).parent / "weights"


def shipped_names() -> list[str]:
    """The zoo models transcoders ship for (the folders of ``features/weights`` that hold a saved set)."""
    return sorted(path.name for path in WEIGHTS_DIR.iterdir() if (path / "result.json").exists())


def shipped_path(spec: str) -> Path:
    """The folder of the transcoders shipped for zoo model ``spec``.

    Raises:
        ModelSpecError: No transcoders ship for it (the message names those that do, and the command
            that makes a set for any model).
    """
    name = spec.removeprefix("zoo:")
    if name not in shipped_names():
        names = accepted(["zoo:" + name for name in shipped_names()])
        raise ModelSpecError(f"no transcoders ship for {spec!r} (they ship for {names}); make them with "
                             f"`arithinterp train-transcoders {spec}`")
    return WEIGHTS_DIR / name


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
        ModelSpecError: No transcoders ship for that zoo model.
        ResultFileError: The folder does not hold transcoders, or is damaged.
    """
    if isinstance(path, str) and path.startswith("zoo:"):
        path = shipped_path(path)
    return Transcoders.load(Path(path), unsealed=unsealed)


