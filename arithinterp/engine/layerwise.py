"""Running prompts through a model one block at a time, the residual stream kept between blocks.

Training transcoders *in sequence* needs each layer's MLP inputs in the model whose earlier MLPs
are already replaced by their transcoders, and the real MLP's outputs on those inputs. With whole
forwards that is one forward per layer, each stopping at that layer (about half as many whole
forwards as there are layers). :class:`LayerByLayer` runs the model's own blocks in turn instead:
block ``l`` runs once per prompt, its reads come back, and the caller decides what its output is
before block ``l + 1`` runs — one whole forward's work in all. The blocks are called as the model's
own forward calls them (:class:`~arithinterp.engine.block_runner.BlockRunner`), so every decoder
family the stepper supports is supported here.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from arithinterp import sites as site_lib
from arithinterp.checks import check_model, check_tokens
from arithinterp.engine.block_runner import BlockRunner
from arithinterp.engine.forward import Read, Write, intervention_hooks
from arithinterp.engine.hooks import hook_points
from arithinterp.engine.prefix_cache import is_cache
from arithinterp.errors import AnalysisError, SiteError
from arithinterp.types import HookedModel


class LayerByLayer:
    """Same-length prompts stepped through a model's blocks one at a time.

    ``step(writes, reads)`` runs the next block on every prompt with those interventions and reads
    (sites inside that block), keeps its output as the next block's input and returns the reads.

    Args:
        model: The hooked model (its blocks are stepped: TransformerLens's bridge or any model
            with ``blocks`` and ``unembed``).
        tokens (Int[Tensor, "prompt pos"]): Prompts of one length, no padding.
        batch_size: Prompts per block call (default: all at once).

    Raises:
        AnalysisError: The model's blocks cannot be stepped.
    """

    def __init__(self, model: HookedModel, tokens: torch.Tensor, batch_size: Optional[int] = None):
        check_model(model, "LayerByLayer")
        check_tokens(model, tokens)
        self.model = model
        self.runner = BlockRunner(model)
        with torch.inference_mode():
            # the embedded prompts, and how the model's own forward calls each block (on one prompt:
            # prompts of one length share masks, rotary tables and position ids)
            self.hidden = self.runner._calls_until(tokens, 0)[0]["hidden_states"]
            calls = self.runner._calls_until(tokens[:1], self.runner.n_layers - 1)
        self.calls = [{key: None if is_cache(value) else value for key, value in call.items() if key != "hidden_states"}
                      for call in calls]
        self.layer = 0
        self.batch_size = batch_size or len(tokens)

    @property
    def n_layers(self) -> int:
        return self.runner.n_layers

    def step(self, writes: Sequence[Write] = (), reads: Sequence[Read] = ()) -> list[torch.Tensor]:
        """Run block :attr:`layer` on every prompt, then move on to the next block.

        Args:
            writes: Interventions inside this block (their ``layer`` must be :attr:`layer`).
            reads: Activations of this block to keep.

        Returns:
            Each read ``[prompt, ...]``, in order.

        Raises:
            AnalysisError: Every block has run.
            SiteError: A write or read of another layer, or of a site outside the blocks.
        """
        if self.layer >= self.n_layers:
            raise AnalysisError(f"all {self.n_layers} blocks have run; nothing is left to step")
        for item in (*writes, *reads):
            if item.layer != self.layer or item.site in site_lib.GLOBAL_SITES:
                raise SiteError(f"block {self.layer} runs now; {item.site} at layer {item.layer} is not inside it")
        outputs, parts = [], [[] for _ in reads]
        block = self.runner.blocks[self.layer]
        with torch.inference_mode():
            for start in range(0, len(self.hidden), self.batch_size):
                hooks, kept, _, _ = intervention_hooks(self.model, writes, reads)
                with hook_points(self.model, hooks):
                    out = block(self.hidden[start : start + self.batch_size], **self.calls[self.layer])
                outputs.append(out[0] if isinstance(out, tuple) else out)
                for part, value in zip(parts, kept):
                    if value is None:
                        raise SiteError(f"a read in block {self.layer} never fired (not computed by this model)")
                    part.append(value)
        self.hidden = torch.cat(outputs)
        self.layer += 1
        return [torch.cat(part) for part in parts]
