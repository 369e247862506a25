"""Where a model's transcoders are found: shipped with the package for the zoo, or made on this
machine and kept in the user's cache folder, one folder per model fingerprint.

``arithinterp train-transcoders MODEL`` writes to :func:`cache_folder` of the model (unless told
``--out``); :func:`find_transcoders` is what the report, the notebooks and
:func:`~arithinterp.features.attribution_graph` call to find them again: the shipped set of a zoo
model, else the cached set made on the same weights (by :func:`~arithinterp.checks.fingerprint`,
so a renamed or copied model finds its transcoders and a fine-tuned one does not). The cache lives
in ``platformdirs.user_cache_dir("arithinterp")`` (``~/.cache/arithinterp`` on Linux), or in the
folder the environment variable ``ARITHINTERP_CACHE`` names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from arithinterp.checks import check_model, fingerprint
from arithinterp.errors import ModelFileError, ModelMismatchError
from arithinterp.features.transcoder import Transcoders
from arithinterp.types import HookedModel, checked

CACHE_VARIABLE = "ARITHINTERP_CACHE"


def cache_root() -> Path:
    """The package's cache folder: ``$ARITHINTERP_CACHE``, else the platform's user cache folder.

    Returns:
        The folder (not created here).
    """
    named = os.environ.get(CACHE_VARIABLE, "").strip()
    if named:
        return Path(named).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("arithinterp"))


@checked
def cache_folder(model: HookedModel) -> Path:
    """The folder that holds the transcoders made on ``model``'s weights.

    Args:
        model: The hooked model.

    Returns:
        ``<cache root>/transcoders/<fingerprint>`` (not created here).
    """
    check_model(model, "cache_folder")
    return cache_root() / "transcoders" / fingerprint(model)


def _shipped(model: Any) -> Optional[Path]:
    from arithinterp.features.shipped import WEIGHTS_DIR, shipped_names

    spec = str(getattr(model, "arithinterp_spec", "") or "")
    name = spec.removeprefix("zoo:")
    return WEIGHTS_DIR / name if spec.startswith("zoo:") and name in shipped_names() else None


@checked
def find_transcoders(model: HookedModel) -> Optional[Transcoders]:
    """The transcoders of ``model``: the shipped set of a zoo model, else the set cached for its
    weights by ``arithinterp train-transcoders``; ``None`` when there is neither.

    Args:
        model: The hooked model.

    Returns:
        The transcoders, checked against the model, or ``None``.

    Raises:
        ModelFileError: A cached set that is damaged (the message names the folder to delete).
    """
    check_model(model, "find_transcoders")
    folder = _shipped(model) or cache_folder(model)
    if not (folder / "result.json").exists():
        return None
    transcoders = Transcoders.load(folder)
    try:
        transcoders.check_model(model)
    except ModelMismatchError as why:
        raise ModelFileError(f"the transcoders cached in {folder} do not fit this model ({why}); delete the "
                             "folder and train them again with `arithinterp train-transcoders MODEL`") from None
    return transcoders


@checked
def require_transcoders(model: HookedModel) -> Transcoders:
    """:func:`find_transcoders`, raising where there are none.

    Args:
        model: The hooked model.

    Returns:
        The transcoders.

    Raises:
        ModelFileError: No transcoders ship or are cached for this model; the message gives the
            command that makes them and where it writes them.
    """
    found = find_transcoders(model)
    if found is None:
        spec = getattr(model, "arithinterp_spec", None) or "MODEL"
        raise ModelFileError(f"no transcoders ship or are cached for this model; make them with "
                             f"`arithinterp train-transcoders {spec}` (written to {cache_folder(model)}), or "
                             "pass some (features.load_transcoders(folder))")
    return found


PLOTS_FOLDER = "operand_plots"


@checked
def find_operand_plots(model: HookedModel) -> Optional[Any]:
    """The operand plots saved beside the model's cached transcoders (:func:`~arithinterp.features.plan.train_planned`
    writes them), or ``None``.

    Args:
        model: The hooked model.

    Returns:
        The :class:`~arithinterp.features.operand_plots.OperandPlots`, or ``None``.
    """
    from arithinterp.features.operand_plots import OperandPlots

    check_model(model, "find_operand_plots")
    folder = (_shipped(model) or cache_folder(model)) / PLOTS_FOLDER
    return OperandPlots.load(folder) if (folder / "result.json").exists() else None
