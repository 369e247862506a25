"""The types the analyses share.

:class:`HookedModel` is what every analysis asks of a model: TransformerLens's hooked surface.
``load_model`` returns a ``TransformerBridge`` (TransformerLens 4), which has it; a 2.x / 3.x
``HookedTransformer`` has it too, and so does a user's own model with these members. Prompts
travel as :class:`arithinterp.tasks.PromptSet` and :class:`arithinterp.tasks.PromptPairs`.

Tensor shapes in annotations use jaxtyping, as TransformerLens does: ``Float[Tensor, "batch pos
d_model"]``; the names below are the ones the package uses.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from jaxtyping import Float, Int

# Axis names used in shape annotations: batch (prompts or pairs), pos (token positions), layer,
# d_model / d_mlp (residual / neuron width), vocab, n (numbers on an axis), freq (Fourier frequencies).
Logits = Float[torch.Tensor, "batch pos vocab"]
Tokens = Int[torch.Tensor, "batch pos"]


class HookedModel(Protocol):
    """The hooked-model surface the analyses use.

    ``cfg`` (``n_layers``, ``d_model``, ``n_heads``, ``d_mlp``, ...), ``tokenizer`` (a Hugging Face
    tokenizer), ``to_tokens``, a forward call returning logits and ``run_with_cache``. TransformerLens's
    hook methods are the engine's business (:mod:`arithinterp.engine.hooks`), so analyses never see
    them here; they and the other attributes of TransformerLens models (``W_U``, ``blocks``,
    ``ln_final``, ...) are reached through ``__getattr__``, as on any ``torch.nn.Module``.
    """

    cfg: Any
    tokenizer: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def to_tokens(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any: ...

    def __getattr__(self, name: str) -> Any: ...


__all__ = ["HookedModel", "Logits", "Tokens"]
