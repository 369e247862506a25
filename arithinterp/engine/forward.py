"""Writes and reads as data, run in one forward (in the spirit of pyvene's configs).

A :class:`Write` says *where* (site, layer, positions, heads or neurons) and *what*
(a replacement value, or a function of the current value); a :class:`Read` says what to keep.
:func:`run` applies them in one forward of the model and returns the logits and the reads. It is
the only way the analyses run a model with something changed or read out (the patching sweeps
use the block stepper in :mod:`~arithinterp.engine.stepping`, which goes further).

Gradients: with ``grad=True`` every read is also a point the metric can be differentiated at,
without touching the model's ``requires_grad`` flags, so frozen and half-precision models work at
every layer (a zero tensor that requires grad is added at the read; its gradient is the
activation's).

One module past 500 lines on purpose: writes, reads and their gradients are applied by the same
hooks in one forward, and their order matters.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union, overload

import torch

from arithinterp import sites as site_lib
from arithinterp.checks import check_model, check_tokens
from arithinterp.engine.hooks import forward_with_hooks
from arithinterp.errors import AnalysisError, ConfigError, SiteError

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

# global sites computed after the last block (the final norm's): a read there runs every block
_AFTER_BLOCKS = ("ln_final_scale",)

Value = Union[
    float, torch.Tensor, Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
]


@dataclass(frozen=True)
class Write:
    """Replace part of one activation.

    Attributes:
        site: where, in TransformerLens's vocabulary (``"mlp_post"``).
        layer: the block (``3``).
        positions: ``[B]`` one position per prompt, ``[B, k]`` several, an int (the same position
            in every prompt, negative counting from the end: ``-1`` is the last token of each
            forward, also while generating), or ``None`` for all.
        units: heads (``attn_z``, ``pattern``) or neurons (``mlp_pre``, ``mlp_post``); ``None`` for all.
        value: a number or tensor broadcast to the selected slice ``[B, (k,) (units,) ...]``, or a
            function of that slice returning its replacement (a projection, a helix
            reconstruction, ...) without changing the slice in place.
        source: the same slice read from other prompts (an interchange): ``value`` is then a
            function ``f(base slice, source slice)`` returning the replacement, e.g. a rotated
            subspace of the source swapped into the base (distributed alignment search). Run with
            ``run(..., train=True)`` the logits are differentiable in ``f``'s parameters.
        input_site: with a function ``value``, another site of the same layer computed earlier in the
            same forward (``"mlp_in"`` for ``"mlp_out"``): the function then sees that site's slice
            at the same positions instead of the current value (a transcoder replacing an MLP:
            ``mlp_out := f(mlp_in)``). Positions only, no units.
    """

    site: str
    layer: int = 0
    positions: Union[None, int, torch.Tensor] = None
    units: Optional[Sequence[int]] = None
    value: Value = 0.0
    source: Optional[torch.Tensor] = None
    input_site: Optional[str] = None

    def hook_name(self) -> str:
        """The TransformerLens hook name of the site and layer.

        Returns:
            E.g. ``"blocks.3.mlp.hook_post"``.
        """
        return site_lib.hook_name(self.site, self.layer)

    def apply(self, activation: torch.Tensor, input_activation: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The activation with the slice replaced.

        With one position per prompt (``positions`` ``[B]`` or an int) the value sees the slice
        without a position axis, ``[B, (units,) ...]``, as a :class:`Read` returns it.

        Args:
            activation (Float[Tensor, "batch pos ..."]): The activation at the hook (patterns
                ``[batch, head, query, key]``).
            input_activation (Float[Tensor, "batch pos ..."] | None): The :attr:`input_site`
                activation in this forward, sliced the same way; ``None`` without an input site.

        Returns:
            Float[Tensor, "batch pos ..."]: A copy of ``activation`` with the slice replaced. A write
            of the whole activation (no positions, no units) keeps no autograd link to the activation
            it replaces, so a backward does not run through what computed it (a frozen pattern's
            queries and keys, an MLP whose output a transcoder replaces).

        Raises:
            AnalysisError: A source without a function value, a source slice of another shape, or a
                value that does not broadcast to the slice.
        """
        whole = self.positions is None and self.units is None
        out = torch.empty_like(activation) if whole else activation.clone()
        positions = _positions_tensor(self.positions, out.shape[0], out.device)
        index = _slice_index(self.site, out, positions, self.units)
        current = (activation if input_activation is None else input_activation)[index]
        single = positions is not None and positions.ndim == 1
        k_dim = 2 if self.site == "pattern" and self.units is not None else 1
        view = current.squeeze(k_dim) if single else current
        if self.source is not None:
            if not callable(self.value):
                raise AnalysisError("an intervention with a source needs value = f(base, source), got a constant")
            source = self.source.to(out.device)
            if source.shape != view.shape:
                raise AnalysisError(f"the source slice has shape {tuple(source.shape)} but the intervened slice is "
                                    f"{tuple(view.shape)}; read the source at the same site, layer and positions")
            new = self.value(view, source)  # type: ignore[call-arg]
        else:
            new = self.value(view) if callable(self.value) else self.value  # type: ignore[call-arg]
        try:
            new = torch.as_tensor(new, device=out.device).to(out.dtype).expand_as(view)
        except (RuntimeError, TypeError, ValueError):
            shape = tuple(getattr(new, "shape", ())) if hasattr(new, "shape") else type(new).__name__
            made = "the value function returned" if callable(self.value) else "the value has"
            raise AnalysisError(
                f"intervention at {self.site} layer {self.layer}: {made} shape {shape}, which does not broadcast to "
                f"the slice it replaces, {tuple(view.shape)} ([batch, (positions,) (units,) ...]); give a number, "
                "a tensor of that shape (or one that broadcasts to it), or a function returning one"
            ) from None
        out[index] = new.unsqueeze(k_dim) if single else new
        return out.reshape(activation.shape)


@dataclass(frozen=True)
class Read:
    """Keep one activation: ``[B, T, ...]``, or ``[B, ...]`` / ``[B, k, ...]`` at ``positions``.

    Attributes:
        site: Where, in TransformerLens's vocabulary (``"resid_post"``).
        layer: The block.
        positions: ``[B]`` or an int (one position per prompt, negative counting from the end),
            ``[B, k]`` (several), or ``None`` for all.
    """

    site: str
    layer: int = 0
    positions: Union[None, int, torch.Tensor] = None

    def hook_name(self) -> str:
        """The TransformerLens hook name of the site and layer.

        Returns:
            E.g. ``"blocks.3.hook_resid_post"``.
        """
        return site_lib.hook_name(self.site, self.layer)

    def take(self, activation: torch.Tensor) -> torch.Tensor:
        """The kept part of an activation.

        Args:
            activation (Float[Tensor, "batch pos ..."]): The activation at the hook.

        Returns:
            ``activation`` itself without positions, ``[batch, ...]`` with one position per prompt,
            ``[batch, k, ...]`` with several.
        """
        if self.positions is None:
            return activation
        rows = torch.arange(activation.shape[0], device=activation.device)
        pos = _positions_tensor(self.positions, activation.shape[0], activation.device)
        if self.site == "pattern":
            activation = activation.transpose(1, 2)  # [B, Tq, H, Tk]
        return activation[rows[:, None], pos[:, None]].squeeze(1) if pos.ndim == 1 else activation[rows[:, None], pos]


@dataclass(frozen=True)
class Output:
    """What :func:`run` returns.

    Attributes:
        logits (Float[Tensor, "batch vocab"] | None): At the final position (``[batch, k, vocab]``
            at the last ``k``, ``[batch, pos, vocab]`` for all), or ``None``.
        reads (list[Tensor]): One tensor per :class:`Read`, in order.
        grads (list[Tensor | None] | None): The reads' gradients of the metric, when one was given.
    """

    logits: Optional[torch.Tensor]
    reads: list
    grads: Optional[list] = None


def heads_split(site: str, n_heads: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """Wrap ``fn`` so it sees ``attn_z`` as ``[B, T, H, d_head]`` (bridges fire it flat)."""

    def wrapped(activation: torch.Tensor) -> torch.Tensor:
        if site == "attn_z" and activation.ndim == 3:
            out = fn(activation.unflatten(-1, (n_heads, -1)))
            return out.flatten(-2) if out.ndim == 4 and out.shape[:2] == activation.shape[:2] else out
        return fn(activation)

    return wrapped


@overload
def _positions_tensor(positions: None, B: int, device) -> None: ...


@overload
def _positions_tensor(positions: Union[int, torch.Tensor], B: int, device) -> torch.Tensor: ...


@overload
def _positions_tensor(positions: Union[None, int, torch.Tensor], B: int, device) -> Optional[torch.Tensor]: ...


def _positions_tensor(positions: Union[None, int, torch.Tensor], B: int, device) -> Optional[torch.Tensor]:
    """Positions as a tensor on ``device``: an int becomes the same position for all ``B`` prompts."""
    if positions is None:
        return None
    if not isinstance(positions, (bool, torch.Tensor)) and hasattr(positions, "__index__"):
        return torch.full((B,), operator.index(positions), dtype=torch.long, device=device)  # numpy ints too
    if isinstance(positions, torch.Tensor) and (positions.is_floating_point() or positions.dtype == torch.bool):
        raise SiteError(f"positions must hold integer token indices, got a {positions.dtype} tensor; "
                        "pass a long tensor [B] or [B, k] (or one int)")
    if not isinstance(positions, torch.Tensor) or positions.ndim not in (1, 2) or positions.shape[0] != B:
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise AnalysisError(f"positions must be None, an int, [B] or [B, k] with B = {B} prompts, got {shape}")
    return positions.to(device)


def _slice_index(site: str, activation: torch.Tensor, positions: Optional[torch.Tensor], units) -> tuple:
    B = activation.shape[0]
    rows = torch.arange(B, device=activation.device)
    unit_index = None if units is None else torch.as_tensor(list(units), device=activation.device)
    if site == "pattern":  # [B, H, Tq, Tk]
        if positions is None:
            return (slice(None), slice(None) if unit_index is None else unit_index)
        pos = positions.to(activation.device)
        pos = pos[:, None] if pos.ndim == 1 else pos
        if unit_index is None:
            return (rows[:, None], slice(None), pos)
        return (rows[:, None, None], unit_index[None, :, None], pos[:, None, :])
    if positions is None:
        return (slice(None), slice(None), unit_index) if unit_index is not None else (slice(None),)
    pos = positions.to(activation.device)
    pos = pos[:, None] if pos.ndim == 1 else pos
    if unit_index is None:
        return (rows[:, None], pos)
    return (rows[:, None, None], pos[:, :, None], unit_index[None, None, :])


def run(
    model: HookedModel,
    tokens: torch.Tensor,
    writes: Sequence[Write] = (),
    reads: Sequence[Read] = (),
    *,
    logits: Union[str, int] = "final",
    metric: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    train: bool = False,
) -> Output:
    """One forward with writes applied and activations read.

    Args:
        model: The hooked model.
        tokens (Int[Tensor, "batch pos"]): The prompts.
        writes: What to replace, applied in order.
        reads: What to keep.
        logits: ``"final"`` (``[batch, vocab]``, float32, float64 for a float64 model; the
            unembedding runs on the final position alone), an int ``k`` (``[batch, k, vocab]`` at
            the last ``k`` positions, teacher-forced answers: the unembedding runs on those alone), ``"all"``
            (``[batch, pos, vocab]``) or ``"none"`` (the forward stops after the last layer any read
            or intervention needs and never runs the unembedding).
        metric: ``f(final logits [batch, vocab]) -> [batch]``; the reads' gradients of
            ``metric(...).sum()`` are returned too. The model's parameters are left as they are
            (frozen models work).
        train: Keep the autograd graph and return the logits attached to it, so a loss on them can
            be differentiated in the writes' own parameters (with
            ``torch.autograd.grad(loss, those parameters)``: the model's weights and their ``.grad``
            are never touched). With ``logits="none"`` no logits are built; what the writes saw
            stays attached to the graph.

    Returns:
        The logits, the reads and, with a metric, their gradients.

    Raises:
        SiteError: An unknown site, a layer, position, head or neuron out of range, units at a site
            without units, or a read that never fired.
        ConfigError: An invalid ``logits``.
        AnalysisError: An object that is not a Write or Read,
            ``train`` with a metric, a metric that does not depend on the reads, or
            non-finite logits.
    """
    check_model(model, "engine.run")
    check_tokens(model, tokens)
    T = int(tokens.shape[-1])
    # an int: that many last positions (a bool is no count)
    last: Optional[int] = logits if isinstance(logits, int) and not isinstance(logits, bool) else None
    if not (logits in ("final", "all", "none") or (last is not None and 1 <= last <= T)):
        raise ConfigError(f"logits must be 'final', 'all', 'none' or a number of last positions 1..{T}, "
                          f"got {logits!r}")
    several = logits == "all" or last is not None  # logits [B, k or T, V] come back
    if logits in ("final", "none"):  # "none" with a metric still scores the final position
        last = 1
    for item in (*writes, *reads):
        if not isinstance(item, (Write, Read)):
            raise AnalysisError(f"writes and reads must be Write and Read objects, got "
                                f"{type(item).__name__}")
        site_lib.check_layers(model, item.site, [item.layer])
        positions = _positions_tensor(item.positions, int(tokens.shape[0]), "cpu")
        if positions is not None and positions.numel() and not (
            -T <= int(positions.min()) and int(positions.max()) < T
        ):
            raise SiteError(
                f"{item.site} positions {positions.min()}..{positions.max()} fall outside prompts of {T} tokens; "
                f"accepted: {-T}..{T - 1}"
            )
        if isinstance(item, Write) and item.input_site is not None:
            site_lib.check_site(item.input_site)
            if not callable(item.value) or item.units is not None or item.input_site in site_lib.GLOBAL_SITES:
                raise SiteError(
                    f"an intervention with input_site={item.input_site!r} needs a function value, no units, and a "
                    f"per-layer input site; got value={type(item.value).__name__}, units={item.units}"
                )
        units = getattr(item, "units", None)
        if units is not None:
            size = int(model.cfg.n_heads) if item.site in ("attn_z", "pattern") else int(model.cfg.d_mlp or 0)
            if item.site not in ("attn_z", "pattern", "mlp_pre", "mlp_post"):
                raise SiteError(
                    f"units (heads or neurons) apply to attn_z, pattern, mlp_pre and mlp_post, not {item.site!r}"
                )
            site_lib.check_index("head" if item.site in ("attn_z", "pattern") else "neuron", list(units), size)
    grad = metric is not None
    if train and grad:
        raise AnalysisError("train=True returns differentiable logits: it takes no metric")
    hooks, kept, probes, takes = intervention_hooks(model, writes, reads, grad)
    stop = None
    if logits == "none" and not grad:
        items = (*writes, *reads)
        deepest = max((item.layer for item in items if item.site not in site_lib.GLOBAL_SITES), default=0)
        after_blocks = any(item.site in _AFTER_BLOCKS for item in items)
        stop = None if after_blocks or deepest + 1 >= site_lib.n_layers(model) else deepest + 1
    context = torch.enable_grad() if grad or train else torch.inference_mode()
    with context:
        # only the logits used are built: none (the forward stops before the unembedding, or after
        # the deepest block needed), the final position's, or every position's for "all"
        out = forward_with_hooks(
            model, tokens, hooks, return_type="logits" if logits != "none" or grad else None, stop_at_layer=stop,
            last=last,
        )
        if out is not None:  # half precision scored in float32; a float64 model keeps its precision
            out = out.to(torch.promote_types(out.dtype, torch.float32))
        final = None if out is None else out[:, -1]
        if train:
            if out is not None and not torch.isfinite(out.detach()).all():
                raise AnalysisError("the model's logits are not finite (NaN or inf) under these writes")
            return Output(out if several else final, kept)
        if final is not None and not torch.isfinite(final).all():
            raise AnalysisError(
                "the model's logits are not finite (NaN or inf): its weights or activations are broken, "
                "or an intervention wrote non-finite values; every number computed from them would be NaN"
            )
        grads = None
        if grad:
            assert final is not None
            value = metric(final)
            if not value.requires_grad:
                raise AnalysisError("the metric does not depend on the reads' activations; nothing to differentiate")
            used = [p for p in probes if p is not None]
            found = torch.autograd.grad(value.sum(), used, allow_unused=True)
            grads, it = [], iter(found)
            for read, probe in zip(reads, probes):
                g = next(it) if probe is not None else None
                grads.append(None if g is None else takes[reads.index(read)](g))
            final = final.detach()
            kept = [k.detach() if k is not None else None for k in kept]
    if any(k is None for k in kept):
        missing = [r.hook_name() for r, k in zip(reads, kept) if k is None]
        raise SiteError(f"these reads never fired (not computed by this model): {missing}")
    if several and out is not None:
        return Output(out.detach(), kept, grads)
    return Output(final if logits == "final" else None, kept, grads)



def intervention_hooks(model: HookedModel, writes: Sequence[Write], reads: Sequence[Read],
                       grad: bool = False) -> tuple[list, list, list, list]:
    """The TransformerLens hooks that apply ``writes`` and keep ``reads`` (checked already).

    Args:
        model: The hooked model.
        writes: What to replace, applied in order.
        reads: What to keep.
        grad: Add a differentiable zero at each read (its gradient is the read's).

    Returns:
        ``(hooks, kept, probes, takes)``: ``(hook name, fn)`` pairs; the list the reads fill, in
        order, as the hooks fire; the probes added at the reads (with ``grad``); and each read's
        slicing function.
    """
    kept: list = [None] * len(reads)
    probes: list = [None] * len(reads)
    hooks: list = []
    n_heads = int(model.cfg.n_heads)
    inputs: dict = {}  # input-site hook name -> its activation in this forward
    for intervention in writes:
        if intervention.input_site is not None:
            name = site_lib.hook_name(intervention.input_site, intervention.layer)

            def stash(activation, hook=None, name=name):
                inputs[name] = activation
                return activation

            hooks.append((name, stash))

            def replace(activation, hook=None, intervention=intervention, name=name):
                if name not in inputs:
                    raise SiteError(f"the input site {name} had not fired before {intervention.hook_name()}; "
                                    "an input site must be computed earlier in the same block")
                return intervention.apply(activation, inputs[name])

            hooks.append((intervention.hook_name(), replace))
            continue
        apply = heads_split(intervention.site, n_heads, intervention.apply)
        hooks.append((intervention.hook_name(), lambda activation, hook=None, apply=apply: apply(activation)))
    takes = [heads_split(read.site, n_heads, read.take) for read in reads]
    for i, read in enumerate(reads):

        def keep(activation, hook=None, i=i):
            if grad:  # a differentiable point at the read, whatever the parameters' flags
                probes[i] = torch.zeros_like(activation, dtype=torch.float32, requires_grad=True)
                activation = activation + probes[i].to(activation.dtype)
            kept[i] = takes[i](activation)
            return activation

        hooks.append((read.hook_name(), keep))
    return hooks, kept, probes, takes


def mean_activation(activations: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The one definition of a *mean ablation* value.

    ``activations [N, T, ...]`` of a reference prompt set in the left-padded frame, with each
    prompt's unpadded length in ``lengths [N]`` (``None``: all ``T``). The mean is taken per
    position counted from the end of the prompt (the token roles of a template line up there:
    the final token, the ``=``, the second operand ...), over the reference prompts that have that
    position. Every analysis that mean-ablates (patching, neurons, circuits) uses this.

    Args:
        activations (Float[Tensor, "prompt pos ..."]): A reference prompt set's activations in the
            left-padded frame.
        lengths (Int[Tensor, "prompt"] | None): Each prompt's unpadded length; ``None``: all ``pos``.

    Returns:
        Float[Tensor, "pos ..."]: The mean per position, in the same right-aligned frame (float32).

    Raises:
        AnalysisError: ``activations`` has fewer than two axes.
    """
    if activations.ndim < 2:
        raise AnalysisError(f"activations must be [N, T, ...], got shape {tuple(activations.shape)}")
    N, T = activations.shape[:2]
    if lengths is None:
        return activations.float().mean(0)
    first_pos = T - lengths.to(activations.device)
    present = torch.arange(T, device=activations.device)[None, :] >= first_pos[:, None]  # [N, T]
    weights = present.float().reshape(N, T, *[1] * (activations.ndim - 2))
    count = weights.sum(0).clamp_min(1)
    return (activations.float() * weights).sum(0) / count


class RunningMean:
    """:func:`mean_activation` over reference prompts that arrive in batches, in constant memory.

    ``add(activations [n, T_b, ...], lengths [n] or None)`` takes one batch in its own left-padded
    frame (``None``: every prompt has all ``T_b`` positions); batches of different widths line up
    from the end. :meth:`value` is ``[T, ...]`` (``T`` the widest batch), right-aligned, float32:
    the mean per position counted from the prompt's end over the prompts that have that position,
    as :func:`mean_activation` gives for all the batches at once.
    """

    def __init__(self) -> None:
        self.total: Optional[torch.Tensor] = None  # [T, ...] sums
        self.count: Optional[torch.Tensor] = None  # [T] prompts that have each position

    def add(self, activations: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> "RunningMean":
        """Take one batch of reference activations.

        Args:
            activations (Float[Tensor, "prompt pos ..."]): The batch, in its own left-padded frame.
            lengths (Int[Tensor, "prompt"] | None): Each prompt's unpadded length; ``None``: all ``pos``.

        Returns:
            This running mean.

        Raises:
            AnalysisError: ``activations`` has fewer than two axes, or trailing axes unlike the
                batches added so far.
        """
        if activations.ndim < 2:
            raise AnalysisError(f"activations must be [N, T, ...], got shape {tuple(activations.shape)}")
        N, T = activations.shape[:2]
        if lengths is None:
            present = torch.ones(N, T, dtype=torch.bool, device=activations.device)
        else:
            first_pos = T - lengths.to(activations.device)
            present = torch.arange(T, device=activations.device)[None, :] >= first_pos[:, None]
        weights = present.float().reshape(N, T, *[1] * (activations.ndim - 2))
        total, count = (activations.float() * weights).sum(0), present.sum(0)
        if self.total is None or self.count is None:  # the first batch (both are set together)
            self.total, self.count = total, count
            return self
        if self.total.shape[1:] != total.shape[1:]:
            raise AnalysisError(f"activations of shape [N, T, {', '.join(map(str, total.shape[1:]))}] "
                                "do not match earlier batches' "
                                f"[N, T, {', '.join(map(str, self.total.shape[1:]))}]")
        width = max(T, self.total.shape[0])
        self.total = _left_pad(self.total, width) + _left_pad(total.to(self.total.device), width)
        self.count = _left_pad(self.count, width) + _left_pad(count.to(self.count.device), width)
        return self

    def value(self) -> torch.Tensor:
        """The mean so far.

        Returns:
            Float[Tensor, "pos ..."]: Right-aligned, ``pos`` the widest batch's width.

        Raises:
            AnalysisError: No batch was added.
        """
        if self.total is None or self.count is None:
            raise AnalysisError("no activations were added; the mean of nothing is undefined")
        return self.total / self.count.clamp_min(1).reshape(-1, *[1] * (self.total.ndim - 1))


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [T, ...]`` padded with zeros at the front to ``[width, ...]`` (frames are right-aligned)."""
    return x if x.shape[0] == width else torch.cat([x.new_zeros(width - x.shape[0], *x.shape[1:]), x])
