"""The error hierarchy.

Every public function validates its input and raises a subclass of :class:`ArithInterpError`
whose message says what was wrong and what is accepted. Catch ``ArithInterpError`` to handle
all of them; the subclasses also derive from the matching built-in (``ValueError``,
``FileNotFoundError``) so existing ``except ValueError`` code keeps working.
"""

from __future__ import annotations

from typing import Iterable


class ArithInterpError(Exception):
    """Base class of every error arithinterp raises on purpose."""


class ModelSpecError(ArithInterpError, ValueError):
    """A model spec is unknown, malformed, or names an unsupported architecture."""


class ModelFileError(ArithInterpError, FileNotFoundError):
    """A model file or directory is missing or incomplete."""


class TokenizationError(ArithInterpError, ValueError):
    """A number or prompt does not tokenize the way the task needs."""


class TaskError(ArithInterpError, ValueError):
    """Bad arguments to a task builder or a prompt-set operation."""


class PromptIndexError(TaskError, IndexError):
    """An index past the end of a prompt set (also an ``IndexError``, so iteration stops there)."""


class SiteError(ArithInterpError, ValueError):
    """An unknown activation site, or a layer / position / head / neuron out of range."""


class ConfigError(ArithInterpError, ValueError):
    """A bad configuration value (a sweep config, a CLI flag, an option)."""


class MemoryBudgetError(ConfigError):
    """``max_memory`` is too small for even one unit of an analysis's work (one prompt, one edge set)."""


class OutputError(ArithInterpError, OSError):
    """An output could not be written (e.g. the disk is full); what was finished is kept."""


class AnalysisError(ArithInterpError, ValueError):
    """An analysis was given input it cannot work with (too few prompts, wrong shapes)."""


class ModelMismatchError(AnalysisError):
    """Prompts, pairs, a circuit or a fitted detector made for another model than the one given."""


class ResultFileError(ArithInterpError, ValueError):
    """A path does not hold a saved result, holds a result of another type, is damaged (a missing or
    unreadable file, a missing field), or already holds a different result that saving would replace."""


class FormatError(ResultFileError):
    """A file read from disk does not follow its format's declared schema (a result folder, a transcoder
    or SAE of another tool, an attribution graph, a DAS subspace): damaged, truncated, of the wrong type,
    out of range, or made for another model. The message names the file, the field and what was expected."""


def accepted(values: Iterable[object]) -> str:
    """Format the accepted values for an error message: ``'a', 'b', 'c'``.

    Args:
        values: The accepted values, in the order to list them.

    Returns:
        Their ``repr``s joined by ``", "``.
    """
    return ", ".join(repr(v) for v in values)
