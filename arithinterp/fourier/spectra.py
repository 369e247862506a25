"""Spectra read from a model over a number axis, returned as :class:`SpectrumResult`.

Number-token embeddings, residual activations over a number axis, component outputs through the
logit lens (Zhou et al. 2024) and neuron activations over the ``(a, b)`` grid (Nanda et al. 2023);
:func:`spectrum` is the one entry point. The number axis comes from
:mod:`~arithinterp.fourier.number_axes` (:func:`number_tokens`, one token per number;
:func:`group_by_value` / :func:`grid_of`, per-prompt activations gathered per number or onto the
grid), the result and its key frequencies from :mod:`~arithinterp.fourier.spectrum_result`, the
shuffled-numbers control from :mod:`~arithinterp.fourier.null_control`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from arithinterp.checks import check_belongs
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.fourier.basis import KEY_RULES, block_power, pair_power_per_grid, spectrum_of, spectrum_of_2d
from arithinterp.fourier.null_control import check_null, gram, shuffled_power
from arithinterp.fourier.number_axes import (
    check_fits, grid_activations, group_by_value, number_axis, number_tokens, single_tokens, variance_shares,
)
from arithinterp.fourier.spectrum_result import SpectrumResult, spectrum_result
from arithinterp.results import build_meta
from arithinterp.types import HookedModel, NonNegativeInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

COMPONENT_SITES = ("attn_out", "mlp_out")


def _rule_kw(rule: str, factor: float, fraction: float) -> dict:
    if rule not in KEY_RULES:
        raise ConfigError(f"unknown key-frequency rule {rule!r}; accepted: {accepted(KEY_RULES)}")
    return dict(rule=rule, factor=factor, fraction=fraction)


@checked
def embedding_spectrum(model: HookedModel, numbers: Union[int, range] = 100, *, rule: str = "median",
                       factor: float = 10.0, fraction: float = 0.9, n_shuffles: NonNegativeInt = 100,
                       alpha: float = 0.05, seed: int = 0) -> SpectrumResult:
    """Spectrum of the number-token embeddings ``W_E[token(x)]`` for x in ``numbers``.

    [n, d_model] rows → power per frequency (Zhou et al. 2024 §2; Nanda et al. 2023 §3). Key
    frequencies must also beat ``n_shuffles`` copies with the numbers shuffled at level
    ``alpha`` (``meta["control"]``; ``n_shuffles=0``: the rule alone).

    Args:
        model: The hooked model.
        numbers: The number axis (``n``: ``range(n)``); every number one token.
        rule: The key-frequency rule (:func:`~arithinterp.fourier.key_frequencies`).
        factor: The rule's factor.
        fraction: The rule's fraction.
        n_shuffles: Shuffled-numbers copies for the control (0: the rule alone).
        alpha: The control's level.
        seed: The shuffles' seed.

    Returns:
        One series, ``"embed"``.

    Raises:
        TokenizationError: a number is not one token.
        ConfigError: an unknown rule, or a control that cannot pass any frequency.
    """
    check_belongs(model, "fourier.embedding_spectrum")
    numbers = number_axis(numbers)
    kw = _rule_kw(rule, factor, fraction)
    check_null(n_shuffles, alpha)
    embeddings = model.W_E.detach()[number_tokens(model, numbers)]
    power = spectrum_of(embeddings)[None]
    null = shuffled_power(gram(embeddings), n_shuffles, seed)[:, None]
    return spectrum_result(power, ["embed"], numbers.start, len(numbers), "embed", **kw,
                            meta=build_meta(model, numbers=numbers), null_power=null, alpha=alpha)


@checked
def activation_spectrum(
    source: Any,
    values: Optional[torch.Tensor] = None,
    numbers: Union[int, range, None] = None,
    *,
    site: str = "resid_post",
    layers: Optional[Sequence[int]] = None,
    positions: Optional[str] = None,
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    n_shuffles: NonNegativeInt = 100,
    alpha: float = 0.05,
    seed: int = 0,
) -> SpectrumResult:
    """Spectrum of activations over a number axis.

    ``source`` is either a tensor [n_numbers, d] whose row ``i`` belongs to number ``i`` of
    ``numbers`` (default ``range(n_numbers)``), or an :class:`~arithinterp.activations.Activations`
    at ``site`` / ``positions``: prompts are grouped by ``values`` [N] (default: the prompts'
    label named like the position, e.g. ``"a"``) and averaged per number, one series per layer.

    Control: a key frequency of ``rule`` must also beat ``n_shuffles`` copies with the numbers
    shuffled (the rows permuted over the number axis) at level ``alpha``; ``meta["control"]``
    gives the p-values, the frequencies dropped and how many key frequencies the rule finds on
    shuffled numbers (``n_shuffles=0``: the rule alone).

    Args:
        source: A tensor [n_numbers, d] or an ``Activations``.
        values: Each prompt's number [N] (an ``Activations`` source).
        numbers: The number axis.
        site: The collected site read (an ``Activations`` source).
        layers: The layers read (default all collected).
        positions: The one position read (default the first collected).
        rule: The key-frequency rule (:func:`~arithinterp.fourier.key_frequencies`).
        factor: The rule's factor.
        fraction: The rule's fraction.
        n_shuffles: Shuffled-numbers copies for the control (0: the rule alone).
        alpha: The control's level.
        seed: The shuffles' seed.

    Returns:
        One series per layer (or ``"activations"`` for a tensor).

    Raises:
        AnalysisError: the source, values or axis are refused.
        ConfigError: an unknown rule, or a control that cannot pass any frequency.
    """
    kw = _rule_kw(rule, factor, fraction)
    check_null(n_shuffles, alpha)
    if isinstance(source, torch.Tensor):
        if source.ndim != 2:
            raise AnalysisError(f"an activation tensor must be [n_numbers, d], got shape {tuple(source.shape)}")
        numbers = number_axis(numbers, source.shape[0])
        if len(numbers) != source.shape[0]:
            raise AnalysisError(f"numbers has {len(numbers)} entries but the tensor has {source.shape[0]} rows")
        null = shuffled_power(gram(source), n_shuffles, seed)[:, None]
        return spectrum_result(spectrum_of(source)[None], ["activations"], numbers.start, len(numbers),
                                "activations", **kw, meta=build_meta(numbers=numbers), null_power=null, alpha=alpha)
    if not hasattr(source, "get") or not hasattr(source, "positions"):
        raise AnalysisError(f"source must be a tensor [n, d] or an Activations, got {type(source).__name__}")
    positions = positions if positions is not None else source.positions[0]
    if values is None:
        if source.prompts is None or str(positions) not in ("a", "b"):
            raise AnalysisError("pass values= (the number of each prompt), e.g. prompts.a for position 'a'")
        values = source.prompts.label(str(positions))
    values = torch.as_tensor(values).long()
    numbers = number_axis(numbers, range(int(values.min()), int(values.max()) + 1))
    layers = list(source.layers) if layers is None else list(layers)
    per_layer = [source.get(site, layer, positions) for layer in layers]
    grouped = [group_by_value(values, acts, numbers) for acts in per_layer]
    power = torch.stack([spectrum_of(g) for g in grouped])
    null = torch.stack([shuffled_power(gram(g), n_shuffles, seed) for g in grouped], 1)
    outside = int(((values < numbers.start) | (values >= numbers.stop)).sum())
    shares = torch.stack([variance_shares(values, acts, numbers) for acts in per_layer])
    return spectrum_result(power, [f"L{layer} {site}" for layer in layers], numbers.start, len(numbers),
                            f"{site} at {positions}", **kw,
                            meta=build_meta(site=site, position=str(positions), layers=layers,
                                            excluded_prompts=dict(count=outside, reason=f"value outside {numbers}"),
                                            variance_share=shares.tolist()),
                            null_power=null, alpha=alpha)


@checked
def logit_lens_spectrum(
    model: HookedModel,
    prompts: PromptSet,
    numbers: Union[int, range, None] = None,
    *,
    layers: Optional[Sequence[int]] = None,
    components: Sequence[str] = COMPONENT_SITES,
    positions: str = "final",
    batch_size: int = 256,
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    progress: bool = True,
    n_shuffles: NonNegativeInt = 100,
    alpha: float = 0.05,
    seed: int = 0,
) -> SpectrumResult:
    """Zhou et al. 2024: each component's output at ``positions`` read through the logit lens
    onto number tokens, ``L = W_U[:, tokens(numbers)]ᵀ · output`` [N, n], then a DFT along the
    number axis; power is averaged over prompts. One series per (layer, component).

    ``numbers`` defaults to 0..max answer of ``prompts``. Key frequencies must also beat the
    number-token axis shuffled ``n_shuffles`` times at level ``alpha`` (``meta["control"]``).

    Args:
        model: The hooked model.
        prompts: The prompts read.
        numbers: The number-token axis.
        layers: The layers read (default all).
        components: Among :data:`COMPONENT_SITES`.
        positions: The one position read.
        batch_size: Prompts per forward.
        rule: The key-frequency rule (:func:`~arithinterp.fourier.key_frequencies`).
        factor: The rule's factor.
        fraction: The rule's fraction.
        progress: Show a progress bar.
        n_shuffles: Shuffled-numbers copies for the control (0: the rule alone).
        alpha: The control's level.
        seed: The shuffles' seed.

    Returns:
        One series per (layer, component).

    Raises:
        SiteError: an unknown component.
        TokenizationError: a number is not one token.
    """
    check_belongs(model, "fourier.logit_lens_spectrum", prompts=prompts)
    from arithinterp.activations import collect

    kw = _rule_kw(rule, factor, fraction)
    check_null(n_shuffles, alpha)
    bad = [c for c in components if c not in COMPONENT_SITES]
    if bad or not components:
        raise SiteError(f"unknown components {bad}; accepted: {accepted(COMPONENT_SITES)}")
    numbers = number_axis(numbers, int(prompts.answer.max()) + 1)
    unembed = model.W_U.detach()[:, number_tokens(model, numbers)].double()
    acts = collect(model, prompts, sites=list(components), layers=layers, positions=positions,
                   batch_size=batch_size, progress=progress)
    series, power, null = [], [], []
    for layer in acts.layers:
        for component in components:
            lens = acts.get(component, layer, positions).double() @ unembed  # [N, n]
            power.append(spectrum_of(lens, dim=1) / lens.shape[0])
            null.append(shuffled_power(lens.T @ lens, n_shuffles, seed) / lens.shape[0])
            series.append(f"L{layer} {component}")
    return spectrum_result(torch.stack(power), series, numbers.start, len(numbers), f"logit lens at {positions}",
                            **kw, meta=build_meta(model, n_prompts=len(prompts), position=positions),
                            null_power=torch.stack(null, 1), alpha=alpha)


@checked
def neuron_spectrum(
    model: HookedModel,
    prompts: PromptSet,
    layer: int = 0,
    numbers: Union[int, range, None] = None,
    *,
    site: str = "mlp_post",
    batch_size: int = 1024,
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    progress: bool = True,
    n_shuffles: NonNegativeInt = 20,
    alpha: float = 0.05,
    seed: int = 0,
) -> SpectrumResult:
    """2-D spectrum of every neuron's activation grid over ``(a, b)`` at the final position,
    summed over neurons: power per frequency pair (Nanda et al. 2023).

    ``prompts`` must cover the grid ``numbers × numbers`` (default 0..max a) exactly once. Key
    frequencies (of the block power) must also beat ``n_shuffles`` copies with the a values and
    the b values shuffled at level ``alpha`` (each shuffle is a full 2-D transform of every
    neuron, hence fewer than for 1-D spectra; ``meta["control"]``).

    Args:
        model: The hooked model.
        prompts: Prompts covering the grid once.
        layer: The layer read.
        numbers: The axis of both operands.
        site: ``"mlp_post"`` or ``"mlp_pre"``.
        batch_size: Prompts per forward.
        rule: The key-frequency rule (:func:`~arithinterp.fourier.key_frequencies`).
        factor: The rule's factor.
        fraction: The rule's fraction.
        progress: Show a progress bar.
        n_shuffles: Shuffled-numbers copies for the control (0: the rule alone).
        alpha: The control's level.
        seed: The shuffles' seed.

    Returns:
        One 2-D series.

    Raises:
        AnalysisError: the prompts do not cover the grid exactly once.
        SiteError: ``site`` is not a neuron site.
    """
    check_belongs(model, "fourier.neuron_spectrum", prompts=prompts)
    kw = _rule_kw(rule, factor, fraction)
    check_null(n_shuffles, alpha)
    numbers = number_axis(numbers, int(prompts.a.max()) + 1)
    grids = grid_activations(model, prompts, layer, site, numbers, batch_size, progress)
    grids = grids.double()
    power = spectrum_of_2d(grids)[None]
    generator = torch.Generator().manual_seed(int(seed))
    n = grids.shape[-1]
    null = []
    for _ in range(n_shuffles):
        rows, cols = torch.randperm(n, generator=generator), torch.randperm(n, generator=generator)
        null.append(block_power(pair_power_per_grid(grids[:, rows][:, :, cols]).sum(0)))
    null = torch.stack(null)[:, None] if null else None
    return spectrum_result(power, [f"L{layer} {site}"], numbers.start, len(numbers), f"{site} over (a, b)", **kw,
                            meta=build_meta(model, layer=layer, site=site, n_neurons=grids.shape[0],
                                            excluded_prompts=len(prompts) - len(numbers) ** 2),
                            null_power=null, alpha=alpha)


CONTEXT_SITES = ("embed", "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


@checked
def context_spectrum(
    model: HookedModel,
    numbers: Union[int, range] = 100,
    *,
    site: str = "resid_post",
    layers: Optional[Sequence[int]] = None,
    template: str = "{a}+{b}=",
    b: int = 0,
    positions: str = "a",
    rule: str = "median",
    factor: float = 10.0,
    fraction: float = 0.9,
    progress: bool = True,
) -> SpectrumResult:
    """Spectrum of each number's representation read in a prompt: for every x in ``numbers`` the
    prompt ``template`` with a = x (and ``b``), the activation at ``site`` and ``positions``
    (default ``"a"``: the number's last token, where a number split into several tokens has been
    read whole, as Kantamneni & Tegmark 2025 read it), one series per layer.

    This works for any tokenizer: one token per number, one per digit (Llama 2, Gemma, Qwen) or
    irregular BPE pieces. With ``site="embed"`` a multi-token number is seen only through the
    embedding of its last token (for digit-split numbers: the last digit, a pure period-10
    signal); later layers have mixed in the earlier tokens.

    Args:
        model: The hooked model.
        numbers: The number axis.
        site: One of :data:`CONTEXT_SITES`.
        layers: The layers read (default all).
        template: The prompt template.
        b: The second operand of every prompt.
        positions: The one position read.
        rule: The key-frequency rule (:func:`~arithinterp.fourier.key_frequencies`).
        factor: The rule's factor.
        fraction: The rule's fraction.
        progress: Show a progress bar.

    Returns:
        One series per layer.

    Raises:
        SiteError: ``site`` is not a context site.
    """
    check_belongs(model, "fourier.context_spectrum")
    from arithinterp.activations import collect
    from arithinterp.tasks import arithmetic

    if site not in CONTEXT_SITES:
        raise SiteError(f"a number spectrum reads one of {accepted(CONTEXT_SITES)}, got {site!r}")
    numbers = number_axis(numbers)
    prompts = arithmetic(model, "+", a=numbers, b=[b], template=template)
    acts = collect(model, prompts, sites=[site], layers=layers, positions=[positions], progress=progress)
    result = activation_spectrum(acts, values=prompts.a, numbers=numbers, site=site, positions=acts.positions[0],
                                 rule=rule, factor=factor, fraction=fraction)
    result.meta.update(template=template, b=b, operand_tokens=prompts.meta["operand_tokens"]["max"])
    return result


@checked
def spectrum(source: Any, numbers: Union[int, range, None] = None, *, site: str = "embed", **kwargs) -> SpectrumResult:
    """One entry point for every spectrum.

    * a model with ``site="embed"`` → :func:`embedding_spectrum` when every number is one
      token, else :func:`context_spectrum` (the embedding at each number's last token);
    * a model with a residual or output site (``"resid_post"``, ``"mlp_out"``, ...; ``layers=``)
      → :func:`context_spectrum`: each number read at its last token in a prompt, any tokenizer;
    * a tensor [n, d] or an ``Activations`` → :func:`activation_spectrum` (``site`` is the
      collected site to read, e.g. ``"resid_post"``);
    * a model with ``site="logit_lens"`` and ``prompts=`` → :func:`logit_lens_spectrum`;
    * a model with ``site="mlp_post"`` / ``"mlp_pre"`` and ``prompts=`` → :func:`neuron_spectrum`.

    Args:
        source: A model, a tensor [n, d] or an ``Activations``.
        numbers: The number axis (default ``range(100)`` for a model).
        site: What is read (see above).
        **kwargs: Passed to the function chosen (``prompts=`` among them).

    Returns:
        The spectrum the chosen function gives.

    Raises:
        AnalysisError: the source is not a model, tensor or ``Activations``, or ``prompts`` is missing.
        SiteError: an unknown site.
        ConfigError: the number axis's vectors exceed the memory budget.
    """
    if isinstance(source, torch.Tensor) or (hasattr(source, "get") and hasattr(source, "positions")):
        if site == "embed":
            site = "resid_post"
        return activation_spectrum(source, numbers=numbers, site=site, **kwargs)
    if not hasattr(source, "cfg"):
        raise AnalysisError(f"source must be a model, a tensor or an Activations, got {type(source).__name__}")
    check_fits(source, number_axis(100 if numbers is None else numbers))
    if site == "embed" and "prompts" not in kwargs:
        if single_tokens(source, number_axis(100 if numbers is None else numbers)):
            return embedding_spectrum(source, 100 if numbers is None else numbers, **kwargs)
    if site in CONTEXT_SITES and "prompts" not in kwargs:
        return context_spectrum(source, 100 if numbers is None else numbers, site=site, **kwargs)
    prompts = kwargs.pop("prompts", None)
    if prompts is None:
        raise AnalysisError(f"site={site!r} needs prompts= (a PromptSet)")
    if site == "logit_lens":
        return logit_lens_spectrum(source, prompts, numbers, **kwargs)
    if site in ("mlp_pre", "mlp_post"):
        return neuron_spectrum(source, prompts, numbers=numbers, site=site, **kwargs)
    raise SiteError(
        f"unknown spectrum site {site!r}; accepted: {accepted(['embed', 'logit_lens', 'mlp_pre', 'mlp_post'])}"
    )
