"""Collecting activations: ``collect(model, prompts, sites, ...)`` → :class:`Activations`.

Only the requested sites and positions are kept: each batch is one forward of the engine
(:func:`arithinterp.engine.run` with reads only), whose slices are copied straight into a
preallocated output (in memory, or a memory-mapped file in disk-backed mode), so memory is the
size of what was asked for plus one batch's forward, not the size of a full cache. The forward
stops after the last layer needed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np
import torch

from arithinterp.checks import check_belongs
from arithinterp import engine
from arithinterp.engine.budget import forward_bytes_per_prompt
from arithinterp import sites as site_lib
from arithinterp.errors import ConfigError, SiteError, accepted
from arithinterp.outputs import check_target, write_folder, writes
from arithinterp.progress import progress_bar
from arithinterp.results import PROVENANCE, build_meta
from arithinterp.tasks.positions import position_labels
from arithinterp.types import NonNegativeInt, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet
    from arithinterp.types import HookedModel

PositionSpec = Union[str, int, Sequence[Union[str, int]]]


@dataclass
class Activations:
    """Activations at some sites, layers and positions for a prompt set.

    ``data[site]`` has shape ``[n_prompts, n_layers, n_positions, *site_shape]`` where
    ``site_shape`` is ``(d_model,)`` for residual and output sites, ``(n_heads, d_head)`` for
    ``attn_z``, ``(d_mlp,)`` for ``mlp_pre`` / ``mlp_post`` and ``(n_heads, n_keys)`` for the
    attention ``pattern``: each collected position is a query, and ``data["pattern"][i, l, j, h, k]``
    is how much head ``h`` at query ``positions[j]`` attends to token ``k`` of the left-padded prompt
    (the answer tokens fed after it follow; a padding key has weight 0). ``layers[i]`` is the model layer of
    index ``i`` on axis 1 (``embed`` has the single layer ``0``), ``positions[j]`` names
    position ``j`` on axis 2 (a position spec such as ``"final"``, ``"a"``, ``"a[0]"`` or an integer
    index as a string; see :meth:`~arithinterp.tasks.PromptSet.locate`).

    Attributes:
        data (dict[str, Float[Tensor, "prompt layer position *site_shape"]]): The activations by site.
        layers: The model layer of each index on axis 1.
        positions: The position spec of each index on axis 2.
        prompts (PromptSet | None): The prompt set they came from (labels for probes).
        meta: How they were collected (sites, batch size, dtype, store).
    """

    data: dict[str, torch.Tensor]
    layers: list[int]
    positions: list[str]
    prompts: Any = None
    meta: dict = field(default_factory=dict)

    def __repr__(self) -> str:  # the tensors' shapes, never their values
        from arithinterp.printing import short_repr

        return short_repr("Activations", {"n_prompts": self.n_prompts if self.data else 0, **self.data,
                                          "layers": self.layers, "positions": self.positions})

    def __getitem__(self, site: str) -> torch.Tensor:
        if site not in self.data:
            raise SiteError(f"site {site!r} was not collected; collected sites: {accepted(self.data)}")
        return self.data[site]

    @property
    def sites(self) -> list[str]:
        """The collected sites, in the order collected."""
        return list(self.data)

    @property
    def n_prompts(self) -> int:
        """The number of prompts (axis 0)."""
        return next(iter(self.data.values())).shape[0]

    def layer_index(self, layer: int) -> int:
        """Where a model layer lies on axis 1.

        Args:
            layer: A collected model layer.

        Returns:
            Its index into :attr:`layers`.

        Raises:
            SiteError: The layer was not collected.
        """
        if layer not in self.layers:
            raise SiteError(f"layer {layer} was not collected; collected layers: {self.layers}")
        return self.layers.index(layer)

    def position_index(self, position: Union[str, int]) -> int:
        """Where a position lies on axis 2.

        Args:
            position: A collected position spec (``"last"`` reads as ``"final"``) or int index.

        Returns:
            Its index into :attr:`positions`.

        Raises:
            SiteError: The position was not collected.
        """
        key = position_labels(position)[0] if isinstance(position, str) else str(position)  # "last" is "final"
        if key not in self.positions:
            raise SiteError(f"position {position!r} was not collected; collected positions: {self.positions}")
        return self.positions.index(key)

    def get(self, site: str, layer: int, position: Union[str, int]) -> torch.Tensor:
        """The activations at one site, layer and position.

        Args:
            site: A collected site.
            layer: A collected model layer.
            position: A collected position spec or int index.

        Returns:
            Float[Tensor, "prompt *site_shape"]: A view into :attr:`data`.

        Raises:
            SiteError: The site, layer or position was not collected.
        """
        return self[site][:, self.layer_index(layer), self.position_index(position)]

    def nbytes(self) -> int:
        """The bytes the activations occupy (in memory or on disk).

        Returns:
            The sum over sites of elements × element size.
        """
        return sum(t.numel() * t.element_size() for t in self.data.values())

    def subset(self, index: Any) -> "Activations":
        """The activations (and prompts) of some of the prompts.

        Args:
            index: Prompt indices ``[k]`` or a boolean mask ``[n_prompts]``, as for a ``PromptSet``.

        Returns:
            A new :class:`Activations` with the selected prompts on axis 0.

        Raises:
            ConfigError: A mask of the wrong length, a non-integer index, or an index out of range.
        """
        index = torch.as_tensor(index)
        n = self.n_prompts
        if index.dtype == torch.bool:
            if index.shape != (n,):
                raise ConfigError(f"a mask must have one entry per prompt ({n}), got shape {tuple(index.shape)}")
        elif index.ndim != 1 or index.is_floating_point():
            raise ConfigError(f"index must be a 1-d tensor of prompt indices or a boolean mask, got {index!r}")
        elif len(index) and not (-n <= int(index.min()) and int(index.max()) < n):
            raise ConfigError(f"prompt indices must lie in [-{n}, {n}), got {int(index.min())} to {int(index.max())}")
        return Activations({site: t[index] for site, t in self.data.items()}, list(self.layers), list(self.positions),
                           None if self.prompts is None else self.prompts[index], dict(self.meta))


@checked
def auto_batch_size(model: HookedModel, seq_len: PositiveInt, returned_bytes: NonNegativeInt, low: PositiveInt = 16,
                    high: PositiveInt = 1024) -> int:
    """Prompts per forward so that the transient memory stays within half of (output + model).

    Args:
        model: The hooked model.
        seq_len: Tokens per prompt.
        returned_bytes: The bytes of what the pass returns (kept in memory beside the model).
        low: The smallest batch size to return.
        high: The largest batch size to return.

    Returns:
        The batch size, in ``low..high``.
    """
    check_belongs(model, "auto_batch_size")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = 0.5 * (returned_bytes + model_bytes)
    return int(min(high, max(low, budget // forward_bytes_per_prompt(model, seq_len))))


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, store: Optional[Path], name: str) -> torch.Tensor:
    if store is None:  # a pattern's padding keys are never written: they stay 0 (a new memory map starts at 0)
        return torch.zeros(shape, dtype=dtype) if name == "pattern" else torch.empty(shape, dtype=dtype)
    from numpy.lib.format import open_memmap

    store.mkdir(parents=True, exist_ok=True)
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}[dtype]
    return torch.from_numpy(open_memmap(store / f"{name}.npy", mode="w+", dtype=np_dtype, shape=shape))


_STORABLE = (torch.float16, torch.float32, torch.float64)  # dtypes numpy can memory-map


def _check_storage(dtype: Any, store: Union[str, Path, None], overwrite: bool) -> Optional[torch.dtype]:
    """Refuse a dtype or store directory that would fail only after the forward passes began."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ConfigError(f"dtype must be a floating torch dtype such as torch.float16, got {dtype!r}")
    if store is None:
        return dtype
    if dtype is not None and dtype not in _STORABLE:
        raise ConfigError(f"dtype {dtype} cannot be stored on disk (numpy has no such type); with store= accepted: "
                          f"{', '.join(map(str, _STORABLE))}, or drop store= to keep {dtype} in memory")
    check_target(store, overwrite=overwrite, what="store", folder=True)
    return dtype


# per-block sites whose activation has positions on dim 1: what a stepped base run reads
_STEPPED_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_z", "mlp_in", "mlp_pre",
                 "mlp_post")


def _stepped_reads(model: HookedModel, tokens: torch.Tensor, targets: list, columns: torch.Tensor) -> Optional[list]:
    """The reads of ``targets`` (``(site, layer, _)``) at ``columns [B, n_pos]`` from a stepped
    base run that computes the prompts' shared prefix (a few-shot example block) once and the last
    block at the read positions only (:func:`arithinterp.engine.steppers.read_last`); ``None``
    where that does not apply (a site outside the blocks, prompts sharing too little, a model
    whose blocks cannot be stepped): the caller runs whole forwards."""
    from arithinterp.engine.steppers import read_last

    if any(site not in _STEPPED_SITES for site, _, _ in targets):
        return None
    T = int(tokens.shape[1])
    n_last = T - int(columns.min())
    if n_last >= T:  # the first position read: no prefix to share
        return None
    names = [site_lib.hook_name(site, layer) for site, layer, _ in targets]
    read = read_last(model, tokens, list(dict.fromkeys(names)), n_last)
    if read is None:
        return None
    rows = torch.arange(tokens.shape[0])[:, None]
    return [read[name][rows, columns - (T - n_last)] for name in names]


@writes
@checked
def collect(
    model: HookedModel,
    prompts: PromptSet,
    sites: Union[str, Sequence[str]] = ("resid_post",),
    *,
    layers: Optional[Sequence[int]] = None,
    positions: PositionSpec = "final",
    batch_size: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    store: Union[str, Path, None] = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Activations:
    """Run ``prompts`` through ``model`` and keep only the requested activations.

    Args:
        model: the hooked model.
        prompts: the prompt set to run.
        sites: site names from :data:`arithinterp.sites.HOOKS` (e.g. ``"resid_post"``, ``"attn_z"``;
            ``"pattern"`` reads the attention pattern of every head from each position as a query).
        layers: layers to keep (default: all; ``embed`` has none).
        positions: one position spec or a list of them, resolved by
            :meth:`~arithinterp.tasks.PromptSet.locate`: ``"final"`` (alias ``"last"``), ``"a"`` /
            ``"b"`` (the operand's last token), ``"a[k]"`` / ``"b[k]"`` (token k of the operand),
            ``"answer[k]"`` (answer token k, read with the true answer fed after the prompt), a
            name shifted by tokens (``"final-2"``), ``"all"``, or an int index into the
            left-padded prompt (same-length prompts only).
        dtype: storage dtype, e.g. ``torch.float16`` to halve memory.
        store: a directory for disk-backed storage (memory-mapped ``.npy`` files) when the
            result does not fit in memory; written whole by the guarded writer
            (:func:`arithinterp.outputs.write_folder`: its files appear when the last batch is in).
        overwrite: replace a ``store`` that holds files.
        batch_size: prompts per forward; by default chosen so that one forward's transient
            memory stays within half of (returned tensors + model), keeping the peak within
            1.5x of what was asked for.
        progress: show a progress bar.

    Returns:
        The activations; ``data[site]`` is ``[n_prompts, n_layers, n_positions, *site_shape]``
        (``data["pattern"]`` is ``[n_prompts, n_layers, n_queries, n_heads, n_keys]``: see
        :class:`Activations`).

    Raises:
        SiteError: An empty prompt set or site list, an unknown site, a layer or position out of
            range, or a batch size below 1.
        ConfigError: A non-floating ``dtype``, or a ``store`` that cannot be written, cannot hold ``dtype`` or
            holds files (without ``overwrite``).
        ModelMismatchError: The prompts were built for another model.
    """
    check_belongs(model, "collect", prompts=prompts)
    if len(prompts) == 0:
        raise SiteError("the prompt set is empty; nothing to collect")
    if batch_size is not None and batch_size < 1:
        raise SiteError(f"batch_size must be a positive integer, got {batch_size}")
    pos, index = prompts.locate(positions, answers=prompts.answer_tokens.shape[1])  # checked before any work
    dtype = _check_storage(dtype, store, overwrite)
    site_names = [sites] if isinstance(sites, str) else list(sites)
    if not site_names:
        raise SiteError(f"sites is empty; accepted sites: {accepted(site_lib.HOOKS)}")
    layer_lists = {s: site_lib.check_layers(model, s, layers) for s in site_names}
    chosen_layers = sorted({layer for s in site_names if s not in site_lib.GLOBAL_SITES
                            for layer in layer_lists[s]}) or [0]
    # answer positions ("answer[k]", "final+1") read the true answer tokens fed after the prompt
    fed = max(0, int(index.max()) + 1 - prompts.tokens.shape[1])
    dtype = dtype or torch.float32
    n = len(prompts)
    n_keys = prompts.tokens.shape[1] + fed  # a pattern's keys: the left-padded prompt, then the answer fed
    # the store is written whole (the guarded writer): its files appear when the last batch is in
    writing = write_folder(store, overwrite=overwrite, what="store") if store is not None else contextlib.nullcontext()
    with writing as folder:
        data = {
            s: _allocate((n, len(layer_lists[s]), len(pos), *site_lib.site_shape(model, s, n_keys)), dtype, folder, s)
            for s in site_names
        }
        if batch_size is None:
            returned = sum(t.numel() * t.element_size() for t in data.values()) if folder is None else 0
            batch_size = auto_batch_size(model, prompts.tokens.shape[1] + fed, returned)
        # what each read fills: (site, layer, layer index)
        targets = [(s, layer, i) for s in site_names for i, layer in enumerate(layer_lists[s])]
        per_layer = [s for s in site_names if s not in site_lib.GLOBAL_SITES]

        batches = [chunk for group in prompts.length_groups() for chunk in group.split(batch_size)]
        with torch.inference_mode():
            for idx in progress_bar(batches, desc="collect", disable=not progress):
                # per-prompt index of each requested position, in unpadded coordinates
                columns = index[idx] - prompts.offset(idx)
                tokens = prompts.unpadded(idx)
                if fed:
                    tokens = torch.cat([tokens, prompts.answer_tokens[idx, :fed].clamp(min=0)], dim=1)

                picks = None if fed else _stepped_reads(model, tokens, targets, columns)
                if picks is None:  # reads only: the engine stops the forward after the deepest layer read
                    reads = [engine.Read(site, layer, columns) for site, layer, _ in targets]
                    picks = engine.run(model, tokens, reads=reads, logits="none").reads
                for (site, _, layer_i), picked in zip(targets, picks):
                    if site == "pattern":  # [batch, query, head, key] over the unpadded keys: after the padding's
                        data[site][idx, layer_i, ..., prompts.offset(idx):] = picked.to(dtype)
                        continue
                    # attn_z may come flat ([batch, pos, n_heads * d_head]) or split into heads
                    data[site][idx, layer_i] = picked.reshape(*picked.shape[:2], *data[site].shape[3:]).to(dtype)
    return Activations(
        data=data,
        layers=chosen_layers if per_layer else [0],
        positions=pos,
        prompts=prompts,
        meta=dict(sites=site_names, batch_size=batch_size, dtype=str(dtype), store=str(store) if store else None,
                  **{k: v for k, v in build_meta(model).items() if k in PROVENANCE}),  # the model they were read on
    )
