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
from typing import Annotated, Any, Literal, Optional, Union

import torch
from pydantic import Field
from torch import nn

from arithinterp.causal.datasets import InterchangeDataset
from arithinterp.causal.interventions import FixedSubspace, Intervention, PerPosition
from arithinterp.causal.results import DASResult
from arithinterp.causal.scoring import Runs, Site, batch_size, evaluate
from arithinterp.checks import check_belongs
from arithinterp.errors import AnalysisError, ConfigError, FormatError, ModelMismatchError, ResultFileError, accepted
from arithinterp.outputs import write_file, write_folder, writes
from arithinterp.schemas import (
    Count, Digest, Fingerprint, Index, Schema, check_tensor, file_sha256, read_json, read_pickle, validate,
)
from arithinterp.types import ByteSize, HookedModel, IndexList, checked

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


@writes
@checked
def write_pyvene(result: DASResult, path: PathLike, *, overwrite: bool = False) -> Path:
    """Write ``result``'s subspace as a pyvene ``IntervenableModel`` save (see the module docstring);
    returns the folder. pyvene reads it with ``IntervenableModel.load(path, model)``: for a model
    family pyvene knows, the component names (``block_output``, …) find the module; for a
    TransformerLens model register its hooks first (``pyvene.type_to_module_mapping[type(model)]``
    and ``type_to_dimension_mapping``, with the hook names ``arithinterp_site.json`` lists).
    ``arithinterp_site.json`` also keeps the fingerprint of the model the subspace was fitted on:
    :func:`read_pyvene` gives it back and :func:`score_subspace` refuses another model.

    Args:
        result: A DAS fit.
        path: The folder to write (``config.json``, ``intkey_*.bin``, ``arithinterp_site.json``), whole, by
            :func:`arithinterp.outputs.write_folder`.
        overwrite: Replace a folder that holds files.

    Returns:
        The folder.

    Raises:
        AnalysisError: ``result`` is not a DASResult, or its site has no pyvene component.
        ConfigError: The folder cannot be written, or holds files and ``overwrite`` is false.
    """
    if not isinstance(result, DASResult):
        raise ConfigError(f"result must be a DASResult, got {type(result).__name__}")
    site, _, head = result.site.partition("[")
    if site not in TL_HOOKS:
        raise ConfigError(f"site {site!r} has no pyvene component here; accepted: {accepted(TL_HOOKS)}")
    bases = [result.basis] if result.basis.ndim == 2 else list(result.basis)
    positions = result.position.split("+")
    per_position = result.basis.ndim == 3
    component = PYVENE_COMPONENTS.get(site)
    if component is None:
        raise ConfigError(f"pyvene has no component for site {site!r}; accepted: {accepted(PYVENE_COMPONENTS)}")
    representations, keys, states = [], [], {}
    for i, basis in enumerate(bases):
        d, k = (int(n) for n in basis.shape)
        representations.append([result.layer, component, "pos", 1, k, None, None, None, None, None, None, None, None,
                                None])
        key = f"layer_{result.layer}_comp_{component}_unit_pos_nunit_1#{i}"  # pyvene's key for it
        keys.append(key)
        states[f"intkey_{key}.bin"] = pyvene_state(basis)
    d = int(bases[0].shape[0])
    config = dict(representations=representations, intervention_types=[INTERVENTION_TYPE] * len(bases),
                  mode="parallel", sorted_keys=keys, model_type="None", intervention_dimensions=[d] * len(bases),
                  intervention_constant_sources=[False] * len(bases), transformers_version="4.57.3")
    config_text = json.dumps(config, indent=2)
    with write_folder(path, overwrite=overwrite, what="path") as folder:
        digests = {}
        for name, state in states.items():
            # pyvene's own format is a torch pickle; written through the guarded writer like every file
            write_file(folder / name, lambda tmp, state=state: torch.save(state, tmp), overwrite=False)
            digests[name] = file_sha256(folder / name)
        write_file(folder / "config.json", config_text, overwrite=False)
        digests["config.json"] = file_sha256(folder / "config.json")
        mapping = dict(format=f"pyvene {PYVENE_VERSION}", site=site, head=int(head.rstrip("]")) if head else None,
                       layer=result.layer, pyvene_component=component,
                       transformer_lens_hook=f"blocks.{result.layer}.{TL_HOOKS[site]}",
                       positions=positions, per_position=per_position, keys=keys, k=result.k,
                       variable=result.variable, iia=result.iia, d=d, sha256=digests,
                       **{key: result.meta.get(key) for key in _PROVENANCE})
        write_file(folder / SITE_FILE, json.dumps(mapping, indent=2), overwrite=False)
    return Path(path).expanduser()


class PyveneConfig(Schema):
    """pyvene's ``config.json`` (an ``IntervenableConfig``): the fields read here."""

    representations: Annotated[list[list[Any]], Field(min_length=1)]
    intervention_types: list[str]
    sorted_keys: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.#-]+$")]]  # file name parts: no path separators
    intervention_dimensions: Optional[list[Count]] = None


class Representation(Schema):
    """One entry of ``representations``: the fields of pyvene's ``RepresentationConfig`` read here."""

    layer: Index
    component: str
    unit: str
    max_number_of_units: Count
    low_rank_dimension: Count


class SiteMapping(Schema):
    """``arithinterp_site.json``: where the subspace acts and the model it was fitted on."""

    site: Literal[tuple(TL_HOOKS)]  # type: ignore[valid-type]
    head: Optional[Index] = None
    layer: Index
    positions: Annotated[list[Union[str, int]], Field(min_length=1)]
    per_position: bool = False
    keys: Optional[list[str]] = None
    k: Optional[Count] = None
    d: Optional[Count] = None
    variable: Optional[str] = None
    iia: Optional[Annotated[float, Field(ge=0, le=1)]] = None
    sha256: Optional[dict[str, Digest]] = None
    model: Optional[str] = None
    fingerprint: Optional[Fingerprint] = None
    architecture: Optional[dict[str, Any]] = None


_REPRESENTATION = ("layer", "component", "unit", "max_number_of_units", "low_rank_dimension")
_WEIGHT = "rotate_layer.parametrizations.weight.original"


def _read_basis(file: Path, d: Optional[int], k: int) -> torch.Tensor:
    """The orthonormal basis ``[d, k]`` an ``intkey_*.bin`` holds, checked against the config's widths."""
    state = read_pickle(file, what="a pyvene intervention state (torch.save of a state dict)")
    if not isinstance(state, dict) or _WEIGHT not in state:
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise FormatError(f"{file}: not a LowRankRotatedSpaceIntervention state: no {_WEIGHT!r} (holds {keys})")
    weight = check_tensor(file, _WEIGHT, state[_WEIGHT], (d, k))
    if weight.shape[0] < k:
        raise FormatError(f"{file}: {_WEIGHT!r} is {list(weight.shape)}: a {k}-dimensional subspace needs at least "
                          f"{k} rows")
    for name in ("embed_dim", "interchange_dim"):
        value = state.get(name)
        if isinstance(value, torch.Tensor) and (value.numel() != 1 or int(value) != weight.shape[0]):
            raise FormatError(f"{file}: {name!r} is {value.tolist()}, not the weight's {weight.shape[0]} rows")
    try:
        basis = basis_from_state(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        raise FormatError(f"{file}: the rotation's state does not load ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''})") from None
    return check_tensor(file, "the basis it holds", basis, tuple(weight.shape))


@checked
def read_pyvene(path: PathLike, *, site: Optional[str] = None, layer: Optional[int] = None,
                positions: Optional[list] = None) -> tuple[Intervention, Site]:
    """A pyvene save of ``LowRankRotatedSpaceIntervention`` s back as this package's interchange
    (a :class:`FixedSubspace`, or a :class:`PerPosition` of them for several interventions) and
    the :class:`Site` it acts on (from ``arithinterp_site.json``, or from ``site``, ``layer`` and
    ``positions`` for a folder pyvene wrote). The interchange's ``meta`` holds the fingerprint of
    the model it was fitted on (from ``arithinterp_site.json``; a folder pyvene wrote has none),
    which :func:`score_subspace` checks.

    Every file is checked against its declared schema before anything is built (:class:`PyveneConfig`,
    :class:`SiteMapping`, and each ``.bin`` read with ``weights_only=True``: a floating, finite weight of
    the widths the config names). A folder this package wrote records each file's sha256 and the
    model's fingerprint: a file changed by hand, or a model named without its fingerprint, is refused.

    Args:
        path: The pyvene save's folder.
        site: The site, for a folder without ``arithinterp_site.json``.
        layer: The layer, likewise.
        positions: The positions (this package's names), likewise.

    Returns:
        ``(intervention, site)``.

    Raises:
        ResultFileError: No ``config.json``, or no site known.
        FormatError: A file that breaks its schema (damaged, truncated, of the wrong type, widths that
            disagree, a pickle of anything but tensors), changed after it was written, or a model named
            without its fingerprint; the message names the file and the field.
    """
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ResultFileError(f"{folder} has no config.json; a pyvene save is config.json + intkey_*.bin")
    config = validate(PyveneConfig, read_json(config_file, "pyvene's config.json"), config_file,
                      "pyvene's IntervenableConfig")
    if any("LowRankRotatedSpaceIntervention" not in t for t in config.intervention_types):
        raise FormatError(f"{config_file}: field 'intervention_types': only LowRankRotatedSpaceIntervention is "
                          f"read, the save holds {config.intervention_types}")
    n = len(config.sorted_keys)
    if not n or len(config.intervention_types) != n or len(config.representations) != n:
        raise FormatError(f"{config_file}: fields 'representations', 'intervention_types' and 'sorted_keys' should "
                          f"have one entry per intervention (at least one), got {len(config.representations)}, "
                          f"{len(config.intervention_types)} and {n}")
    if config.intervention_dimensions is not None and len(config.intervention_dimensions) != n:
        raise FormatError(f"{config_file}: field 'intervention_dimensions' should have {n} entries, got "
                          f"{len(config.intervention_dimensions)}")
    representations = [validate(Representation, dict(zip(_REPRESENTATION, entry)), config_file,
                                f"representations[{i}]") for i, entry in enumerate(config.representations)]
    mapping = None
    if (folder / SITE_FILE).is_file():
        mapping = validate(SiteMapping, read_json(folder / SITE_FILE, SITE_FILE), folder / SITE_FILE)
        _check_mapping(folder, mapping, config.sorted_keys)
    site = site or (mapping.site if mapping else None)
    layer = layer if layer is not None else (mapping.layer if mapping else None)
    names = positions or (mapping.positions if mapping else None)
    if site is None or layer is None or not names:
        raise ResultFileError(f"{folder} has no {SITE_FILE}; pass site=, layer= and positions= (this package's "
                              "names) for a folder pyvene wrote")
    bases = []
    for i, (key, representation) in enumerate(zip(config.sorted_keys, representations)):
        file = folder / f"intkey_{key}.bin"
        if not file.is_file():
            raise FormatError(f"{folder} lacks {file.name}, which config.json's sorted_keys names")
        d = config.intervention_dimensions[i] if config.intervention_dimensions else (mapping.d if mapping else None)
        bases.append(_read_basis(file, d, representation.low_rank_dimension))
    if len({int(b.shape[0]) for b in bases}) != 1:
        raise FormatError(f"{config_file}: the interventions act on different widths "
                          f"{sorted({int(b.shape[0]) for b in bases})}; one site has one width")
    parts: list[Intervention] = [FixedSubspace(b) for b in bases]
    position: Any = [int(p) if str(p).lstrip("-").isdigit() else p for p in names] if len(names) > 1 else (
        int(names[0]) if str(names[0]).lstrip("-").isdigit() else names[0])
    intervention = parts[0] if len(parts) == 1 else PerPosition(parts)
    provenance = mapping.model_dump() if mapping else {}
    intervention.meta = {key: provenance[key] for key in _PROVENANCE if provenance.get(key) is not None}
    return intervention, Site(site, int(layer), position, mapping.head if mapping else None)


def _check_mapping(folder: Path, mapping: SiteMapping, keys: list[str]) -> None:
    """``arithinterp_site.json`` agrees with ``config.json``, names the model with its fingerprint, and the
    files it records are the bytes it recorded."""
    file = folder / SITE_FILE
    if mapping.keys is not None and mapping.keys != keys:
        raise FormatError(f"{file}: field 'keys' is {mapping.keys}, but config.json's sorted_keys are {keys}; the "
                          "two files come from different saves")
    wanted = len(mapping.positions) if mapping.per_position else 1
    if len(keys) != wanted:
        raise FormatError(f"{file}: fields 'positions' and 'per_position' call for {wanted} intervention(s), "
                          f"config.json holds {len(keys)}")
    if (mapping.model is not None or mapping.architecture is not None) and mapping.fingerprint is None:
        raise FormatError(f"{file}: field 'fingerprint' is missing: the file names the model {mapping.model!r} it "
                          "was fitted on but not its weights' fingerprint, so the check that the subspace is used on "
                          "that model would be skipped; write it again with write_pyvene")
    for name, digest in (mapping.sha256 or {}).items():
        member = folder / name
        if member.parent != folder or not member.is_file() or file_sha256(member) != digest:
            raise FormatError(f"{file}: field 'sha256' records {name!r}, but {member} is missing or was changed "
                              "after it was written; write the subspace again with write_pyvene")


@checked
def score_subspace(model: HookedModel, pairs: InterchangeDataset, intervention: Intervention, where: Site, *,
                   rows: Optional[IndexList] = None, max_memory: Optional[ByteSize] = None) -> dict:
    """IIA (with its 95% interval and logit difference) of a given subspace on ``pairs``'s held-out
    pairs (``rows``: others), as :func:`~arithinterp.causal.das` scores its fit. A subspace read by
    :func:`read_pyvene` from a fit on another model (another weight fingerprint) is refused.

    Args:
        model: The hooked model.
        pairs: The interchange pairs.
        intervention: The subspace.
        where: The site, layer and position(s) it acts on.
        rows: The pairs to score, by index (a list or an integer tensor; default ``pairs.test``).
        max_memory: Bytes one batch may use.

    Returns:
        ``iia``, its interval ``low`` / ``high``, ``logit_diff`` and the pair counts.

    Raises:
        ModelMismatchError: The subspace was fitted on another model, or is not as wide as the site.
        SiteError: An invalid site for this model.
        ConfigError: ``rows`` empty, repeated or past the pairs.
    """
    check_belongs(model, "causal.score_subspace", subspace=intervention)
    width = where.check(model)
    if int(intervention.d) != width:
        raise ModelMismatchError(f"causal.score_subspace: the subspace is {intervention.d} wide, but {where.site} at "
                                 f"layer {where.layer} of this model is {width} wide; score it at the site (and on "
                                 "the model) it was fitted on")
    if rows is not None:
        outside = [r for r in rows if r >= len(pairs)]
        if not rows or outside or len(set(rows)) != len(rows):
            problem = (f"{outside[:3]} are past the {len(pairs)} pairs" if outside else
                       "it is empty" if not rows else "it names a pair more than once")
            raise ConfigError(f"causal.score_subspace: rows {problem}; give distinct pair indices in "
                              f"0..{len(pairs) - 1}")
    chosen = pairs.test if rows is None else torch.tensor(list(rows), dtype=torch.long)
    runs = Runs(model, pairs, where, chosen, max_memory=max_memory)
    size = batch_size(model, pairs, training=False, max_memory=max_memory)
    sources = runs.source_values(size)
    if runs.stepped:
        size = max(size, runs.eval_size)
    return evaluate(model, pairs, where, intervention, sources, chosen, size, runs)
