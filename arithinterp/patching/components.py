"""Components of a model by name: ``embed``, ``attn3``, ``mlp3``, ``L3H2`` (a head), ``L3N17`` (a
neuron), each optionally at a position (``mlp3@final``); :func:`parse_components` reads them and
:func:`default_components` lists a model's embedding, attention and MLP outputs."""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence


from arithinterp.checks import check_belongs
from arithinterp.errors import ConfigError, SiteError, accepted
from arithinterp.tasks.positions import predicting_position
from arithinterp.types import HookedModel, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

_COMPONENT = re.compile(r"^(?:(embed)|attn(\d+)|mlp(\d+)|L(\d+)H(\d+)|L(\d+)N(\d+))(?:@([\w\[\]+-]+))?$")
COMPONENT_FORMS = (
    "'embed', 'attn{layer}', 'mlp{layer}', 'L{layer}H{head}', 'L{layer}N{neuron}', each optionally '@position'"
)


@dataclass(frozen=True)
class Component:
    """A parsed component name (:func:`parse_components`).

    Attributes:
        name: The name as given.
        kind: ``"embed"``, ``"attn"``, ``"mlp"``, ``"head"`` or ``"neuron"``.
        layer: Its layer (0 for the embedding).
        unit: The head or neuron, else ``None``.
        position: A named position or an int as a string; ``None``: every position.
    """

    name: str
    kind: str  # embed | attn | mlp | head | neuron
    layer: int
    unit: Optional[int]
    position: Optional[str]  # a named position or an int as a string; None = every position

    @property
    def site(self) -> str:
        """The site the component is read or ablated at."""
        return {"attn": "attn_out", "mlp": "mlp_out", "head": "attn_z", "neuron": "mlp_post",
                "embed": "resid_pre"}[self.kind]


def parse_components(model: HookedModel, components: Sequence[str], allowed: Sequence[str],
                     prompts: Optional[PromptSet] = None) -> list[Component]:
    """Parse component names; with ``prompts``, an integer ``@position`` must lie inside them.

    Args:
        model: The hooked model (its layers, heads and neurons bound the names).
        components: Names as :data:`COMPONENT_FORMS` (one name or a list).
        allowed: The kinds accepted here (``"embed"``, ``"attn"``, ``"mlp"``, ``"head"``, ``"neuron"``).
        prompts: The prompts a ``@position`` must lie inside, or ``None``.

    Returns:
        One parsed component per name.

    Raises:
        ConfigError: ``components`` is empty or names a component twice, a name cannot be read, or its kind
            is not allowed.
        SiteError: a layer, head, neuron or position is out of range.
    """
    if isinstance(components, str):
        components = [components]
    components = list(components)
    if not components:
        raise ConfigError(f"components is empty; name components as {COMPONENT_FORMS}")
    repeated = sorted(c for c, n in collections.Counter(map(str, components)).items() if n > 1)
    if repeated:  # one component twice would be read, ablated or reported twice
        raise ConfigError(f"components names {repeated} more than once; name each component once")
    cfg, parsed = model.cfg, []
    for name in components:
        match = _COMPONENT.match(str(name))
        if not match:
            raise ConfigError(f"cannot read component {name!r}; accepted forms: {COMPONENT_FORMS}")
        embed, attn, mlp, h_layer, head, n_layer, neuron, position = match.groups()
        if embed:
            kind, layer, unit = "embed", 0, None
        elif attn is not None:
            kind, layer, unit = "attn", int(attn), None
        elif mlp is not None:
            kind, layer, unit = "mlp", int(mlp), None
        elif head is not None:
            kind, layer, unit = "head", int(h_layer), int(head)
        else:
            kind, layer, unit = "neuron", int(n_layer), int(neuron)
        if kind not in allowed:
            raise ConfigError(f"component {name!r} is a {kind}; this analysis accepts {accepted(allowed)}")
        if not 0 <= layer < cfg.n_layers:
            raise SiteError(f"component {name!r}: layer {layer} is out of range; accepted: 0..{cfg.n_layers - 1}")
        if kind == "head" and unit is not None and not 0 <= unit < cfg.n_heads:
            raise SiteError(f"component {name!r}: head {unit} is out of range; accepted: 0..{cfg.n_heads - 1}")
        if kind == "neuron" and unit is not None and not 0 <= unit < cfg.d_mlp:
            raise SiteError(f"component {name!r}: neuron {unit} is out of range; accepted: 0..{cfg.d_mlp - 1}")
        if kind in ("mlp", "neuron") and getattr(cfg, "attn_only", False):
            raise SiteError(f"component {name!r} needs MLPs but this model is attention-only")
        old = re.fullmatch(r"answer(\d+)", position or "")
        if old:  # the spelling that named the position *predicting* answer token k
            k = int(old[1])
            raise ConfigError(f"component {name!r}: '@{position}' is not a position; answer tokens are named as "
                              f"positions everywhere, answer[k] being answer token k (written order, from 0): "
                              f"the position that predicts answer token {k} is '@{predicting_position(k)}'")
        if prompts is not None and position is not None:
            try:  # refused before any forward: never wrapped around to another token
                prompts.locate(position, answers=scored_answer_tokens(prompts) - 1)
            except SiteError as error:
                fed = "answer" in position and prompts.scoring != "full-answer"
                hint = "; answer positions need the answer fed: prompts.with_scoring('full-answer')" if fed else ""
                raise SiteError(f"component {name!r}: {error}{hint}") from None
        parsed.append(Component(str(name), kind, layer, unit, position))
    return parsed


@checked
def default_components(model: HookedModel) -> list[str]:
    """``embed`` plus every attention layer and MLP: their outputs sum to the final residual stream.

    Args:
        model: The hooked model.

    Returns:
        ``["embed", "attn0", "mlp0", "attn1", ...]``.
    """
    check_belongs(model, "patching.default_components")
    names = ["embed"]
    for layer in range(model.cfg.n_layers):
        names.append(f"attn{layer}")
        if not getattr(model.cfg, "attn_only", False):
            names.append(f"mlp{layer}")
    return names


def scored_answer_tokens(prompts) -> int:
    """How many answer tokens a prompt set scores.

    Args:
        prompts: The prompts.

    Returns:
        Every answer token with ``scoring="full-answer"``, else 1.
    """
    return prompts.answer_tokens.shape[1] if prompts.scoring == "full-answer" else 1
