"""Activation sites in TransformerLens's hook vocabulary.

A *site* names what is read or patched (``resid_pre``, ``attn_z``, ...); together with a layer it
gives a hook name (``blocks.3.hook_resid_pre``). Everything that touches hooks goes through
these helpers so a bad site or layer fails the same way everywhere. :func:`coarse_to_fine` orders
layers so that any first few of them cover the depth (for work that may stop early).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

from arithinterp.checks import integers
from arithinterp.errors import SiteError, accepted
from arithinterp.types import HookedModel

# site -> hook name template; "{layer}" is filled in for per-layer sites.
HOOKS: dict[str, str] = {
    "embed": "hook_embed",
    "pos_embed": "hook_pos_embed",
    "resid_pre": "blocks.{layer}.hook_resid_pre",
    "resid_mid": "blocks.{layer}.hook_resid_mid",
    "resid_post": "blocks.{layer}.hook_resid_post",
    "attn_out": "blocks.{layer}.hook_attn_out",
    "mlp_out": "blocks.{layer}.hook_mlp_out",
    "attn_z": "blocks.{layer}.attn.hook_z",
    "pattern": "blocks.{layer}.attn.hook_pattern",
    "mlp_in": "blocks.{layer}.mlp.hook_in",  # the MLP's input, after its norm (what a transcoder reads)
    "mlp_pre": "blocks.{layer}.mlp.hook_pre",
    "mlp_post": "blocks.{layer}.mlp.hook_post",
    "ln1_scale": "blocks.{layer}.ln1.hook_scale",  # the norms' divisors [B, T, 1] (frozen in attribution graphs)
    "ln2_scale": "blocks.{layer}.ln2.hook_scale",
    # the branch norms' divisors (Gemma 2 / 3 norm each attention and MLP output before the residual)
    "ln1_post_scale": "blocks.{layer}.ln1_post.hook_scale",
    "ln2_post_scale": "blocks.{layer}.ln2_post.hook_scale",
    "ln_final_scale": "ln_final.hook_scale",
}
GLOBAL_SITES = ("embed", "pos_embed", "ln_final_scale")
PER_NEURON_SITES = ("mlp_pre", "mlp_post")


def check_site(site: str) -> str:
    """Check that ``site`` is a known activation site.

    Args:
        site: A key of :data:`HOOKS` (``"resid_pre"``, ``"attn_z"``, ``"mlp_post"``, ...).

    Returns:
        ``site``, unchanged.

    Raises:
        SiteError: ``site`` is not a known site; the message lists the accepted ones.
    """
    if site not in HOOKS:
        raise SiteError(f"unknown site {site!r}; accepted sites: {accepted(HOOKS)}")
    return site


def n_layers(model: HookedModel) -> int:
    """The number of transformer blocks of a model.

    Args:
        model: A hooked model.

    Returns:
        ``model.cfg.n_layers``.
    """
    return int(model.cfg.n_layers)


def _integers(name: str, values: Any) -> list[int]:
    """``values`` (one int or several) as ints; floats, strings and bools are refused, never truncated."""
    return integers(name, values, SiteError)


def check_layers(model: HookedModel, site: str, layers: Optional[Iterable[int]]) -> list[int]:
    """The validated layers to read or patch ``site`` at.

    Args:
        model: The hooked model the layers belong to.
        site: The activation site (a key of :data:`HOOKS`).
        layers: Layer indices, or ``None`` for every layer.

    Returns:
        The layers as ints: every layer when ``layers`` is ``None``, ``[0]`` for a global site
        (``embed``, ``pos_embed``, ``ln_final_scale``).

    Raises:
        SiteError: The site is unknown, ``layers`` is empty or holds a non-integer, an index out of
            range or a layer twice, or the site needs MLPs and the model is attention-only.
    """
    check_site(site)
    if site in GLOBAL_SITES:
        return [0]
    total = n_layers(model)
    chosen = list(range(total)) if layers is None else _integers("layers", layers)
    if not chosen:
        raise SiteError("layers is empty; pass None for all layers or a list of layer indices")
    for layer in chosen:
        if not 0 <= layer < total:
            raise SiteError(f"layer {layer} is out of range for a {total}-layer model; accepted: 0..{total - 1}")
    if len(set(chosen)) != len(chosen):  # a repeated layer would be read or patched twice, as two rows
        raise SiteError(f"layers={chosen} names a layer more than once; name each once")
    if site in PER_NEURON_SITES and getattr(model.cfg, "attn_only", False):
        raise SiteError(f"site {site!r} needs MLPs but this model is attention-only")
    return chosen


def hook_name(site: str, layer: int = 0) -> str:
    """The TransformerLens hook name of a site at a layer.

    Args:
        site: The activation site (a key of :data:`HOOKS`).
        layer: The block index; ignored by global sites.

    Returns:
        The hook name, e.g. ``"blocks.3.hook_resid_pre"``.

    Raises:
        SiteError: ``site`` is not a known site.
    """
    return HOOKS[check_site(site)].format(layer=layer)


def site_shape(model: HookedModel, site: str, n_keys: Optional[int] = None) -> tuple[int, ...]:
    """The per-position shape of an activation at ``site``, without the batch and position axes
    (for ``pattern``, the position is the query's).

    Args:
        model: The hooked model.
        site: The activation site.
        n_keys: For ``pattern``: how many key positions the prompts have.

    Returns:
        ``(n_heads, d_head)`` for ``attn_z``, ``(n_heads, n_keys)`` for ``pattern``, ``(d_mlp,)`` for
        the neuron sites, ``(d_model,)`` otherwise.

    Raises:
        SiteError: ``site`` is ``"pattern"`` and ``n_keys`` is not given (a pattern's size depends
            on the prompts' length).
    """
    cfg = model.cfg
    if site == "attn_z":
        return (cfg.n_heads, cfg.d_head)
    if site in PER_NEURON_SITES:
        return (cfg.d_mlp,)
    if site == "pattern":
        if n_keys is None:
            raise SiteError("'pattern' is indexed by query and key position: its shape needs n_keys, the prompts' "
                            "token count")
        return (cfg.n_heads, n_keys)
    return (cfg.d_model,)


def check_index(name: str, values: Optional[Sequence[int]], size: int) -> list[int]:
    """Validate indices (heads, neurons, positions) against an axis of ``size`` entries.

    Args:
        name: The parameter to name in the error message (``"heads"``, ``"neurons"``, ...).
        values: Indices, negative ones counting from the end, or ``None`` for all of them.
        size: The length of the axis.

    Returns:
        The indices as non-negative ints, in the given order.

    Raises:
        SiteError: An index is not an integer, lies outside ``-size..size - 1``, or is named twice.
    """
    chosen = list(range(size)) if values is None else _integers(name, values)
    for v in chosen:
        if not -size <= v < size:
            raise SiteError(f"{name} {v} is out of range; accepted: 0..{size - 1}")
    resolved = [v % size for v in chosen]
    if len(set(resolved)) != len(resolved):  # [0, 0] or [0, -size]: one unit read or patched twice
        raise SiteError(f"{name} {chosen} names one {name.rstrip('s')} more than once; name each once")
    return resolved


def spread(n: int, k: int) -> list[int]:
    """Evenly spread values of ``range(n)``.

    Args:
        n: The range's length.
        k: How many values; every value when ``k >= n``.

    Returns:
        The values, ascending; the first and the last among them when ``k ≥ 2``, the last alone
        when ``k == 1``.
    """
    if k >= n:
        return list(range(n))
    if k == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def looking_first_at(chosen: list[int], first: Sequence[int]) -> list[int]:
    """As many layers as ``chosen`` (a spread over the depth): ``first``, then the spread's others,
    coarse to fine (:func:`coarse_to_fine`), for the rest.

    Args:
        chosen: The layers a budget affords, ascending.
        first: The layers to include before any other (the first ``len(chosen)`` of them).

    Returns:
        The layers, ascending.
    """
    return sorted(coarse_to_fine(chosen, first)[: len(chosen)])


def coarse_to_fine(layers: list[int], first: Sequence[int] = ()) -> list[int]:
    """``layers`` reordered so that every prefix is spread over them: the last, the first, the
    middle, then the quarters, ... (:func:`spread` of more and more), after ``first``.

    Args:
        layers: The layers, in order.
        first: Layers put ahead of the rest, in their order (they need not be among ``layers``).

    Returns:
        ``first``, then the other layers, reordered.
    """
    order: list[int] = list(dict.fromkeys(first))
    for k in range(1, len(layers) + 1):
        order += [layers[i] for i in spread(len(layers), k) if layers[i] not in order]
    return order
