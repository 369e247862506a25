"""The rows transcoders learn from: every position of a prompt set, its answers teacher-forced.

Each prompt is followed by all but the last of its answer tokens, so that every answer token is
predicted at some position (:func:`answer_sequences`); prompts whose sequences have one length run
together, unpadded. :func:`read_layers` steps them through the model one block at a time
(:class:`~arithinterp.engine.layerwise.LayerByLayer`) and hands each layer's MLP inputs and outputs
to a callback, which may return what the block's MLP writes instead (a transcoder's output): the
next block then runs on that. One whole forward's work reads every layer, whether the layers see
the real model's inputs or those of the model whose earlier MLPs are already replaced.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from arithinterp.engine import Read
from arithinterp.engine.layerwise import LayerByLayer
from arithinterp.errors import AnalysisError
from arithinterp.types import HookedModel


@dataclasses.dataclass(frozen=True)
class SequenceGroup:
    """Prompts whose teacher-forced sequences have one length.

    Attributes:
        prompts (Int[Tensor, "n"]): Their indices in the prompt set.
        tokens (Int[Tensor, "n pos"]): Each prompt, unpadded, then all but its last answer token.
        n_answer (Int[Tensor, "n"]): Each prompt's answer tokens: its last ``n_answer`` positions
            predict them.
    """

    prompts: torch.Tensor
    tokens: torch.Tensor
    n_answer: torch.Tensor

    def answer_mask(self) -> torch.Tensor:
        """``[n, pos]``: True at the positions that predict an answer token."""
        T = self.tokens.shape[1]
        return torch.arange(T)[None, :] >= (T - self.n_answer)[:, None]


def answer_sequences(prompts: object) -> list[SequenceGroup]:
    """Every prompt of a :class:`~arithinterp.tasks.PromptSet` followed by all but its last answer
    token, grouped by length (shortest first).

    Args:
        prompts: The prompt set.

    Returns:
        The groups.

    Raises:
        AnalysisError: An empty prompt set.
    """
    if len(prompts) == 0:  # type: ignore[arg-type]
        raise AnalysisError("the prompt set is empty; transcoders need prompts to read activations from")
    tokens, lengths = prompts.tokens, prompts.lengths  # type: ignore[attr-defined]
    n_answer = prompts.n_answer_tokens  # type: ignore[attr-defined]
    T = tokens.shape[1]
    sequences = [torch.cat([tokens[i, T - int(lengths[i]):], prompts.answer_tokens[i, : int(n_answer[i]) - 1]])  # type: ignore[attr-defined]
                 for i in range(len(tokens))]
    by_length: dict[int, list[int]] = {}
    for i, sequence in enumerate(sequences):
        by_length.setdefault(len(sequence), []).append(i)
    return [SequenceGroup(prompts=torch.tensor(ids), tokens=torch.stack([sequences[i] for i in ids]),
                          n_answer=n_answer[ids].clone())
            for _, ids in sorted(by_length.items())]


# (layer, per group: MLP inputs [n, pos, d], MLP outputs [n, pos, d]) -> per group the MLP outputs to
# use instead, or None to keep the model's
LayerCallback = Callable[[int, list, list], Optional[list]]


def read_layers(model: HookedModel, groups: list[SequenceGroup], layers: list[int], on_layer: LayerCallback,
                batch_size: Optional[int] = None) -> None:
    """Step every group through the model's blocks and hand each chosen layer's MLP inputs and
    outputs, over all groups, to ``on_layer`` (in layer order).

    Where ``on_layer`` returns tensors, each block's output is the one it would give with those
    MLP outputs instead of its own (``resid_post + new − mlp_out``: an MLP's output is added to the
    residual stream), so later blocks see them.

    Args:
        model: The hooked model.
        groups: The sequences, from :func:`answer_sequences`.
        layers: The layers whose MLPs are read, ascending.
        on_layer: Called once per layer.
        batch_size: Prompts per block call (default: a group at once).
    """
    walkers = [LayerByLayer(model, group.tokens, batch_size) for group in groups]
    for layer in range(max(layers) + 1):
        if layer not in layers:
            for walker in walkers:
                walker.step()
            continue
        read = [walker.step(reads=[Read("mlp_in", layer), Read("mlp_out", layer)]) for walker in walkers]
        xs, ys = [x.float() for x, _ in read], [y.float() for _, y in read]
        new = on_layer(layer, xs, ys)
        if new is not None:
            for walker, y, out in zip(walkers, ys, new):
                walker.hidden = walker.hidden + (out - y).to(walker.hidden.dtype)
