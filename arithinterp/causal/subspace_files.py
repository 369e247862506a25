"""DAS subspaces in pyvene's files: a :class:`DASResult`'s rotation out as a saved
``IntervenableModel``, and back.

The format is pyvene 0.1.8's (``pyvene/models/intervenable_base.py`` ``save`` / ``load``,
``pyvene/models/interventions.py``): a folder with ``config.json`` (an ``IntervenableConfig``:
``representations`` as lists in ``RepresentationConfig``'s field order — layer, component,
unit, max_number_of_units, low_rank_dimension, …; ``intervention_types``; ``sorted_keys``;
``intervention_dimensions``) and one ``intkey_{key}.bin`` per intervention, the
``torch.save``-d state dict of a ``LowRankRotatedSpaceIntervention``: ``embed_dim``,
``interchange_dim`` and ``rotate_layer.parametrizations.weight.original`` — the weight ``[d, k]``
under torch's orthogonal parametrisation, whose columns are the subspace's orthonormal basis
(pyvene swaps ``base + (source − base) W Wᵀ``, the same map as
:class:`~arithinterp.causal.RotatedSubspace`). The stored tensor is what torch's parametrisation
keeps, so this module builds the same parametrisation to write and read it.

A per-position fit becomes one intervention per position (keys ``…#0``, ``…#1`` in position
order). ``arithinterp_site.json`` beside them maps the site: this package's site and layer,
pyvene's component (:data:`PYVENE_COMPONENTS`: ``resid_post`` → ``block_output``, ``mlp_post`` →
``mlp_activation``, …; the names its model mappings use) and the hook of a TransformerLens
model (``blocks.1.hook_resid_post``), the positions by name, the variable and the IIA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from arithinterp.causal.datasets import InterchangeDataset
from arithinterp.causal.interventions import FixedSubspace, Intervention, PerPosition
from arithinterp.causal.results import DASResult
from arithinterp.causal.scoring import Runs, Site, batch_size, evaluate
from arithinterp.checks import check_belongs
from arithinterp.errors import AnalysisError, ConfigError, ResultFileError, accepted
from arithinterp.types import ByteSize, HookedModel, checked

PathLike = Union[str, Path]
# this package's site -> pyvene's component name (its Hugging Face model mappings, e.g. GPT-2's)
PYVENE_COMPONENTS: dict[str, str] = {
    "resid_pre": "block_input",
    "resid_post": "block_output",
    "mlp_in": "mlp_input",
    "mlp_post": "mlp_activation",
    "mlp_out": "mlp_output",
    "attn_out": "attention_output",
    "attn_z": "head_attention_value_output",
}
# the TransformerLens hook each site is (a pyvene component string that reaches the HookPoint's output)
TL_HOOKS: dict[str, str] = {
    "resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post",
    "mlp_in": "mlp.hook_in", "mlp_pre": "mlp.hook_pre", "mlp_post": "mlp.hook_post", "mlp_out": "hook_mlp_out",
    "attn_out": "hook_attn_out", "attn_z": "attn.hook_z",
}
INTERVENTION_TYPE = "<class 'pyvene.models.interventions.LowRankRotatedSpaceIntervention'>"
SITE_FILE = "arithinterp_site.json"
_PROVENANCE = ("model", "fingerprint", "architecture")  # the model a subspace was fitted on, kept in SITE_FILE
PYVENE_VERSION = "0.1.8"


class _RotateLayer(nn.Module):
    """The shape of pyvene's ``LowRankRotateLayer``: a weight ``[d, k]``."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d, k))


def _parametrised(d: int, k: int) -> Any:  # its weight is computed: typed as the module is not
    return torch.nn.utils.parametrizations.orthogonal(_RotateLayer(d, k))


def pyvene_state(basis: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state dict of a pyvene ``LowRankRotatedSpaceIntervention`` whose subspace is ``basis [d, k]``
    (orthonormal columns)."""
    if basis.ndim != 2 or basis.shape[1] < 1 or basis.shape[1] > basis.shape[0]:
        raise AnalysisError(f"a basis must be [d, k] with 1 <= k <= d, got {tuple(basis.shape)}")
    d, k = (int(n) for n in basis.shape)
    layer = _parametrised(d, k)
    with torch.no_grad():
        layer.weight = basis.detach().float().clone()  # the parametrisation's right inverse stores it
    state = {"embed_dim": torch.tensor(d), "interchange_dim": torch.tensor(d)}
    state.update({f"rotate_layer.{name}": value.detach().clone() for name, value in layer.state_dict().items()})
    return state


def basis_from_state(state: dict) -> torch.Tensor:
    """The orthonormal basis ``[d, k]`` a pyvene ``LowRankRotatedSpaceIntervention`` state dict holds."""
    key = "rotate_layer.parametrizations.weight.original"
    if key not in state:
        raise ResultFileError(f"not a LowRankRotatedSpaceIntervention state: no {key!r} (keys: {sorted(state)})")
    d, k = (int(n) for n in state[key].shape)
    layer = _parametrised(d, k)
    inner = {name.removeprefix("rotate_layer."): value for name, value in state.items()
             if name.startswith("rotate_layer.")}
    layer.load_state_dict(inner)
    with torch.no_grad():
        return layer.weight.detach().clone()


@checked
def write_pyvene(result: DASResult, path: PathLike) -> Path:
    """Write ``result``'s subspace as a pyvene ``IntervenableModel`` save (see the module docstring);
    returns the folder. pyvene reads it with ``IntervenableModel.load(path, model)``: for a model
    family pyvene knows, the component names (``block_output``, …) find the module; for a
    TransformerLens model register its hooks first (``pyvene.type_to_module_mapping[type(model)]``
    and ``type_to_dimension_mapping``, with the hook names ``arithinterp_site.json`` lists).
    ``arithinterp_site.json`` also keeps the fingerprint of the model the subspace was fitted on:
    :func:`read_pyvene` gives it back and :func:`score_subspace` refuses another model.

    Args:
        result: A DAS fit.
        path: The folder to write (``config.json``, ``intkey_*.bin``, ``arithinterp_site.json``).

    Returns:
        The folder.

    Raises:
        AnalysisError: ``result`` is not a DASResult, or its site has no pyvene component.
        ConfigError: The folder cannot be written.
    """
    from arithinterp.outputs import check_writable_dir

    if not isinstance(result, DASResult):
        raise ConfigError(f"result must be a DASResult, got {type(result).__name__}")
    site, _, head = result.site.partition("[")
    if site not in TL_HOOKS:
        raise ConfigError(f"site {site!r} has no pyvene component here; accepted: {accepted(TL_HOOKS)}")
    bases = [result.basis] if result.basis.ndim == 2 else list(result.basis)
    positions = result.position.split("+")
    per_position = result.basis.ndim == 3
    folder = check_writable_dir(path, "write the subspace")
    component = PYVENE_COMPONENTS.get(site)
    if component is None:
        raise ConfigError(f"pyvene has no component for site {site!r}; accepted: {accepted(PYVENE_COMPONENTS)}")
    representations, keys = [], []
    for i, basis in enumerate(bases):
        d, k = (int(n) for n in basis.shape)
        representations.append([result.layer, component, "pos", 1, k, None, None, None, None, None, None, None, None,
                                None])
        key = f"layer_{result.layer}_comp_{component}_unit_pos_nunit_1#{i}"  # pyvene's key for it
        keys.append(key)
        torch.save(pyvene_state(basis), folder / f"intkey_{key}.bin")
    d = int(bases[0].shape[0])
    config = dict(representations=representations, intervention_types=[INTERVENTION_TYPE] * len(bases),
                  mode="parallel", sorted_keys=keys, model_type="None", intervention_dimensions=[d] * len(bases),
                  intervention_constant_sources=[False] * len(bases), transformers_version="4.57.3")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    mapping = dict(format=f"pyvene {PYVENE_VERSION}", site=site, head=int(head.rstrip("]")) if head else None,
                   layer=result.layer, pyvene_component=component,
                   transformer_lens_hook=f"blocks.{result.layer}.{TL_HOOKS[site]}",
                   positions=positions, per_position=per_position, keys=keys, k=result.k, variable=result.variable,
                   iia=result.iia, **{key: result.meta.get(key) for key in _PROVENANCE})
    (folder / SITE_FILE).write_text(json.dumps(mapping, indent=2))
    return folder


@checked
def read_pyvene(path: PathLike, *, site: Optional[str] = None, layer: Optional[int] = None,
                positions: Optional[list] = None) -> tuple[Intervention, Site]:
    """A pyvene save of ``LowRankRotatedSpaceIntervention`` s back as this package's interchange
    (a :class:`FixedSubspace`, or a :class:`PerPosition` of them for several interventions) and
    the :class:`Site` it acts on (from ``arithinterp_site.json``, or from ``site``, ``layer`` and
    ``positions`` for a folder pyvene wrote). The interchange's ``meta`` holds the fingerprint of
    the model it was fitted on (from ``arithinterp_site.json``; a folder pyvene wrote has none),
    which :func:`score_subspace` checks.

    Args:
        path: The pyvene save's folder.
        site: The site, for a folder without ``arithinterp_site.json``.
        layer: The layer, likewise.
        positions: The positions (this package's names), likewise.

    Returns:
        ``(intervention, site)``.

    Raises:
        ResultFileError: No ``config.json``, interventions of another type, a missing
            ``intkey_*.bin``, no interventions, or no site known.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ResultFileError(f"{folder} has no config.json; a pyvene save is config.json + intkey_*.bin")
    config = json.loads((folder / "config.json").read_text())
    types = config.get("intervention_types") or []
    if any("LowRankRotatedSpaceIntervention" not in str(t) for t in types):
        raise ResultFileError(f"{folder}: only LowRankRotatedSpaceIntervention is read, the save holds {types}")
    keys = config.get("sorted_keys") or []
    mapping = json.loads((folder / SITE_FILE).read_text()) if (folder / SITE_FILE).is_file() else {}
    site = site or mapping.get("site")
    layer = layer if layer is not None else mapping.get("layer")
    names = positions or mapping.get("positions")
    if site is None or layer is None or not names:
        raise ResultFileError(f"{folder} has no {SITE_FILE}; pass site=, layer= and positions= (this package's "
                              "names) for a folder pyvene wrote")
    bases = []
    for key in keys:
        file = folder / f"intkey_{key}.bin"
        if not file.is_file():
            raise ResultFileError(f"{folder} lacks {file.name}, which config.json's sorted_keys names")
        bases.append(basis_from_state(torch.load(file, map_location="cpu", weights_only=True)))
    if not bases:
        raise ResultFileError(f"{folder}: config.json names no interventions")
    parts: list[Intervention] = [FixedSubspace(b) for b in bases]
    position: Any = names[0] if len(names) == 1 else list(names)
    position = [int(p) if str(p).lstrip("-").isdigit() else p for p in names] if len(names) > 1 else (
        int(position) if str(position).lstrip("-").isdigit() else position)
    intervention = parts[0] if len(parts) == 1 else PerPosition(parts)
    intervention.meta = {key: mapping[key] for key in _PROVENANCE if mapping.get(key) is not None}
    return intervention, Site(site, int(layer), position, mapping.get("head"))


@checked
def score_subspace(model: HookedModel, pairs: InterchangeDataset, intervention: Intervention, where: Site, *,
                   rows: Optional[torch.Tensor] = None, max_memory: Optional[ByteSize] = None) -> dict:
    """IIA (with its 95% interval and logit difference) of a given subspace on ``pairs``'s held-out
    pairs (``rows``: others), as :func:`~arithinterp.causal.das` scores its fit. A subspace read by
    :func:`read_pyvene` from a fit on another model (another weight fingerprint) is refused.

    Args:
        model: The hooked model.
        pairs: The interchange pairs.
        intervention: The subspace.
        where: The site, layer and position(s) it acts on.
        rows (Int[Tensor, "n"] | None): The pairs to score (default ``pairs.test``).
        max_memory: Bytes one batch may use.

    Returns:
        ``iia``, its interval ``low`` / ``high``, ``logit_diff`` and the pair counts.

    Raises:
        ModelMismatchError: The subspace was fitted on another model.
        SiteError: An invalid site for this model.
    """
    check_belongs(model, "causal.score_subspace", subspace=intervention)
    where.check(model)
    rows = pairs.test if rows is None else rows
    runs = Runs(model, pairs, where, rows, max_memory=max_memory)
    size = batch_size(model, pairs, training=False, max_memory=max_memory)
    sources = runs.source_values(size)
    if runs.stepped:
        size = max(size, runs.eval_size)
    return evaluate(model, pairs, where, intervention, sources, rows, size, runs)
