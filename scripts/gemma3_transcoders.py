"""Train Gemma 3 270M's transcoders with their recipe (arithinterp.features.recipes) in one command.

    HF_HUB_OFFLINE=1 python scripts/gemma3_transcoders.py --out gemma3-transcoders

Writes the saved Transcoders (one per layer, about 90 MB: not shipped in the package) and card.json,
the recipe with the wall time and what was measured on the held-out operand pairs: FVU per layer
(over every position, and after <bos>), L0, dead features, the replacement model's top-1 agreement
and KL against the model. Load them with ``arithinterp.features.load_transcoders(DIR)``.
"""

from __future__ import annotations

import argparse
import json

from arithinterp.features.recipes import train_recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the transcoders and card.json to")
    parser.add_argument("--model", default="pkg:gemma-3-270m", help="model spec with a recipe (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per layer (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: the recipe's)")
    parser.add_argument("--overwrite", action="store_true", help="replace what --out already holds")
    args = parser.parse_args()
    _, card = train_recipe(args.model, args.out, steps=args.steps, seed=args.seed, overwrite=args.overwrite)
    print(json.dumps({key: card[key] for key in ("out", "wall_seconds", "replacement")}, indent=1))
    for layer, row in enumerate(card["layers"]):
        print(f"layer {layer:2d}: " + ", ".join(f"{key} {value}" for key, value in row.items()))


if __name__ == "__main__":
    main()
