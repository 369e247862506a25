"""Numbers as an axis: their tokens, the axis itself, and per-prompt activations gathered per number
(:func:`group_by_value`) or onto the ``(a, b)`` grid (:func:`grid_of`), with the share of variance
each frequency explains (:func:`variance_shares`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Union

import torch

from arithinterp.checks import check_belongs
from arithinterp.errors import AnalysisError, ConfigError, SiteError, TokenizationError
from arithinterp.fourier.basis import check_basis_fits, fourier_basis, number_axis_size
from arithinterp.types import HookedModel, IntList, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet


@checked
def number_tokens(model: HookedModel, numbers: IntList) -> torch.Tensor:
    """Token ids of ``numbers`` written without a space; each must be a single token.

    Args:
        model: The hooked model (or a tokenizer).
        numbers: The numbers.

    Returns:
        long [n].

    Raises:
        AnalysisError: ``numbers`` is empty.
        TokenizationError: some number is not one token.
    """
    check_belongs(model, "fourier.number_tokens")
    tokenizer = getattr(model, "tokenizer", model)
    numbers = list(numbers)
    if not numbers:
        raise AnalysisError("numbers is empty; pass e.g. range(100)")
    size = getattr(tokenizer, "__len__", None)
    vocabulary = size() if callable(size) else None
    if isinstance(vocabulary, int) and len(set(numbers)) > vocabulary:  # refused now, not after tokenizing them all
        raise TokenizationError(f"{len(numbers):,} numbers cannot each be a single token of a vocabulary of "
                                f"{vocabulary:,} tokens; restrict `numbers` to single-token numbers (see "
                                "arithinterp.tasks.number_check)")
    ids = tokenizer([str(x) for x in numbers], add_special_tokens=False)["input_ids"]
    unk = getattr(tokenizer, "unk_token_id", None)
    multi = [x for x, row in zip(numbers, ids) if len(row) != 1 or row[0] == unk]
    if multi:
        raise TokenizationError(
            f"{len(multi)} of these numbers are not single tokens for this tokenizer (e.g. {multi[:5]}); "
            "Fourier analyses over a number axis need one token per number: restrict `numbers` to "
            "single-token numbers (see arithinterp.tasks.number_check)"
        )
    return torch.tensor([row[0] for row in ids])


def number_axis(numbers: Union[int, range, Sequence[int], None], default: Union[int, range, None] = None) -> range:
    """The number axis as a range of consecutive numbers.

    Args:
        numbers: ``n`` (``range(n)``), a range, a sequence of consecutive numbers, or ``None``.
        default: The axis when ``numbers`` is ``None``.

    Returns:
        The range.

    Raises:
        AnalysisError: no axis is given, or the numbers are not a usable axis.
    """
    if numbers is None:
        if default is None:
            raise AnalysisError("pass numbers=range(n) for the number axis")
        numbers = default
    if isinstance(numbers, int):
        numbers = range(numbers)
    values = numbers if isinstance(numbers, range) else list(numbers)  # a range is never listed: it may be huge
    check_basis_fits(number_axis_size(values))  # every spectrum builds the [n, n] basis: refused now, not then
    return range(values[0], values[-1] + 1)


def check_fits(model: HookedModel, numbers: range) -> None:
    """Refuse, before any prompt is built, a number axis whose vectors (one row of ``d_model`` floats
    per number) alone would not fit in the memory an analysis step may use.

    Args:
        model: The hooked model.
        numbers: The axis.

    Raises:
        ConfigError: the axis's vectors exceed the memory budget.
    """
    from arithinterp.engine.budget import memory_budget

    need, budget = 4 * len(numbers) * int(model.cfg.d_model), memory_budget(model)
    if need > budget:
        raise ConfigError(f"{len(numbers)} numbers need {need / 2**30:.3g} GiB for their vectors alone, more than the "
                          f"{budget / 2**30:.3g} GiB an analysis step may use; pass fewer numbers")


@checked
def group_by_value(values: torch.Tensor, acts: torch.Tensor, numbers: range) -> torch.Tensor:
    """Mean of ``acts`` over the prompts of each number of ``numbers``.

    Every number of the range must occur in ``values`` (a spectrum needs the full axis); prompts
    whose value lies outside the range are not used.

    Args:
        values: Each prompt's number, [N].
        acts: Activations [N, ...].
        numbers: The axis.

    Returns:
        float64 [n, ...].

    Raises:
        AnalysisError: ``values`` and ``acts`` disagree in length, or a number has no prompt.
    """
    values = torch.as_tensor(values).long()
    if values.shape[0] != acts.shape[0]:
        raise AnalysisError(f"values has {values.shape[0]} entries but there are {acts.shape[0]} activations")
    index = values - numbers.start
    inside = (index >= 0) & (index < len(numbers))
    index, acts = index[inside], acts[inside]
    counts = torch.bincount(index, minlength=len(numbers))
    missing = [numbers.start + i for i in torch.nonzero(counts == 0).flatten().tolist()]
    if missing:
        raise AnalysisError(
            f"{len(missing)} numbers of {numbers} have no prompt (e.g. {missing[:5]}); a spectrum needs "
            "every number on the axis: build prompts over the whole range"
        )
    flat = acts.reshape(acts.shape[0], -1).double()
    sums = torch.zeros((len(numbers), flat.shape[1]), dtype=flat.dtype).index_add_(0, index, flat)
    return (sums / counts[:, None]).reshape(len(numbers), *acts.shape[1:])


@checked
def grid_of(prompts: PromptSet, acts: torch.Tensor, numbers: range) -> torch.Tensor:
    """Arrange per-prompt ``acts`` on the ``(a, b)`` grid (each cell once; prompts with an operand
    outside ``numbers`` are not used).

    Args:
        prompts: The prompts (their ``a`` and ``b``).
        acts: Activations [N, ...].
        numbers: The axis of both operands.

    Returns:
        [n, n, ...].

    Raises:
        AnalysisError: the prompts do not cover the grid exactly once.
    """
    n = len(numbers)
    ia, ib = prompts.a.long() - numbers.start, prompts.b.long() - numbers.start
    inside = (ia >= 0) & (ia < n) & (ib >= 0) & (ib < n)
    cells = ia[inside] * n + ib[inside]
    counts = torch.bincount(cells, minlength=n * n)
    if (counts != 1).any():
        raise AnalysisError(
            f"the prompts must cover the {n}×{n} grid of (a, b) in {numbers} exactly once; "
            f"{int((counts == 0).sum())} cells are missing and {int((counts > 1).sum())} repeated"
        )
    grid = torch.empty((n * n, *acts.shape[1:]), dtype=acts.dtype)
    grid[cells] = acts[inside]
    return grid.reshape(n, n, *acts.shape[1:])


def variance_shares(values: torch.Tensor, acts: torch.Tensor, numbers: range) -> torch.Tensor:
    """Share of the variance of ``acts`` over *all* prompts that each frequency of ``numbers``'
    Fourier basis explains, the basis evaluated at each prompt's value (the R² of a least-squares
    fit on that frequency's cos / sin columns; NaN for the constant).

    Power shares of the per-number means are scale-free: a representation that barely depends on
    the value (a random-init model) can still put most of its tiny between-number power at one
    frequency. This share counts the variance the value does not explain too, so it is comparable
    across models. Prompts whose value lies outside ``numbers`` are not used.

    Args:
        values: Each prompt's number, [N].
        acts: Activations [N, ...].
        numbers: The axis.

    Returns:
        float64 [n_freq].
    """
    values = torch.as_tensor(values).long()
    index = values - numbers.start
    inside = (index >= 0) & (index < len(numbers))
    flat = acts[inside].reshape(int(inside.sum()), -1).double()
    flat = flat - flat.mean(0)
    total = float((flat**2).sum())
    basis = fourier_basis(len(numbers))
    columns = basis.matrix[:, index[inside]].T  # [N, n]: every basis row at each prompt's value
    columns = columns - columns.mean(0)
    shares = torch.full((basis.n_freq,), float("nan"), dtype=torch.float64)
    for k in range(1, basis.n_freq):
        design = columns[:, basis.freqs == k]
        if total <= 0 or float((design**2).sum()) <= 0:
            shares[k] = 0.0
            continue
        fitted = design @ torch.linalg.lstsq(design, flat).solution
        shares[k] = float((fitted**2).sum()) / total
    return shares


def grid_activations(model: HookedModel, prompts: PromptSet, layer: int, site: str, numbers: range, batch_size: int,
                      progress: bool) -> torch.Tensor:
    """Neuron activations at the final position on the (a, b) grid.

    Args:
        model: The hooked model.
        prompts: Prompts covering the grid once.
        layer: The layer read.
        site: ``"mlp_pre"`` or ``"mlp_post"``.
        numbers: The axis of both operands.
        batch_size: Prompts per forward.
        progress: Show a progress bar.

    Returns:
        [d_mlp, n, n].

    Raises:
        SiteError: ``site`` is not a neuron site.
    """
    from arithinterp.activations import collect

    if site not in ("mlp_pre", "mlp_post"):
        raise SiteError(f"neuron spectra read 'mlp_pre' or 'mlp_post', got {site!r}")
    acts = collect(model, prompts, sites=[site], layers=[layer], positions="final", batch_size=batch_size,
                   progress=progress)
    return grid_of(prompts, acts.get(site, layer, "final"), numbers).permute(2, 0, 1)


def single_tokens(model: HookedModel, numbers: range) -> bool:
    """Whether every number of the axis is one token.

    Args:
        model: The hooked model.
        numbers: The axis.

    Returns:
        ``True`` when :func:`number_tokens` accepts them.
    """
    try:
        number_tokens(model, numbers)
    except TokenizationError:
        return False
    return True
