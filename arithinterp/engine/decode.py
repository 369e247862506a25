"""Running a model to read its answers: greedy decoding and teacher-forced scoring.

Two costs dominate a naive evaluation of a real model: full-vocabulary logits at every position
of every prompt (``[batch, tokens, vocab]`` floats, gigabytes for a 50k vocabulary), and
re-running the whole prompt for every generated answer token. Here

* only the positions that are read go through the unembedding (the final norm runs on every
  position inside the model, the ``d_model × vocab`` product only on the read ones);
* greedy multi-token answers reuse the model's key/value cache, so each answer token after the
  first costs one position, not the whole prompt again;
* prompts that share their first tokens (a few-shot prefix) run them once: the shared prefix's
  keys and values are computed on one row and repeated for the batch;
* :func:`batch_size_for` picks how many prompts to run at once from a memory budget.

A Hugging Face model behind a ``TransformerBridge`` (``model.original_model``) is stepped through
its decoder (``get_decoder()``), whose layers are the bridge's hooked blocks, and its output
embedding. Which of these paths a model supports is checked once per model against its plain
forward (:func:`decode_mode`): ``"cached"`` (decoder + key/value cache), ``"uncached"`` (decoder,
the prefix re-run per answer token), ``"stepped"`` (TransformerLens-native models, which have no
cache of their own: the engine's stepper runs each answer token after the first at its own
position, with the key/value cache it hands native attention, :meth:`Stepper.greedy`) or
``"full"`` (the plain forward's logits at the last position, for any model while hooks are
attached, so that hooks see exactly the shapes and positions of the plain forward).
Interventions given as data (:class:`arithinterp.engine.Write`) take the plain path too,
one :func:`arithinterp.engine.run` per answer token. Every path gives the plain forward's greedy
tokens; tests compare them.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from arithinterp.engine.budget import forward_bytes_per_prompt
from arithinterp.engine.forward import run
from arithinterp.engine.hooks import module_hooks, unembed_last
from arithinterp.engine.stepping import Stepper
from arithinterp.engine.steppers import stepper_for
from arithinterp.errors import AnalysisError

if TYPE_CHECKING:
    from arithinterp.types import HookedModel

__all__ = ["batch_size_for", "decode_mode", "greedy", "teacher_forced_logprobs"]

MODES = ("cached", "uncached", "stepped", "full")
MIN_BUDGET = 2**28  # bytes a batch may always use (256 MB), so small models still run in large batches
MIN_SHARED_SAVING = 0.2  # share a prefix once it saves this fraction of a batch's positions
_MODES: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_SHARES_PREFIX: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()  # settled by decode_mode


# --- the model's parts ---------------------------------------------------------------------------


def _hf_parts(model: Any) -> Optional[tuple[Any, Any, Any]]:
    """``(decoder, output embedding, config)`` of a bridged Hugging Face causal LM, else None."""
    try:
        hf = model.original_model
    except AttributeError:
        return None
    get_decoder = getattr(hf, "get_decoder", None)
    get_head = getattr(hf, "get_output_embeddings", None)
    if get_decoder is None or get_head is None or getattr(hf, "config", None) is None:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or head is None or decoder is hf:
        return None
    return decoder, head, hf.config


def _device(model: Any) -> torch.device:
    device = getattr(getattr(model, "cfg", None), "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def _logits(head: Any, config: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The causal LM's logits from its decoder's (final-normed) hidden states ``[..., d]``.

    Besides the output embedding, some families scale or soft-cap the logits (Gemma 2/3
    ``final_logit_softcapping``, Cohere ``logit_scale``, Granite ``logits_scaling``);
    :func:`decode_mode` checks the result against the plain forward either way.
    """
    logits = head(hidden)
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        logits = logits * scale
    divisor = getattr(config, "logits_scaling", None)
    if isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and divisor:
        logits = logits / divisor
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@contextmanager
def _cache_keyword(model: Any):
    """Hand the decoder's key/value cache to the bridge's attention under both of its names.

    Hugging Face decoder layers pass the cache as ``cache=`` (transformers ≥ 5.2x) where the
    bridge's attention reads ``past_key_values=``; without this the cache stays empty. Only for
    the duration of a decoding call.
    """

    def alias(module, args, kwargs):
        if kwargs.get("past_key_values") is None and kwargs.get("cache") is not None:
            kwargs = dict(kwargs, past_key_values=kwargs["cache"])
        return args, kwargs

    blocks = getattr(model, "blocks", None) or []
    with module_hooks([(b.attn, alias) for b in blocks if hasattr(b, "attn")]):
        yield


def _hooked(model: Any) -> bool:
    """Whether any hook point of the model has a hook attached (a caller's own hooks context)."""
    from transformer_lens.hook_points import HookPoint

    modules = model.modules() if hasattr(model, "modules") else []
    return any(isinstance(m, HookPoint) and (m._forward_hooks or m._forward_pre_hooks) for m in modules)


def _decoder_step(decoder: Any, tokens: torch.Tensor, cache: Any = None, use_cache: bool = True):
    """Hidden states ``[B, t, d]`` of ``tokens`` after the cached prefix, and the cache."""
    keyword = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    kwargs = {keyword: cache} if cache is not None else {}
    out = decoder(input_ids=tokens, use_cache=use_cache, **kwargs)
    new_cache = getattr(out, "cache", None) if hasattr(out, "cache") else getattr(out, "past_key_values", None)
    return out.last_hidden_state, new_cache


def _shared_length(tokens: torch.Tensor, n_read: int = 1) -> int:
    """How many first tokens every row of ``tokens [B, T]`` shares (at most ``T − n_read``: the
    read positions are computed per row), or 0 when sharing them would save too little."""
    B, T = tokens.shape
    if B < 2 or T <= n_read:
        return 0
    same = (tokens[:, : T - n_read] == tokens[:1, : T - n_read]).all(0)
    k = int(same.int().argmin()) if not bool(same.all()) else T - n_read
    return k if k * (B - 1) >= MIN_SHARED_SAVING * B * T else 0


def _prefix_step(decoder: Any, tokens: torch.Tensor, k: int, use_cache: bool = True):
    """:func:`_decoder_step` of ``tokens [B, T]`` whose rows share their first ``k`` tokens: those
    run once, on one row, and their keys and values are repeated for every row. Hidden states
    ``[B, T − k, d]`` of positions ``k:``, and the cache of all ``T`` positions."""
    _, cache = _decoder_step(decoder, tokens[:1, :k])
    if cache is None:
        raise RuntimeError("the decoder returned no key/value cache")  # _shares_prefix then says no
    cache.batch_repeat_interleave(tokens.shape[0])
    return _decoder_step(decoder, tokens[:, k:], cache, use_cache=use_cache)


def _hidden(model: Any, decoder: Any, tokens: torch.Tensor, use_cache: bool, n_read: int = 1):
    """Hidden states of ``tokens`` (positions ``k:`` when the rows' first ``k`` are shared and
    computed once, so at least the last ``n_read``: read them from the end) and the cache."""
    k = _shared_length(tokens, n_read) if _SHARES_PREFIX.get(model, False) else 0
    if k:
        return _prefix_step(decoder, tokens, k, use_cache=use_cache)
    return _decoder_step(decoder, tokens, use_cache=use_cache)


# --- which path a model takes --------------------------------------------------------------------


def _close(fast: Optional[torch.Tensor], full: torch.Tensor, tolerance: float) -> bool:
    """Logits that agree with the plain forward's up to ``tolerance`` × their scale."""
    if fast is None or fast.shape != full.shape or not bool(torch.isfinite(fast).all()):
        return False
    return float((fast - full).abs().max()) <= tolerance * max(1.0, float(full.abs().max()))


def decode_mode(model: HookedModel, tokens: Optional[torch.Tensor] = None) -> str:
    """The fastest decoding path whose logits match the plain forward on a short probe of ``tokens``.

    Decided once per model, never while hooks are attached (then ``"full"``).

    Args:
        model: The hooked model.
        tokens (Int[Tensor, "batch pos"] | None): Prompts to probe with (the first row, its first 8
            tokens); with fewer than 2 tokens, or ``None``, the mode stays undecided and ``"full"`` is
            returned.

    Returns:
        ``"stepped"`` (a TransformerLens-native model stepped by the engine with its key/value cache),
        ``"cached"`` or ``"uncached"`` (a Hugging Face decoder with or without its cache), or
        ``"full"`` (the plain forward).
    """
    if _hooked(model):
        # hooks see the plain forward's shapes and positions only on the plain forward
        return "full"
    if model in _MODES:
        return _MODES[model]
    parts = _hf_parts(model)
    mode = "full"
    if parts is None:  # TransformerLens-native: the engine's stepper, with its own key/value cache
        if tokens is None or tokens.shape[1] < 2:
            return mode  # nothing to check the stepped path on yet: the plain forward, undecided
        mode = "stepped" if _steps_greedily(model, tokens[:1, : min(tokens.shape[1], 8)].to(_device(model))) else mode
    else:
        if tokens is None or tokens.shape[1] < 2:
            return mode  # nothing to check the decoder path on yet: the plain forward, undecided
        decoder, head, config = parts
        probe = tokens[:1, : min(tokens.shape[1], 8)].to(_device(model))
        tolerance = 1e-4 if next(iter(model.parameters())).dtype == torch.float32 else 2e-2
        with torch.inference_mode():
            full = model(probe, return_type="logits")[0].float()
            try:
                with _cache_keyword(model):
                    hidden, cache = _decoder_step(decoder, probe[:, :-1])
                    prefix = _logits(head, config, hidden[0]).float()
                    step, _ = _decoder_step(decoder, probe[:, -1:], cache)
                    last = _logits(head, config, step[0, -1]).float()
            except Exception:  # an architecture the decoder path does not fit: use the plain forward
                prefix = last = None
        if _close(prefix, full[:-1], tolerance):
            mode = "cached" if _close(last, full[-1], tolerance) else "uncached"
        if mode == "cached":
            _SHARES_PREFIX[model] = _shares_prefix(model, decoder, head, config, probe, tolerance)
    _MODES[model] = mode
    return mode


def _stepper(model: Any, tokens: torch.Tensor) -> Optional[Stepper]:
    """The model's stepper when its blocks can be stepped with keys and values reused, else None."""
    try:
        stepper, _ = stepper_for(model, tokens, warn=False)
    except AnalysisError:  # no blocks to step
        return None
    return stepper if stepper is not None and stepper.reuses_prefix else None


def _steps_greedily(model: Any, probe: torch.Tensor) -> bool:
    """Whether :meth:`Stepper.greedy` gives the plain forward's logits: two rows that differ in their
    last token, continued by three tokens, against the plain forward of what was generated."""
    rows = probe.repeat(2, 1)
    rows[1, -1] = probe[0, 0]
    tolerance = 1e-4 if next(iter(model.parameters())).dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        stepper = _stepper(model, rows)
        if stepper is None:
            return False
        try:
            generated, logits = stepper.greedy(rows, 3)
        except Exception:  # noqa: BLE001 - a model the stepped decoding does not fit: the plain forward
            return False
        with unembed_last(model, 3):
            full = model(torch.cat([rows, generated[:, :-1]], dim=1), return_type="logits")[:, -3:].float()
    return _close(logits.float(), full, tolerance)


def _shares_prefix(model: Any, decoder: Any, head: Any, config: Any, probe: torch.Tensor, tolerance: float) -> bool:
    """Whether two rows sharing all but their last token, run with the shared part once
    (:func:`_prefix_step`), give the plain forward's logits at the last position."""
    if probe.shape[1] < 2:
        return False
    rows = probe.repeat(2, 1)
    rows[1, -1] = probe[0, 0]
    with torch.inference_mode():
        with unembed_last(model, 1):
            full = model(rows, return_type="logits")[:, -1].float()
        try:
            with _cache_keyword(model):
                hidden, _ = _prefix_step(decoder, rows, rows.shape[1] - 1)
            shared = _logits(head, config, hidden[:, -1]).float()
        except Exception:  # noqa: BLE001 - a cache that cannot be repeated: every prompt runs in full
            return False
    return _close(shared, full, tolerance)


# --- memory budget -------------------------------------------------------------------------------


def batch_size_for(
    model: HookedModel, seq_len: int, n_read: int = 1, n_new: int = 0, *, budget_bytes: Optional[float] = None,
    plain: bool = False, low: int = 1, high: int = 1024,
) -> int:
    """Prompts per forward so that one batch's transient memory stays within a budget.

    Per prompt: the forward's activations (:func:`arithinterp.engine.budget.forward_bytes_per_prompt`),
    its key/value cache over ``seq_len + n_new`` tokens, and float32 logits at the read positions.

    Args:
        model: The hooked model.
        seq_len: Tokens per prompt.
        n_read: Positions whose logits are read.
        n_new: Tokens generated after the prompt.
        budget_bytes: The budget; ``None``: half the model's parameter bytes, at least
            :data:`MIN_BUDGET` (the peak stays within 1.5× model + batch).
        plain: Count logits at every position (a caller's own forward of the whole model).
        low: The smallest batch size to return.
        high: The largest batch size to return.

    Returns:
        The batch size, in ``low..high``.
    """
    cfg = model.cfg
    parameters = list(model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in parameters)
    element = parameters[0].element_size() if parameters else 4
    budget = max(0.5 * model_bytes, MIN_BUDGET) if budget_bytes is None else float(budget_bytes)
    length = seq_len + n_new
    kv_heads = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
    kv = 2 * cfg.n_layers * kv_heads * cfg.d_head * length * element
    vocab = getattr(cfg, "d_vocab_out", -1)
    vocab = vocab if vocab and vocab > 0 else cfg.d_vocab
    # every path unembeds the read positions alone (engine.hooks.unembed_last); a plain forward all
    read = length if plain else n_read
    logits = 2 * 4 * read * vocab  # the logits and their log-softmax in float32
    per_prompt = forward_bytes_per_prompt(model, length) + kv + logits
    return int(min(high, max(low, budget // per_prompt)))


# --- running -------------------------------------------------------------------------------------


@torch.inference_mode()
def greedy(model: HookedModel, tokens: torch.Tensor, n_new: int, writes: Sequence[Any] = ()) -> torch.Tensor:
    """Greedily generate tokens after each prompt.

    Identical to appending the argmax of ``model(tokens)[:, -1]`` ``n_new`` times, through the
    fastest path :func:`decode_mode` finds.

    Args:
        model: The hooked model.
        tokens (Int[Tensor, "batch pos"]): Same-length, unpadded prompts.
        n_new: The number of tokens to generate.
        writes: :class:`arithinterp.engine.Write` s applied at every step; each step is
            then one :func:`arithinterp.engine.run` of the whole sequence, so each sees the same positions.

    Returns:
        Int[Tensor, "batch n_new"]: The generated token ids (long, on the CPU).
    """
    if n_new < 1:
        return torch.empty((tokens.shape[0], 0), dtype=torch.long)
    tokens = tokens.to(_device(model))
    mode = "full" if writes else decode_mode(model, tokens)
    if mode == "stepped":
        stepper = _stepper(model, tokens)
        if stepper is not None:  # None once the weights changed so that stepping no longer matches
            return stepper.greedy(tokens, n_new)[0].cpu()
        mode = "full"
    generated = torch.empty((tokens.shape[0], n_new), dtype=torch.long, device=tokens.device)
    if mode == "full":
        for step in range(n_new):
            if writes:
                logits = run(model, tokens, list(writes)).logits  # [B, V] at the last position
                assert logits is not None  # run keeps the final logits unless told not to
            else:
                with unembed_last(model, 1):  # the last position's alone
                    logits = model(tokens, return_type="logits")[:, -1]
            generated[:, step] = logits.argmax(-1)
            tokens = torch.cat([tokens, generated[:, step : step + 1]], dim=1)
        return generated.cpu()
    parts = _hf_parts(model)
    assert parts is not None  # decode_mode picks "cached" or "uncached" only for models with these parts
    decoder, head, config = parts
    with _cache_keyword(model):
        hidden, cache = _hidden(model, decoder, tokens, use_cache=mode == "cached")
        for step in range(n_new):
            generated[:, step] = _logits(head, config, hidden[:, -1]).argmax(-1)
            if step + 1 == n_new:
                break
            if mode == "cached":
                hidden, cache = _decoder_step(decoder, generated[:, step : step + 1], cache)
            else:
                fed = torch.cat([tokens, generated[:, : step + 1]], dim=1)
                hidden, _ = _decoder_step(decoder, fed, use_cache=False)
    return generated.cpu()


@torch.inference_mode()
def teacher_forced_logprobs(model: HookedModel, tokens: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """The log-probability of each answer token, with the earlier answer tokens fed after the prompt.

    One forward over ``pos + k − 1`` tokens; only the last ``k`` positions are unembedded.

    Args:
        model: The hooked model.
        tokens (Int[Tensor, "batch pos"]): Same-length, unpadded prompts.
        answer (Int[Tensor, "batch k"]): The answer tokens; −1 padding is fed as token 0 and scores 0.

    Returns:
        Float[Tensor, "batch k"]: Log-probabilities (float32, on the CPU).
    """
    k = answer.shape[1]
    device = _device(model)
    fed = torch.cat([tokens, answer[:, :-1].clamp(min=0)], dim=1).to(device)
    mode = decode_mode(model, fed)
    if mode in ("full", "stepped"):  # one forward either way, unembedding the last k positions alone
        with unembed_last(model, k):
            logits = model(fed, return_type="logits")[:, -k:]
    else:
        parts = _hf_parts(model)
        assert parts is not None  # decode_mode picks "cached" or "uncached" only for models with these parts
        decoder, head, config = parts
        with _cache_keyword(model):
            hidden, _ = _hidden(model, decoder, fed, use_cache=False, n_read=k)
        logits = _logits(head, config, hidden[:, -k:])
    logprobs = logits.float().log_softmax(-1).gather(-1, answer.clamp(min=0).to(device)[..., None])[..., 0]
    return (logprobs * (answer >= 0).to(device)).cpu()
