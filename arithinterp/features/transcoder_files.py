"""Transcoders and SAEs in other tools' files: circuit-tracer's layout and SAELens's.

One module past 600 lines on purpose: both layouts are read and written through the same per-layer
tensor mapping and hook-name translation, and their round trips are checked against each other.

**circuit-tracer** (0.5.0, ``circuit_tracer/transcoder/single_layer_transcoder.py``): a folder of
``layer_{i}.safetensors``, one per layer, with ``W_enc [F, d]``, ``W_dec [F, d]``, ``b_enc [F]``,
``b_dec [d]``, optionally ``W_skip [d, d]`` and ``activation_function.threshold [F]`` (a JumpReLU;
without it, ReLU), plus ``config.yaml`` naming ``feature_input_hook`` / ``feature_output_hook``
(TransformerLens hook names below ``blocks.{i}.``, e.g. ``mlp.hook_in`` and ``hook_mlp_out``).
Its conventions differ from this package's: it applies ``x @ W_enc.T`` and ``x @ W_skip.T`` (this
package stores ``W_enc [d, F]`` and ``W_skip [d, d]`` applied as ``x @ W``), and its ``TopK`` keeps
the k largest pre-activations whatever their sign (``activation="topk-signed"`` here). Its files
carry no TopK; this package writes ``activation_function`` and ``k`` into ``config.yaml`` (a key
circuit-tracer does not read) so that a TopK set reads back as it was saved.

**SAELens** (6.x, ``sae_lens/saes/``): one folder per hook point with ``cfg.json``
(``architecture``, ``d_in``, ``d_sae``, ``d_out`` for transcoders, ``metadata.hook_name`` and
``metadata.hook_name_out``) and ``sae_weights.safetensors`` with ``W_enc [d_in, d_sae]``,
``b_enc``, ``W_dec [d_sae, d_out]``, ``b_dec``, ``W_skip [d_out, d_in]`` (applied as ``x @ W_skip.T``)
and ``threshold`` (JumpReLU). Architectures read: ``transcoder``, ``skip_transcoder``,
``jumprelu_transcoder``, ``jumprelu_skip_transcoder`` (MLP input → MLP output) and the SAEs
``standard``, ``topk``, ``jumprelu`` (one site → the same site; ``apply_b_dec_to_input`` and
``rescale_acts_by_decoder_norm`` are folded into the weights, exactly). SAELens has no TopK
transcoder: a TopK set is written as ``topk_transcoder`` / ``topk_skip_transcoder`` with its
``k``, names SAELens 6 does not register, so it refuses the folder instead of running it as ReLU.

Hook names map to this package's sites by :data:`HOOK_SITES`; a loaded set is checked on the
model's own prompts (:func:`transcoder_fvu`): each layer must reproduce what it writes to an FVU at
most ``max_fvu``, or the error names the layer, the hook point and the convention that fits better.

One module past 500 lines on purpose: the two tools' layouts share one mapping of hook points and
tensor orientations, checked by the same fit on the model's own prompts.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence, Union

import torch
from pydantic import Field

from arithinterp import sites as site_lib
from arithinterp.engine import Read, run
from arithinterp.engine.decode import batch_size_for
from arithinterp.errors import AnalysisError, ArithInterpError, ConfigError, FormatError, ModelFileError, accepted
from arithinterp.features.transcoder import ACTIVATIONS, Transcoders
from arithinterp.outputs import check_target, write_file, write_folder, write_tensors, writes
from arithinterp.results import PROVENANCE, build_meta
from arithinterp.schemas import Count, Schema, check_tensor, read_json, read_safetensors, read_yaml, validate
from arithinterp.types import HookedModel, PositiveInt, checked

PathLike = Union[str, Path]

# TransformerLens hook names (below ``blocks.{i}.``) -> this package's sites. ``ln2.hook_normalized``
# is the MLP's input only where the norm has no weight of its own (folded): the FVU check tells.
HOOK_SITES: dict[str, str] = {
    "mlp.hook_in": "mlp_in",
    "ln2.hook_normalized": "mlp_in",
    "hook_resid_mid": "resid_mid",
    "hook_resid_pre": "resid_pre",
    "hook_resid_post": "resid_post",
    "hook_mlp_out": "mlp_out",
    "mlp.hook_out": "mlp_out",
    "hook_attn_out": "attn_out",
    "mlp.hook_pre": "mlp_pre",
    "mlp.hook_post": "mlp_post",
}
# the name each site is written under (circuit-tracer's ReplacementModel and TransformerLens 4 both have these)
SITE_HOOKS: dict[str, str] = {"mlp_in": "mlp.hook_in", "mlp_out": "hook_mlp_out", "resid_mid": "hook_resid_mid",
                              "resid_pre": "hook_resid_pre", "resid_post": "hook_resid_post",
                              "attn_out": "hook_attn_out", "mlp_pre": "mlp.hook_pre", "mlp_post": "mlp.hook_post"}
SAELENS_TRANSCODERS = ("transcoder", "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder",
                       "topk_transcoder", "topk_skip_transcoder")
SAELENS_SAES = ("standard", "topk", "jumprelu")
SAELENS_FORMAT = "6.54.12"  # the SAELens version whose cfg.json layout is written
DEFAULT_MAX_FVU = 0.5


class CircuitTracerConfig(Schema):
    """circuit-tracer's ``config.yaml`` for a per-layer transcoder set (the keys read here; this package
    adds ``activation_function``, ``k`` and ``fvu``, which circuit-tracer does not read)."""

    model_kind: Literal["transcoder_set"] = "transcoder_set"  # cross-layer transcoders are not read
    feature_input_hook: Optional[str] = None
    feature_output_hook: Optional[str] = None
    transcoders: Optional[Annotated[list[str], Field(min_length=1)]] = None
    activation_function: Optional[str] = None
    k: Optional[Count] = None
    fvu: Optional[list[Annotated[float, Field(ge=0)]]] = None
    model_name: Optional[str] = None
    scan: Optional[str] = None


class SAELensMetadata(Schema):
    """``cfg.json``'s ``metadata``: the hook points (and the FVU this package writes)."""

    hook_name: Optional[str] = None
    hook_name_out: Optional[str] = None
    fvu: Optional[Annotated[float, Field(ge=0)]] = None


class SAELensConfig(Schema):
    """SAELens's ``cfg.json`` (6.x; older files keep the hooks at the top level): the keys read here."""

    architecture: Literal[SAELENS_TRANSCODERS + SAELENS_SAES] = "standard"  # type: ignore[valid-type]
    d_in: Count
    d_sae: Count
    d_out: Optional[Count] = None
    k: Optional[Count] = None
    apply_b_dec_to_input: Optional[bool] = None
    normalize_activations: Optional[str] = None
    rescale_acts_by_decoder_norm: Optional[bool] = None
    hook_name: Optional[str] = None
    hook_name_out: Optional[str] = None
    metadata: SAELensMetadata = SAELensMetadata()


def hook_site(hook: str) -> tuple[str, Optional[int]]:
    """This package's site and the layer (``None`` when the name has no ``blocks.{i}.``) of a
    TransformerLens hook name (``"blocks.3.hook_mlp_out"`` → ``("mlp_out", 3)``)."""
    if not isinstance(hook, str):
        raise ConfigError(f"a hook name must be a string, got {hook!r}")
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", hook)
    layer, name = (int(match.group(1)), match.group(2)) if match else (None, hook)
    if name not in HOOK_SITES:
        raise ConfigError(f"hook point {hook!r} has no site in this package; hook names read: {accepted(HOOK_SITES)}")
    return HOOK_SITES[name], layer


def _stack(layers: list[int], parts: list[dict], activation: str, k: int, meta: dict,
           input_site: str, output_site: str, fvu: Optional[list] = None) -> Transcoders:
    order = sorted(range(len(layers)), key=lambda i: layers[i])
    layers = [layers[i] for i in order]
    parts = [parts[i] for i in order]
    if len(set(layers)) != len(layers):
        raise FormatError(f"two files give the same layer: layers {layers}")
    shapes = {(tuple(p["W_enc"].shape), tuple(p["W_dec"].shape)) for p in parts}
    if len(shapes) != 1:
        raise FormatError(f"the layers' weights differ in shape ({sorted(shapes)}); a set needs one shape")
    d = int(parts[0]["W_enc"].shape[0])
    stacked = {name: torch.stack([p[name].float() for p in parts]) for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
    skip = [p.get("W_skip") for p in parts]
    stacked["W_skip"] = torch.stack([torch.zeros(d, d) if s is None else s.float() for s in skip])
    threshold = torch.stack([p["threshold"].float() for p in parts]) if activation == "jumprelu" else None
    overflowed = [name for name, value in stacked.items() if not bool(torch.isfinite(value).all())]
    if overflowed:  # finite in the files, beyond float32 once read (or folded)
        raise FormatError(f"{meta.get('path')}: {overflowed[0]!r} does not fit float32 (it overflows to infinity)")
    # the FVU the files say the set was trained to (written by this package) sets the check's limit
    known = bool(fvu) and all(isinstance(v, (int, float)) for v in fvu or [])
    metrics = {"layers": [{"fvu": float(v)} for v in fvu or []]} if known else {}
    return Transcoders(**stacked, layers=layers, k=int(k), metrics=metrics, meta=meta, activation=activation,
                       threshold=threshold, input_site=input_site, output_site=output_site)


def _layer_weights(file: Path, names: dict[str, tuple], optional: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The named tensors of one layer's weights file, each checked: floating point, finite, of its shape
    (``None`` axes any length, the same name in two shapes the same length); ``optional`` ones only
    when present."""
    tensors, _ = read_safetensors(file)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise FormatError(f"{file} has no {missing[0]!r}; it holds {sorted(tensors)}")
    sizes: dict[str, int] = {}
    out = {}
    for name, axes in {**names, **{k: v for k, v in optional.items() if k in tensors}}.items():
        value = tensors[name]
        if isinstance(value, torch.Tensor) and value.ndim == len(axes):  # bind each axis name at its first use
            for axis, size in zip(axes, value.shape):
                if isinstance(axis, str):
                    sizes.setdefault(axis, int(size))
        shape = [sizes.get(axis) if isinstance(axis, str) else axis for axis in axes]
        out[name] = check_tensor(file, name, value, shape)
    return out


def _check_k(where: Any, k: Optional[int], n_features: int, activation: str,
             error: type[ArithInterpError] = FormatError) -> int:
    """``k`` of a TopK set: 1 ≤ k ≤ features; 0 for other activations."""
    if not activation.startswith("topk"):
        return 0
    if k is None or not 1 <= k <= n_features:
        raise error(f"{where}: a TopK set needs k from 1 to its {n_features} features, got {k!r}")
    return k


# ---- circuit-tracer ---------------------------------------------------------------------------


@checked
def read_circuit_tracer_transcoders(path: PathLike, model: Any = None, *, feature_input_hook: Optional[str] = None,
                                    feature_output_hook: Optional[str] = None, activation: Optional[str] = None,
                                    k: Optional[PositiveInt] = None, prompts: Any = None,
                                    max_fvu: Optional[float] = None) -> Transcoders:
    """Transcoders from a folder in circuit-tracer's per-layer layout (see the module docstring).

    The hooks and activation come from ``config.yaml`` when it has them, else from the arguments
    (``activation``: one of :data:`ACTIVATIONS`; a file with ``activation_function.threshold`` is a
    JumpReLU, one without and with no other word a ReLU; ``topk`` needs ``k``). With ``model``, the
    set is checked on its own prompts by :func:`transcoder_fvu` (``prompts``: a ``PromptSet`` or
    token ids ``[N, T]``; default the zoo model's task prompts) and an :class:`AnalysisError` says
    which layer, hook point or convention does not match.

    Args:
        path: The folder (``layer_{i}.safetensors``, optionally ``config.yaml``).
        model: The hooked model to check the set on.
        feature_input_hook: The hook the features read, when ``config.yaml`` does not say.
        feature_output_hook: The hook they write, likewise.
        activation: One of :data:`ACTIVATIONS`, likewise.
        k: Features per row, for a TopK activation.
        prompts: The prompts to check on (default: the zoo model's task prompts).
        max_fvu: The highest FVU accepted per layer (see :func:`transcoder_fvu`).

    Returns:
        The transcoders.

    Raises:
        ModelFileError: Not a folder, or no weights files.
        FormatError: A file that breaks its schema (:class:`CircuitTracerConfig`; weights that are not
            floating, finite and of one shape across layers; ``k`` outside 1..features).
        AnalysisError: A layer, hook point or convention that does not match the model.
        ModelMismatchError: Widths or layers the model does not have.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ModelFileError(f"{folder} is not a folder; circuit-tracer's layout is a folder of "
                             "layer_{i}.safetensors")
    config_file = folder / "config.yaml"
    config = CircuitTracerConfig()
    if config_file.is_file():
        config = validate(CircuitTracerConfig, read_yaml(config_file, "circuit-tracer's config.yaml") or {},
                          config_file, "circuit-tracer's config.yaml")
    found = sorted(folder.glob("layer_*.safetensors"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    files = [Path(f).name for f in config.transcoders] if config.transcoders else [p.name for p in found]
    if not files:
        raise ModelFileError(f"{folder} has no layer_{{i}}.safetensors files")
    paths = [folder / name for name in files]
    input_hook = feature_input_hook or config.feature_input_hook
    output_hook = feature_output_hook or config.feature_output_hook
    if not input_hook or not output_hook:
        raise FormatError(f"{folder} does not say which hooks its transcoders read and write (config.yaml's "
                          "feature_input_hook / feature_output_hook); pass feature_input_hook= and "
                          "feature_output_hook=, e.g. 'mlp.hook_in' and 'hook_mlp_out'")
    input_site, _ = hook_site(input_hook)
    output_site, _ = hook_site(output_hook)
    parts = []
    shape: dict[str, tuple] = {"W_enc": ("F", "d"), "W_dec": ("F", "d"), "b_enc": ("F",), "b_dec": ("d",)}
    for file in paths:
        t = _layer_weights(file, shape, {"W_skip": ("d", "d"), "activation_function.threshold": ("F",)})
        if not parts:  # every layer has the first one's widths
            F, d = (int(n) for n in t["W_enc"].shape)
            shape = {"W_enc": (F, d), "W_dec": (F, d), "b_enc": (F,), "b_dec": (d,)}
        part = dict(W_enc=t["W_enc"].T, W_dec=t["W_dec"], b_enc=t["b_enc"], b_dec=t["b_dec"])
        if "W_skip" in t:
            part["W_skip"] = t["W_skip"].T
        if "activation_function.threshold" in t:
            part["threshold"] = t["activation_function.threshold"]
        parts.append(part)
    has_threshold = ["threshold" in p for p in parts]
    chosen = activation or config.activation_function or ("jumprelu" if all(has_threshold) else "relu")
    if chosen not in ACTIVATIONS:
        raise ConfigError(f"activation {chosen!r} is not one this package runs; accepted: {accepted(ACTIVATIONS)}")
    if chosen == "jumprelu" and not all(has_threshold):
        raise FormatError(f"a JumpReLU set needs activation_function.threshold in every file; "
                          f"{paths[has_threshold.index(False)]} has none")
    n_features = int(parts[0]["W_enc"].shape[1])
    k_value = (_check_k(config_file, config.k, n_features, chosen) if k is None
               else _check_k("k", k, n_features, chosen, ConfigError))
    if config.fvu is not None and len(config.fvu) != len(parts):
        raise FormatError(f"{config_file}: field 'fvu' has {len(config.fvu)} entries for {len(parts)} layers")
    meta = dict(source="circuit-tracer", path=str(folder), feature_input_hook=input_hook,
                feature_output_hook=output_hook, model_name=config.model_name, scan=config.scan)
    out = _stack(list(range(len(parts))), parts, chosen, k_value, meta, input_site, output_site, config.fvu)
    return _checked_on(model, out, prompts, max_fvu)


def _checked_on(model: Any, transcoders: Transcoders, prompts: Any, max_fvu: Optional[float]) -> Transcoders:
    """Without a model, ``transcoders``; with one, checked on its prompts (:func:`transcoder_fvu`) and
    tied to it: ``meta`` records the model's fingerprint, so they are refused on any other."""
    if model is None:
        return transcoders
    transcoder_fvu(model, transcoders, prompts, max_fvu=max_fvu)
    meta = dict(transcoders.meta, **{k: v for k, v in build_meta(model).items() if k in PROVENANCE})
    return dataclasses.replace(transcoders, meta=meta)


def _layer_tensors(transcoders: Transcoders, i: int, skip: bool, *, encoder_rows: bool,
                   threshold_key: str) -> dict[str, torch.Tensor]:
    """Layer ``i``'s weights as one file of either layout stores them: the encoder as ``[F, d]`` rows
    (circuit-tracer, ``x @ W_enc.T``) or ``[d, F]`` columns (SAELens), the skip as ``[d_out, d_in]``,
    the JumpReLU threshold under ``threshold_key``; float32 and contiguous, as safetensors needs."""
    tensors = {"W_enc": transcoders.W_enc[i].T if encoder_rows else transcoders.W_enc[i],
               "b_enc": transcoders.b_enc[i], "W_dec": transcoders.W_dec[i], "b_dec": transcoders.b_dec[i]}
    if skip:
        tensors["W_skip"] = transcoders.W_skip[i].T
    if transcoders.activation == "jumprelu":
        assert transcoders.threshold is not None
        tensors[threshold_key] = transcoders.threshold[i]
    return {key: value.detach().float().contiguous() for key, value in tensors.items()}


@writes
@checked
def write_circuit_tracer_transcoders(transcoders: Transcoders, path: PathLike, *, model_name: str = "",
                                     scan: Optional[str] = None, overwrite: bool = False) -> Path:
    """Write ``transcoders`` in circuit-tracer's layout (``layer_{i}.safetensors`` + ``config.yaml``).

    circuit-tracer reads it with ``load_transcoder_set({i: path/layer_{i}.safetensors}, scan,
    feature_input_hook, feature_output_hook)``; a TopK set then needs its activation set by hand
    (circuit-tracer's loader knows ReLU and JumpReLU only; for ``activation="topk"`` that is
    ``ReLU(TopK(k))``, for ``"topk-signed"`` its own ``TopK(k)``).

    Args:
        transcoders: A transcoder for every layer from 0.
        path: The folder to write.
        model_name: The model's name, for ``config.yaml``.
        scan: The set's name in circuit-tracer (default ``arithinterp-<model id>``).
        overwrite: Replace a folder that holds files (the folder is written whole, by
            :func:`arithinterp.outputs.write_folder`).

    Returns:
        The folder.

    Raises:
        AnalysisError: Not Transcoders, or layers missing from 0 on.
        ConfigError: The folder cannot be written, or holds files and ``overwrite`` is false.
    """

    if not isinstance(transcoders, Transcoders):
        raise ConfigError(f"transcoders must be a Transcoders, got {type(transcoders).__name__}")
    if transcoders.layers != list(range(len(transcoders.layers))):
        raise AnalysisError(f"circuit-tracer's layout needs a transcoder for every layer from 0; these cover "
                            f"{transcoders.layers}")
    names = [f"layer_{layer}.safetensors" for layer in transcoders.layers]
    skip = bool(transcoders.W_skip.abs().sum() > 0)
    config = dict(model_kind="transcoder_set", model_name=model_name or transcoders.meta.get("model", ""),
                  scan=scan or f"arithinterp-{transcoders.meta.get('model', 'transcoders')}",
                  feature_input_hook=SITE_HOOKS[transcoders.input_site],
                  feature_output_hook=SITE_HOOKS[transcoders.output_site], transcoders=names,
                  activation_function=transcoders.activation, k=transcoders.k)
    trained = [row.get("fvu") for row in transcoders.metrics.get("layers", [])]
    if len(trained) == len(transcoders.layers):
        config["fvu"] = trained
    with write_folder(path, overwrite=overwrite, what="path") as folder:
        for i, name in enumerate(names):
            tensors = _layer_tensors(transcoders, i, skip, encoder_rows=True,
                                     threshold_key="activation_function.threshold")
            write_tensors(folder / name, tensors, overwrite=False)
        write_file(folder / "config.yaml", json.dumps(config, indent=1) + "\n", overwrite=False)  # JSON is YAML
    return Path(path).expanduser()


# ---- SAELens ----------------------------------------------------------------------------------


@checked
def read_saelens(paths: Union[PathLike, Sequence[PathLike]], model: Any = None, *, prompts: Any = None,
                 max_fvu: Optional[float] = None) -> Transcoders:
    """Transcoders (or SAEs) from SAELens folders (``cfg.json`` + ``sae_weights.safetensors``): one
    folder, a list of them, or a folder whose subfolders each hold one. The layer and sites come
    from ``metadata.hook_name`` / ``hook_name_out``.

    Args:
        paths: One folder, a list of them, or a folder whose subfolders each hold one.
        model: The hooked model to check the set on, as in :func:`read_circuit_tracer_transcoders`.
        prompts: The prompts to check on.
        max_fvu: The highest FVU accepted per layer.

    Returns:
        The transcoders (or SAEs).

    Raises:
        ModelFileError: No ``cfg.json`` found.
        FormatError: A file that breaks its schema (:class:`SAELensConfig`; weights that are not
            floating, finite and of the shapes ``d_in``, ``d_sae`` and ``d_out`` give), or folders that
            mix activations, sites or widths, or give one layer twice.
        AnalysisError: A layer, hook point or convention that does not match the model.
        ModelMismatchError: Widths or layers the model does not have.
    """
    if isinstance(paths, (str, Path)):
        root = Path(paths)
        folders = [root] if (root / "cfg.json").is_file() else sorted(p.parent for p in root.glob("*/cfg.json"))
        if not folders:
            raise ModelFileError(f"{root} holds no cfg.json, nor do its subfolders; SAELens's layout is "
                                 "cfg.json + sae_weights.safetensors per hook point")
    else:
        folders = [Path(p) for p in paths]
    layers, parts, kinds, sites_seen, fvu = [], [], set(), set(), []
    for folder in folders:
        layer, part, kind, sites = _read_saelens_folder(folder)
        fvu.append(part.pop("fvu", None))
        layers.append(layer)
        parts.append(part)
        kinds.add(kind)
        sites_seen.add(sites)
    if len(kinds) != 1 or len(sites_seen) != 1:
        raise FormatError(f"the folders mix activations {sorted(kinds)} or sites {sorted(sites_seen)}; "
                             "one set has one of each")
    (activation, k), (input_site, output_site) = kinds.pop(), sites_seen.pop()
    widths = {tuple(p["W_enc"].shape) for p in parts}
    if len(widths) != 1:
        raise FormatError(f"the folders' weights differ in shape ({sorted(widths)}); a set needs one shape")
    meta = dict(source="saelens", path=[str(f) for f in folders])
    out = _stack(layers, parts, activation, k, meta, input_site, output_site,
                 [fvu[i] for i in sorted(range(len(layers)), key=lambda i: layers[i])])
    return _checked_on(model, out, prompts, max_fvu)


def _read_saelens_folder(folder: Path) -> tuple[int, dict, tuple[str, int], tuple[str, str]]:
    cfg_path = folder / "cfg.json"
    if not cfg_path.is_file():
        raise ModelFileError(f"{folder} has no cfg.json")
    cfg = validate(SAELensConfig, read_json(cfg_path, "SAELens's cfg.json"), cfg_path, "SAELens's cfg.json")
    if (cfg.normalize_activations or "none") != "none":
        raise FormatError(f"{cfg_path}: normalize_activations={cfg.normalize_activations!r} rescales inputs at "
                          "run time, which a fixed transcoder cannot hold; fold it first (SAELens's "
                          "fold_activation_norm_scaling_factor) or save with normalize_activations='none'")
    hook_in = cfg.metadata.hook_name or cfg.hook_name
    if not hook_in:
        raise FormatError(f"{cfg_path}: field 'metadata.hook_name' is missing; it names the hook point read")
    input_site, layer = hook_site(hook_in)
    is_transcoder = cfg.architecture in SAELENS_TRANSCODERS
    hook_out = (cfg.metadata.hook_name_out or cfg.hook_name_out) if is_transcoder else hook_in
    if not hook_out:
        raise FormatError(f"{cfg_path}: field 'metadata.hook_name_out' is missing; a transcoder names the hook "
                          "point it writes")
    output_site, layer_out = hook_site(hook_out)
    if layer is None or (layer_out is not None and layer_out != layer):
        raise FormatError(f"{cfg_path}: hooks {hook_in!r} → {hook_out!r} must name one layer (blocks.{{i}}.)")
    d_in, d_sae = cfg.d_in, cfg.d_sae
    d_out = cfg.d_out if cfg.d_out is not None else d_in
    weights = folder / "sae_weights.safetensors"
    t = _layer_weights(weights, {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_out),
                                 "b_dec": (d_out,)},
                       {"W_skip": (d_out, d_in), "threshold": (d_sae,)})
    if d_out != d_in:
        raise FormatError(f"{cfg_path}: field 'd_out' is {d_out}, not d_in ({d_in}); this package's transcoders "
                          "read and write one width")
    W_enc, b_enc, W_dec, b_dec = (t[n].double() for n in ("W_enc", "b_enc", "W_dec", "b_dec"))
    if not is_transcoder and cfg.apply_b_dec_to_input is not False:
        b_enc = b_enc - b_dec @ W_enc  # (x − b_dec) W_enc + b_enc, folded
    if cfg.rescale_acts_by_decoder_norm:
        norms = W_dec.norm(dim=-1)  # pre scaled by the norms, decoded acts divided by them: fold both
        if not bool((norms > 0).all()):
            raise FormatError(f"{weights}: 'W_dec' has a row of zeros, which rescale_acts_by_decoder_norm divides by")
        W_enc, b_enc, W_dec = W_enc * norms, b_enc * norms, W_dec / norms[:, None]
    part: dict = dict(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec, fvu=cfg.metadata.fvu)
    if "W_skip" in t:
        part["W_skip"] = t["W_skip"].T
    if "jumprelu" in cfg.architecture:
        if "threshold" not in t:
            raise FormatError(f"{weights} has no 'threshold', which a {cfg.architecture} needs")
        # SAELens runs ReLU(pre)·[pre > t]: the same as pre·[pre > max(t, 0)]
        part["threshold"] = t["threshold"].clamp_min(0)
        kind = ("jumprelu", 0)
    elif "topk" in cfg.architecture:
        kind = ("topk", _check_k(f"{cfg_path}: field 'k'", cfg.k, d_sae, "topk"))  # ReLU of the k largest
    else:
        kind = ("relu", 0)
    return layer, part, kind, (input_site, output_site)


@writes
@checked
def write_saelens(transcoders: Transcoders, path: PathLike, *, model_name: str = "", overwrite: bool = False) -> Path:
    """Write ``transcoders`` in SAELens's layout, one folder per layer (``path/layer_{i}/cfg.json``
    and ``sae_weights.safetensors``). A set reading and writing the same site is written as an SAE
    (``standard`` / ``topk`` / ``jumprelu``, ``apply_b_dec_to_input=False``), a transcoder as
    ``[jumprelu_|topk_][skip_]transcoder``.

    Args:
        transcoders: The transcoders.
        path: The folder to write.
        model_name: The model's name, for ``cfg.json``.
        overwrite: Replace a folder that holds files (the folder is written whole, by
            :func:`arithinterp.outputs.write_folder`).

    Returns:
        ``path``.

    Raises:
        AnalysisError: Not Transcoders, or a ``"topk-signed"`` set (SAELens has no TopK without ReLU).
        ConfigError: The folder cannot be written, or holds files and ``overwrite`` is false.
    """

    if not isinstance(transcoders, Transcoders):
        raise ConfigError(f"transcoders must be a Transcoders, got {type(transcoders).__name__}")
    if transcoders.activation == "topk-signed":
        raise AnalysisError("SAELens has no TopK without ReLU; a 'topk-signed' set can be written in "
                            "circuit-tracer's layout only")
    check_target(path, overwrite=overwrite, what="path", folder=True)
    is_sae = transcoders.input_site == transcoders.output_site
    skip = bool(transcoders.W_skip.abs().sum() > 0)
    if is_sae and skip:
        raise AnalysisError("an SAE (one site read and written) has no skip connection; this set has one")
    base = {"topk": "topk", "relu": "standard", "jumprelu": "jumprelu"}[transcoders.activation]
    if not is_sae:
        prefix = {"topk": "topk_", "relu": "", "jumprelu": "jumprelu_"}[transcoders.activation]
        base = f"{prefix}{'skip_' if skip else ''}transcoder"
    d, F = int(transcoders.W_enc.shape[1]), transcoders.n_features
    trained = [row.get("fvu") for row in transcoders.metrics.get("layers", [])]
    with write_folder(path, overwrite=overwrite, what="path") as root:
        for i, layer in enumerate(transcoders.layers):
            tensors = _layer_tensors(transcoders, i, skip, encoder_rows=False, threshold_key="threshold")
            write_tensors(root / f"layer_{layer}" / "sae_weights.safetensors", tensors, overwrite=False)
            metadata = dict(sae_lens_version=SAELENS_FORMAT, sae_lens_training_version=SAELENS_FORMAT,
                            model_name=model_name or transcoders.meta.get("model", ""),
                            hook_name=f"blocks.{layer}.{SITE_HOOKS[transcoders.input_site]}", hook_head_index=None,
                            prepend_bos=True)
            if len(trained) == len(transcoders.layers):
                metadata["fvu"] = trained[i]  # SAELens keeps unknown metadata keys
            cfg: dict = dict(architecture=base, d_in=d, d_sae=F, dtype="float32", device="cpu",
                             apply_b_dec_to_input=False, normalize_activations="none", reshape_activations="none",
                             metadata=metadata)
            if not is_sae:
                cfg["d_out"] = d
                metadata["hook_name_out"] = f"blocks.{layer}.{SITE_HOOKS[transcoders.output_site]}"
                metadata["hook_head_index_out"] = None
            if transcoders.activation == "topk":
                cfg.update(k=transcoders.k, rescale_acts_by_decoder_norm=False)
            write_file(root / f"layer_{layer}" / "cfg.json", json.dumps(cfg, indent=1), overwrite=False)
    return Path(path).expanduser()


# ---- the check ---------------------------------------------------------------------------------


@checked
def transcoder_fvu(model: HookedModel, transcoders: Transcoders, prompts: Any = None, *,
                   max_fvu: Optional[float] = None, raise_above: bool = True) -> dict[int, float]:
    """FVU per layer (``Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` over every position) of ``transcoders`` on
    ``prompts`` (a ``PromptSet``, token ids ``[N, T]``, or ``None``: the zoo model's task prompts,
    500 of them), reading and writing the sites the set names.

    Args:
        model: The hooked model.
        transcoders: The transcoders.
        prompts: A ``PromptSet``, token ids ``[N, T]``, or ``None``: the zoo model's task prompts
            (500 of them).
        max_fvu: The highest FVU accepted (default: twice the FVU the set was trained to when its
            metrics say, else :data:`DEFAULT_MAX_FVU`).
        raise_above: Raise when a layer is above ``max_fvu``.

    Returns:
        ``{layer: FVU}``.

    Raises:
        AnalysisError: With ``raise_above``, a layer above ``max_fvu``: the message names the
            layer, the hook points and, when one fits better, the reading site or convention that does.
        ModelMismatchError: Transcoders made for another model.
    """
    transcoders.check_model(model)
    for site in (transcoders.input_site, transcoders.output_site):
        site_lib.check_site(site)
    tokens = _prompt_tokens(model, prompts)
    sites = sorted({transcoders.input_site, transcoders.output_site, "mlp_in", "resid_mid"})
    reads = [Read(site, layer) for layer in transcoders.layers for site in sites]
    size = batch_size_for(model, int(tokens.shape[1]), n_read=len(reads), plain=True)
    got: dict = {}
    with torch.inference_mode():
        for start in range(0, len(tokens), size):
            values = run(model, tokens[start : start + size], reads=reads, logits="none").reads
            for read, value in zip(reads, values):
                got.setdefault((read.site, read.layer), []).append(value.float().reshape(-1, value.shape[-1]))
    got = {key: torch.cat(value) for key, value in got.items()}
    trained = [row.get("fvu") for row in transcoders.metrics.get("layers", [])]
    out: dict[int, float] = {}
    for i, layer in enumerate(transcoders.layers):
        x, y = got[(transcoders.input_site, layer)], got[(transcoders.output_site, layer)]
        fvu = _fvu(y, transcoders(layer, x))
        out[layer] = fvu
        limit = max_fvu if max_fvu is not None else (
            max(2 * trained[i], 0.05) if i < len(trained) and trained[i] is not None else DEFAULT_MAX_FVU)
        if raise_above and not fvu <= limit:
            raise AnalysisError(_mismatch(transcoders, layer, fvu, limit, got, x, y))
    return out


def _fvu(y: torch.Tensor, y_hat: torch.Tensor) -> float:
    total = ((y - y.mean(0)) ** 2).sum()
    if float(total) == 0.0:
        raise AnalysisError("the output does not vary over the prompts; its FVU is undefined")
    return float(((y - y_hat.float()) ** 2).sum() / total)


def _mismatch(transcoders: Transcoders, layer: int, fvu: float, limit: float, got: dict, x: torch.Tensor,
              y: torch.Tensor) -> str:
    """The error for a layer above the limit, with the alternative reading that fits best."""
    i = transcoders.index(layer)
    tries: dict[str, float] = {}
    for site in ("mlp_in", "resid_mid"):
        if site != transcoders.input_site and (site, layer) in got:
            tries[f"reading {site} ({SITE_HOOKS[site]}) instead of {transcoders.input_site}"] = _fvu(
                y, transcoders(layer, got[(site, layer)]))
    pre = x @ transcoders.W_enc[i] + transcoders.b_enc[i]
    linear = transcoders.b_dec[i] + x @ transcoders.W_skip[i]
    if transcoders.W_skip.abs().sum() > 0:
        acts = transcoders.encode(layer, x)
        tries["W_skip transposed (x @ W_skip.T against x @ W_skip)"] = _fvu(
            y, acts @ transcoders.W_dec[i] + transcoders.b_dec[i] + x @ transcoders.W_skip[i].T)
    for name in ACTIVATIONS:
        if name != transcoders.activation and (name != "jumprelu" or transcoders.threshold is not None):
            threshold = None if transcoders.threshold is None else transcoders.threshold[i]
            from arithinterp.features.transcoder import activate

            acts = activate(pre, name, max(transcoders.k, 1), threshold)
            tries[f"activation {name!r} instead of {transcoders.activation!r}"] = _fvu(
                y, acts @ transcoders.W_dec[i] + linear)
    hooks = f"{SITE_HOOKS[transcoders.input_site]} → {SITE_HOOKS[transcoders.output_site]}"
    message = (f"layer {layer}: the transcoder reproduces what it writes to FVU {fvu:.4g}, above {limit:.4g}, "
               f"reading blocks.{layer}.{hooks} with activation {transcoders.activation!r}")
    if tries:
        best = min(tries, key=lambda key: tries[key])
        if tries[best] <= limit:
            return message + f"; {best} gives FVU {tries[best]:.4g}: the files likely follow that convention"
    return message + ("; no other reading site, skip orientation or activation fits better: check that the set "
                      "was trained on this model and these hook points")


def _prompt_tokens(model: Any, prompts: Any) -> torch.Tensor:
    if isinstance(prompts, torch.Tensor):
        if prompts.ndim != 2 or prompts.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"prompts as token ids must be an int tensor [N, T], got {tuple(prompts.shape)}")
        return prompts
    if prompts is None:
        from arithinterp.models.zoo import task_prompts

        name = str(getattr(model.cfg, "model_name", ""))
        spec = name if name.startswith("zoo:") else f"zoo:{name}"
        try:
            prompts = task_prompts(model, spec, 500)
        except Exception as error:  # not a zoo model: the caller must say which prompts
            raise AnalysisError(f"no prompts were given and {name!r} has no task of its own ({error}); pass "
                                "prompts= (a PromptSet or token ids [N, T]) to check the transcoders on") from None
    tokens = getattr(prompts, "tokens", None)
    if not isinstance(tokens, torch.Tensor):
        raise ConfigError(f"prompts must be a PromptSet or token ids [N, T], got {type(prompts).__name__}")
    return tokens
