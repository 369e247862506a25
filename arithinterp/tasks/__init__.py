"""Arithmetic prompts: :func:`arithmetic` → :class:`PromptSet` → :class:`PromptPairs`.

A ``PromptSet`` holds tokenized prompts with their operands, true answers, answer token ids and
the token positions of each operand and of the final prompt token. Positions come from the
tokenizer's character offsets, never from guessing, so they are right for word-level number
tokenizers, digit-splitting tokenizers and BPE tokenizers alike.

Prompts of different token lengths are left-padded; every forward runs one length group at a
time, so padding never reaches the model.

The package, one concept per module: :mod:`~arithinterp.tasks.operators` (operators, answers,
operand values), :mod:`~arithinterp.tasks.templates` (how prompts and answers are written),
:mod:`~arithinterp.tasks.encoding` (tokens and operand positions from character offsets),
:mod:`~arithinterp.tasks.positions` (position specs), :mod:`~arithinterp.tasks.evaluation`
(running the model on prompts), :mod:`~arithinterp.tasks.counterfactuals` (drawing aligned
partners), :mod:`~arithinterp.tasks.joining` (joining sets), :mod:`~arithinterp.tasks.prompt_set`
(:class:`PromptSet`, :class:`PromptPairs`, :func:`concat`),
:mod:`~arithinterp.tasks.generators` (:func:`arithmetic`, :func:`prompts_for_pairs`) and
:mod:`~arithinterp.tasks.places` (digits named by their place value: ``units``, ``tens``, ...).
"""

from arithinterp.tasks.counterfactuals import VARY
from arithinterp.tasks.evaluation import UNPARSABLE, Evaluation
from arithinterp.tasks.generators import arithmetic, number_check, parse_prompt, prompts_for_pairs
from arithinterp.tasks.operators import OPERATORS, compute, operand_values
from arithinterp.tasks.places import PLACES, place_name, place_power
from arithinterp.tasks.positions import predicting_position
from arithinterp.tasks.prompt_set import SCORING, PromptPairs, PromptSet, concat, resolve_positions
from arithinterp.tasks.templates import (
    DEFAULT_TEMPLATE,
    OP_SYMBOLS,
    TEMPLATE_FIELDS,
    answer_text,
    check_names,
    check_template,
    few_shot_prefix,
)

__all__ = [
    "OPERATORS", "OP_SYMBOLS", "TEMPLATE_FIELDS", "DEFAULT_TEMPLATE", "SCORING", "VARY", "compute", "Evaluation",
    "UNPARSABLE", "PromptSet", "PromptPairs", "resolve_positions", "concat", "operand_values",
    "check_template", "few_shot_prefix", "answer_text", "arithmetic", "parse_prompt", "prompts_for_pairs",
    "check_names", "number_check", "PLACES", "place_name", "place_power", "predicting_position",
]
