"""Causal models of arithmetic as data: variables, their parents and functions.

A :class:`CausalModel` is the high-level algorithm that distributed alignment search aligns a
network with (Geiger et al. 2024, "Finding alignments between interpretable causal variables and
distributed neural representations"). Its roots are the operands ``a`` and ``b``; every other
variable is a function of its parents, evaluated on whole tensors of operands at once. Setting a
variable to another value (an *interchange*) and recomputing its descendants gives the
counterfactual answer the model should produce when that variable is swapped in.

Built in: :func:`addition` (n-digit addition with per-column digit sums and carries, each digit named
by its place: ``answer_tens``, ``carry_hundreds``),
:func:`single_token_addition` ("sum mod 10" and "magnitude"), :func:`modular_addition`.
User-defined models are lists of :class:`Variable`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Mapping, Optional, Sequence

import torch
from pydantic import Field

from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.tasks.places import PLACES, refuse_renamed
from arithinterp.types import Accepts, checked

ROOTS = ("a", "b")


@dataclass(frozen=True)
class Variable:
    """One variable of a causal model.

    Attributes:
        name: The variable's name.
        parents: The operands (``"a"``, ``"b"``) or earlier variables it is computed from.
        function: ``function(*parent values)`` maps long tensors ``[N]`` to a long tensor ``[N]``.
        description: What it is, in words.
    """

    name: str
    parents: tuple[str, ...]
    function: Callable[..., torch.Tensor] = field(compare=False)
    description: str = ""


@dataclass(frozen=True)
class CausalModel:
    """A causal model of a task: variables in dependency order.

    Attributes:
        name: The model's name.
        variables: The variables, each naming only the operands or earlier variables as parents.
        output: The variable whose value is the answer.

    Raises:
        AnalysisError: A variable defined twice, a parent not defined before its child, or an
            unknown output.
    """

    name: str
    variables: tuple[Variable, ...]
    output: str = "answer"

    def __post_init__(self) -> None:
        known: set[str] = set(ROOTS)
        for variable in self.variables:
            if variable.name in known:
                raise AnalysisError(f"causal model {self.name!r}: variable {variable.name!r} is defined twice "
                                    f"(or shadows an operand {ROOTS})")
            unknown = [p for p in variable.parents if p not in known]
            if unknown:
                raise AnalysisError(
                    f"causal model {self.name!r}: variable {variable.name!r} has parents {unknown} that are not "
                    f"defined before it; accepted parents: {accepted(sorted(known))}"
                )
            known.add(variable.name)
        if self.output not in known:
            raise AnalysisError(f"causal model {self.name!r}: output {self.output!r} is not a variable; "
                                f"accepted: {accepted(sorted(known))}")

    @property
    def names(self) -> list[str]:
        return [v.name for v in self.variables]

    def check_variable(self, name: str) -> None:
        if name not in self.names or name == self.output:
            inner = [n for n in self.names if n != self.output]
            refuse_renamed(name, what="variable", known=inner, carry_into=True)
            raise ConfigError(f"unknown variable {name!r} of causal model {self.name!r}; accepted: {accepted(inner)}")

    def values(self, a: torch.Tensor, b: torch.Tensor,
               set_to: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """Every variable's value for some operands.

        Args:
            a (Int[Tensor, "n"]): First operands.
            b (Int[Tensor, "n"]): Second operands.
            set_to: Variables fixed to given values (an interchange); their descendants are
                recomputed from the fixed values.

        Returns:
            ``{name: Int[Tensor, "n"]}`` for the operands and every variable.

        Raises:
            AnalysisError: An unknown variable in ``set_to``, or a function that returns values
                that are not whole numbers.
        """
        set_to = dict(set_to or {})
        for name in set_to:
            self.check_variable(name)
        out: dict[str, torch.Tensor] = {"a": torch.as_tensor(a).long(), "b": torch.as_tensor(b).long()}
        for variable in self.variables:
            if variable.name in set_to:
                out[variable.name] = torch.as_tensor(set_to[variable.name]).long().expand_as(out["a"]).clone()
            else:
                out[variable.name] = _whole(variable.function(*[out[p] for p in variable.parents]), variable.name,
                                            self.name)
        return out

    def answer(self, a: torch.Tensor, b: torch.Tensor,
               set_to: Optional[Mapping[str, torch.Tensor]] = None) -> torch.Tensor:
        """The output variable's value.

        Args:
            a (Int[Tensor, "n"]): First operands.
            b (Int[Tensor, "n"]): Second operands.
            set_to: Variables fixed to given values, as in :meth:`values`.

        Returns:
            Int[Tensor, "n"]: The answer.
        """
        return self.values(a, b, set_to)[self.output]


def _digit(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def digit(x: torch.Tensor) -> torch.Tensor:
        if bool((x < 0).any()):  # column addition is defined on the digits of non-negative numbers
            raise AnalysisError(f"column addition reads the digits of non-negative operands; got {int(x.min())}")
        return (x // 10**i) % 10

    return digit


def _whole(value: Any, name: str, model: str) -> torch.Tensor:
    """A variable's values as a long tensor; values that are not whole numbers are refused, not truncated."""
    value = torch.as_tensor(value)
    if value.is_floating_point() or value.is_complex():
        if not bool(torch.isfinite(value).all()) or not bool((value == value.round()).all()):
            raise AnalysisError(f"causal model {model!r}: variable {name!r} gave values that are not whole numbers "
                                f"(e.g. {value.reshape(-1)[0].item()!r}); a variable's function must return integers")
    return value.long()


@checked
def addition(n_digits: Annotated[int, Field(ge=1, le=18), Accepts("an int in 1..18")] = 3) -> CausalModel:
    """Column addition of two ``n_digits``-digit numbers, every digit named by its place.

    Variables: ``a_units``, ``b_units``, ``a_tens``, ... (the operands' digits);
    ``column_sum_units = a_units + b_units``, ...; ``carry_tens``, ``carry_hundreds``, ... the carry
    *into* that column (``carry_tens`` is 1 when the units column sums to 10 or more; the carry
    into the column past the operands' last is the leading digit of the sum); ``answer_units``,
    ``answer_tens``, ... the digits of the sum, and ``answer``; and ``product_parity``
    (``a·b mod 2``), which the answer does not depend on: a label for the control
    ``interchange_dataset(..., value_from="product_parity")``. The digit names are those of the
    prompt labels (:meth:`arithinterp.tasks.PromptSet.label`), so a probe and an alignment of the
    same name read the same value.

    Args:
        n_digits: The operands' digit count, 1..18.

    Returns:
        The causal model ``addition-{n_digits}digit``.
    """
    places = PLACES[: n_digits + 1]
    variables: list[Variable] = []
    for i, place in enumerate(places[:-1]):
        variables += [Variable(f"a_{place}", ("a",), _digit(i), f"the {place} digit of a"),
                      Variable(f"b_{place}", ("b",), _digit(i), f"the {place} digit of b")]
    for place in places[:-1]:
        variables.append(Variable(f"column_sum_{place}", (f"a_{place}", f"b_{place}"), lambda x, y: x + y,
                                  f"a_{place} + b_{place}"))
    for i, place in enumerate(places[:-1]):
        inputs = (f"column_sum_{place}",) + ((f"carry_{place}",) if i else ())
        variables.append(Variable(f"answer_{place}", inputs, lambda s, c=None: (s + (0 if c is None else c)) % 10,
                                  f"the {place} digit of the sum"))
        variables.append(Variable(f"carry_{places[i + 1]}", inputs,
                                  lambda s, c=None: ((s + (0 if c is None else c)) >= 10),
                                  f"the carry into the {places[i + 1]} column"))
    variables.append(Variable("product_parity", ("a", "b"), lambda a, b: (a * b) % 2,
                              "a·b mod 2 (no part of the sum: a control label)"))
    parents = tuple(f"answer_{place}" for place in places[:-1]) + (f"carry_{places[-1]}",)

    def total(*digits: torch.Tensor) -> torch.Tensor:
        return sum((d * 10**i for i, d in enumerate(digits)), torch.zeros_like(digits[0]))

    variables.append(Variable("answer", parents, total, "the sum"))
    return CausalModel(f"addition-{n_digits}digit", tuple(variables))


@checked
def single_token_addition(base: int = 10) -> CausalModel:
    """``a + b`` read as ``sum_mod_10`` (its units digit) and ``magnitude`` (``(a + b) // 10``).

    ``base`` splits the sum elsewhere: ``base=100`` gives ``sum_mod_100`` and ``magnitude`` =
    ``(a + b) // 100`` (whether the sum reaches 100), the split a helix of periods dividing 100
    keeps apart (every periodic feature is a function of ``sum mod 100``).

    Args:
        base: Where the sum is split, at least 2.

    Returns:
        The causal model.

    Raises:
        AnalysisError: ``base`` is not an int ≥ 2.
    """
    if isinstance(base, bool) or not isinstance(base, int) or base < 2:
        raise ConfigError(f"base must be an int >= 2 (the sum is split into sum // base and sum mod base), "
                            f"got {base!r}")
    name = "single-token-addition" if base == 10 else f"single-token-addition-base-{base}"
    return CausalModel(name, (
        Variable("sum", ("a", "b"), lambda a, b: a + b, "a + b"),
        Variable(f"sum_mod_{base}", ("sum",), lambda s: s % base, f"the sum mod {base}"
                 + (" (its units digit)" if base == 10 else "")),
        Variable("magnitude", ("sum",), lambda s: s // base, f"the sum // {base}"),
        Variable("answer", (f"sum_mod_{base}", "magnitude"), lambda u, m: base * m + u, "the sum"),
    ))


@checked
def modular_addition(p: int = 113) -> CausalModel:
    """``(a + b) mod p`` as ``sum`` (unreduced) and ``wraps`` (``sum >= p``).

    Args:
        p: The modulus, at least 2.

    Returns:
        The causal model ``modular-addition-{p}``.

    Raises:
        AnalysisError: ``p`` is not an int ≥ 2.
    """
    if isinstance(p, bool) or not isinstance(p, int) or p < 2:
        raise ConfigError(f"the modulus p must be an int >= 2, got {p!r}")
    return CausalModel(f"modular-addition-{p}", (
        Variable("sum", ("a", "b"), lambda a, b: a + b, "a + b, not reduced"),
        Variable("wraps", ("sum",), lambda s: s >= p, f"whether a + b reaches {p}"),
        Variable("answer", ("sum", "wraps"), lambda s, w: s - p * w, f"(a + b) mod {p}"),
    ))


BUILT_IN = {"addition": addition, "single_token_addition": single_token_addition, "modular_addition": modular_addition}


@checked
def for_prompts(op: str, modulus: Optional[int], n_digits: int, single_token: bool) -> CausalModel:
    """The built-in causal model for a prompt set: modular addition when it has a modulus, single-token
    addition when every number is one token, else column addition with ``n_digits`` digits.

    Args:
        op: The prompts' operator; only ``"+"`` has built-in models.
        modulus: The prompts' modulus, or ``None``.
        n_digits: The operands' digit count, for column addition.
        single_token: Whether every number is one token.

    Returns:
        The causal model.

    Raises:
        AnalysisError: An operator other than ``"+"``.
    """
    if op != "+":
        raise AnalysisError(f"the built-in causal models describe addition ('+'), not {op!r}; "
                            "pass your own CausalModel")
    if modulus is not None:
        return modular_addition(modulus)
    return single_token_addition() if single_token else addition(n_digits)


@checked
def variables_of(model: CausalModel, exclude: Sequence[str] = ()) -> list[str]:
    """The variables one can interchange.

    Args:
        model: The causal model.
        exclude: Variables to leave out.

    Returns:
        Every variable's name but the output's and those of ``exclude``, in dependency order.
    """
    return [n for n in model.names if n != model.output and n not in exclude]
