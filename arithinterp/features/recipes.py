"""Transcoder recipes for pretrained models: the prompts, the settings, and one function that runs them.

A zoo model's transcoders ship with the package (:mod:`arithinterp.features.shipped`); a pretrained
model's are made on the user's machine from its recipe here, by
``python scripts/gemma3_transcoders.py --out DIR`` (:func:`train_recipe`), and written with a
``card.json`` holding the numbers measured on the held-out prompts.

Gemma 3 270M (``pkg:gemma-3-270m``): every position of the 3-shot ``{a}+{b}=`` prompts with operands
10-39 (900 prompts; a seeded 20% held out by operand pair), each distinct MLP input once (the shared
few-shot prefix would otherwise be four fifths of the rows). What made the replacement model agree
with the model, measured in ``docs/features.md``: each layer trained in sequence on the inputs of
the model whose earlier MLPs are already replaced (``sequential``), and the skip fitted by ridge
regression and kept there. Trained on the real model's inputs, each transcoder meets inputs shifted
by the earlier ones' errors; the plain least-squares skip fits the few thousand distinct inputs of
this task with huge gains along directions they barely span, so a small shift goes wrong by more
than the output's own size (layer 1's, after layer 0 was replaced: 160% relative error with the
plain skip, 14% with the ridge one). Per-layer FVU ≤ 0.03 gave a replacement model that agreed with
the model on 4% of held-out answer positions; trained in sequence, on 63%.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from arithinterp.errors import ModelSpecError, accepted
from arithinterp.features.transcoder import Transcoders
from arithinterp.outputs import check_target, writes
from arithinterp.types import PathLike, PositiveInt, Seed, checked


@dataclass(frozen=True)
class PromptRecipe:
    """Transcoders trained on every position of an arithmetic task's prompts (``a`` and ``b`` each in
    ``range(*operands)``), with :func:`~arithinterp.features.train_transcoders`'s settings."""

    template: str = "{a}+{b}="
    operands: tuple = (10, 40)
    few_shot: int = 3
    n_features: int = 512
    k: int = 32
    steps: int = 200
    batch_size: int = 1024
    lr: float = 3e-3
    skip_ridge: float = 1e-4  # × the inputs' mean variance, added to each direction's
    train_skip: bool = False
    distinct: bool = True
    sequential: bool = True  # each layer on the inputs of the model with the earlier layers replaced
    held_out: float = 0.2
    seed: int = 0


RECIPES: dict[str, PromptRecipe] = {
    "pkg:gemma-3-270m": PromptRecipe(),
}


def recipe_prompts(model: Any, recipe: PromptRecipe) -> Any:
    """The recipe's prompt set on ``model``: every ``(a, b)`` of the operand grid, few-shot prefixed."""
    from arithinterp.tasks import arithmetic

    values = range(*recipe.operands)
    return arithmetic(model, a=values, b=values, template=recipe.template, few_shot=recipe.few_shot,
                      seed=recipe.seed)


@writes
@checked
def train_recipe(spec: str, out: PathLike, *, model: Any = None, steps: Optional[PositiveInt] = None,
                 seed: Optional[Seed] = None, overwrite: bool = False,
                 progress: bool = True) -> tuple[Transcoders, dict[str, Any]]:
    """Train ``spec``'s transcoders with its recipe (:data:`RECIPES`), save them in ``out`` with a
    ``card.json`` (the recipe, the wall time, the held-out numbers); returns both.

    ``model``: the loaded model, to skip loading it again (it must be ``spec``'s). ``steps`` and
    ``seed`` replace the recipe's. A folder ``out`` that already holds files is refused before any
    work unless ``overwrite``.
    """
    import torch

    from arithinterp.features.training import train_transcoders
    from arithinterp.models import load_model

    if spec not in RECIPES:
        raise ModelSpecError(f"no transcoder recipe for {spec!r}; recipes exist for {accepted(RECIPES)}")
    recipe = RECIPES[spec]
    target = check_target(out, overwrite=overwrite, what="out", folder=True)
    seed = recipe.seed if seed is None else seed
    steps = recipe.steps if steps is None else steps
    model = load_model(spec) if model is None else model
    prompts = recipe_prompts(model, recipe)
    start = time.perf_counter()
    transcoders = train_transcoders(model, prompts, n_features=recipe.n_features, k=recipe.k, steps=steps,
                                    batch_size=recipe.batch_size, lr=recipe.lr, held_out=recipe.held_out, seed=seed,
                                    skip_ridge=recipe.skip_ridge, train_skip=recipe.train_skip,
                                    distinct=recipe.distinct, sequential=recipe.sequential, progress=progress)
    wall = round(time.perf_counter() - start, 1)
    card = dict(model=spec, recipe={**asdict(recipe), "seed": seed, "steps": steps},
                command=f"python scripts/gemma3_transcoders.py --out {target}", wall_seconds=wall,
                torch_threads=torch.get_num_threads(), layers=transcoders.metrics["layers"],
                replacement=transcoders.metrics["replacement"])
    path = transcoders.save(target, overwrite=overwrite, extra_files={"card.json": json.dumps(card, indent=1)})
    return transcoders, dict(card, out=str(path))
