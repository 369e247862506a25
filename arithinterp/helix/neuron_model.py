"""The neuron preactivation model of Kantamneni & Tegmark 2025: each neuron's
preactivation over operands ``a``, ``b`` as a linear and periodic function of ``a``, ``b``,
``a+b``, fitted by gradient descent on the MSE (or exactly), quality as NRMSE,
:func:`fit_neurons` / :func:`neuron_fits` → :class:`NeuronFitResult`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError, SiteError, accepted
from arithinterp.helix.design import DEFAULT_PERIODS, check_periods, least_squares
from arithinterp.progress import progress_bar
from arithinterp.results import NON_NEGATIVE, POSITIVE, Result, build_meta
from arithinterp.types import HookedModel, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet

NEURON_METHODS = ("gd", "lstsq")


# --- neuron preactivation fits -------------------------------------------------------------------


NEURON_VARIABLES = ("a", "b", "a+b")


def _neuron_design(a: torch.Tensor, b: torch.Tensor, periods: list[float]) -> tuple[torch.Tensor, list[float]]:
    """Columns ``t / scale_t`` (3), ``cos / sin(2πt/T)`` per period and t (2·3·nT), constant."""
    ts = torch.stack([a, b, a + b], 1).double()
    scale = ts.abs().max(0).values.clamp_min(1.0)
    angle = 2 * math.pi * ts[:, None, :] / torch.tensor(periods, dtype=torch.float64)[None, :, None]  # [N, nT, 3]
    periodic = torch.stack([angle.cos(), angle.sin()], -1).reshape(ts.shape[0], -1)
    return torch.cat([ts / scale, periodic, torch.ones(ts.shape[0], 1, dtype=torch.float64)], 1), scale.tolist()


@dataclass(frozen=True)
class NeuronFitResult(Result):
    """Neuron preactivation fits (Kantamneni & Tegmark 2025):

    ``N(a, b) ≈ bias + Σ_t c_t·t + Σ_T Σ_t c_{T,t}·cos(2π/T·(t − d_{T,t}))``, t ∈ {a, b, a+b}.

    Attributes:
        neurons: The fitted neurons' indices.
        nrmse (Float[Tensor, "neuron"]): RMSE / (max − min) of each neuron's preactivation over the prompts.
        linear (Float[Tensor, "neuron 3"]): ``c_t`` per unit of t, for t = a, b, a+b.
        amplitude (Float[Tensor, "neuron period 3"]): ``c_{T,t}`` ≥ 0.
        phase (Float[Tensor, "neuron period 3"]): ``d_{T,t}`` in ``[0, T)``.
        bias (Float[Tensor, "neuron"]): The constant term.
        periods: The periods ``T``.
        method: ``"gd"`` or ``"lstsq"``.
        meta: Provenance, the prompt count and the optimiser's settings.
    """

    neurons: list
    nrmse: torch.Tensor
    linear: torch.Tensor
    amplitude: torch.Tensor
    phase: torch.Tensor
    bias: torch.Tensor
    periods: list
    method: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"neurons": "neuron", "nrmse": "neuron", "linear": "neuron ...", "amplitude": "neuron period ...",
               "phase": "neuron period ...", "bias": "neuron", "periods": "period"}
    _legal = {"method": NEURON_METHODS, "nrmse": NON_NEGATIVE, "amplitude": NON_NEGATIVE, "periods": POSITIVE}

    def predict(self, a: Any, b: Any) -> torch.Tensor:
        """The preactivations the fits give at some operands.

        Args:
            a (Int[Tensor, "n"]): First operands.
            b (Int[Tensor, "n"]): Second operands.

        Returns:
            Float[Tensor, "n neuron"]: The predicted preactivations.
        """
        ts = torch.stack([torch.as_tensor(a), torch.as_tensor(b), torch.as_tensor(a) + torch.as_tensor(b)], 1).double()
        periods = torch.tensor(self.periods, dtype=torch.float64)
        angle = 2 * math.pi / periods[None, None, :, None] * (ts[:, None, None, :] - self.phase.double()[None])
        periodic = (self.amplitude.double()[None] * angle.cos()).sum((2, 3))
        return (ts @ self.linear.double().T + periodic + self.bias.double()).float()

    def to_frame(self):
        import pandas as pd

        strongest = self.amplitude.flatten(1).argmax(1).tolist()
        n_t = len(NEURON_VARIABLES)
        return pd.DataFrame(dict(
            neuron=self.neurons, nrmse=self.nrmse.tolist(),
            strongest_period=[self.periods[i // n_t] for i in strongest],
            strongest_variable=[NEURON_VARIABLES[i % n_t] for i in strongest],
            strongest_amplitude=self.amplitude.flatten(1).max(1).values.tolist(),
        ))

    def plot(self, **kwargs):
        return draw(self, **kwargs)


@checked
def fit_neurons(
    preacts: torch.Tensor,
    a: Any,
    b: Any,
    periods: Sequence[float] = DEFAULT_PERIODS,
    *,
    method: str = "gd",
    steps: int = 3000,
    lr: float = 0.05,
    neurons: Optional[Sequence[int]] = None,
    progress: bool = True,
) -> NeuronFitResult:
    """Fit the Kantamneni & Tegmark 2025 preactivation model to each neuron, minimising the MSE.

    Every term ``c·cos(2π/T·(t − d))`` equals ``α·cos(2πt/T) + β·sin(2πt/T)`` with
    ``c = √(α² + β²)``, ``d = T·atan2(β, α)/2π``, so the model is linear in (α, β, c_t, bias)
    and its MSE is convex. Both methods report c and d in the paper's form.

    Args:
        preacts (Float[Tensor, "prompt neuron"]): Each neuron's preactivation per prompt.
        a (Int[Tensor, "prompt"]): First operands.
        b (Int[Tensor, "prompt"]): Second operands.
        periods: The periods ``T``.
        method: ``"gd"`` (full-batch Adam on the MSE, all neurons at once through the Gram matrix,
            deterministic: it starts from zero) or ``"lstsq"`` (the exact solution).
        steps: Adam steps of ``"gd"``.
        lr: Its learning rate (on standardised preactivations).
        neurons: The neurons' indices, for the result (default ``0..m-1``).
        progress: Show a progress bar.

    Returns:
        The fitted coefficients and each neuron's normalised RMSE.

    Raises:
        ConfigError: An unknown method, ``steps < 1``, ``lr <= 0`` or invalid periods.
        AnalysisError: ``preacts`` is not 2-D, or ``a`` / ``b`` do not match its rows.
    """
    if method not in NEURON_METHODS:
        raise ConfigError(f"unknown method {method!r}; accepted: {accepted(NEURON_METHODS)}")
    if preacts.ndim != 2:
        raise AnalysisError(f"preacts must be [n_prompts, n_neurons], got shape {tuple(preacts.shape)}")
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if a.shape != (preacts.shape[0],) or b.shape != a.shape:
        raise AnalysisError(f"a and b must be [{preacts.shape[0]}], got {tuple(a.shape)} and {tuple(b.shape)}")
    if steps < 1 or lr <= 0:
        raise ConfigError(f"steps must be ≥ 1 and lr > 0, got steps={steps}, lr={lr}")
    periods = check_periods(periods)
    design, scale = _neuron_design(a, b, periods)
    y = preacts.double()
    centre, spread = y.mean(0), y.std(0).clamp_min(1e-12)
    target = (y - centre) / spread  # standardised so one learning rate suits every neuron
    if method == "lstsq":
        weights = least_squares(design, target)
    else:
        gram = design.T @ design / design.shape[0]
        moment = design.T @ target / design.shape[0]
        weights = torch.zeros((design.shape[1], y.shape[1]), dtype=torch.float64, requires_grad=True)
        optimiser = torch.optim.Adam([weights], lr=lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, steps)
        for _ in progress_bar(range(steps), desc="neuron fits", disable=not progress):
            optimiser.zero_grad()
            # MSE(w) = wᵀGw − 2wᵀm + const: the exact full-batch loss, without re-reading N rows
            loss = ((weights * (gram @ weights)).sum(0) - 2 * (weights * moment).sum(0)).sum()
            loss.backward()
            optimiser.step()
            schedule.step()
        weights = weights.detach()
    weights = weights * spread[None]
    pred = design @ weights + centre
    rmse = (pred - y).pow(2).mean(0).sqrt()
    nrmse = rmse / (y.max(0).values - y.min(0).values).clamp_min(1e-12)
    n_t, n_p, m = 3, len(periods), y.shape[1]
    linear = weights[:n_t].T / torch.tensor(scale, dtype=torch.float64)
    periodic = weights[n_t:n_t + 2 * n_t * n_p].T.reshape(m, n_p, n_t, 2)
    alpha, beta = periodic[..., 0], periodic[..., 1]
    tau = torch.tensor(periods, dtype=torch.float64)[None, :, None]
    amplitude = (alpha.pow(2) + beta.pow(2)).sqrt()
    phase = torch.remainder(torch.atan2(beta, alpha) * tau / (2 * math.pi), tau)
    bias = weights[-1] + centre
    training: dict[str, Any] = dict(steps=steps, lr=lr) if method == "gd" else {}
    return NeuronFitResult(
        neurons=list(range(m)) if neurons is None else [int(n) for n in neurons],
        nrmse=nrmse.float(), linear=linear.float(), amplitude=amplitude.float(), phase=phase.float(),
        bias=bias.float(), periods=periods, method=method,
        meta=build_meta(n_prompts=y.shape[0], **training),
    )


@checked
def neuron_fits(
    model: HookedModel,
    prompts: PromptSet,
    layer: int,
    *,
    neurons: Optional[Sequence[int]] = None,
    periods: Sequence[float] = DEFAULT_PERIODS,
    site: str = "mlp_pre",
    positions: str = "final",
    batch_size: int = 512,
    progress: bool = True,
    **kwargs: Any,
) -> NeuronFitResult:
    """:func:`fit_neurons` on a model's MLP preactivations.

    Args:
        model: The hooked model.
        prompts: The prompts (their operands ``a`` and ``b`` are the variables).
        layer: The MLP's layer.
        neurons: The neurons to fit (default: all).
        periods: The periods ``T``.
        site: ``"mlp_pre"`` or ``"mlp_post"``.
        positions: The one position read (default the last token).
        batch_size: Prompts per forward.
        progress: Show progress bars.
        **kwargs: Options of :func:`fit_neurons` (``method``, ``steps``, ``lr``).

    Returns:
        The fits, with the model's provenance in ``meta``.

    Raises:
        SiteError: Another site, or a layer or neuron out of range.
        ModelMismatchError: The prompts were built for another model.
    """
    check_belongs(model, "helix.neuron_fits", prompts=prompts)
    from arithinterp import sites as site_lib
    from arithinterp.activations import collect

    if site not in ("mlp_pre", "mlp_post"):
        raise SiteError(f"neuron fits read 'mlp_pre' or 'mlp_post', got {site!r}")
    acts = collect(model, prompts, sites=[site], layers=[layer], positions=positions, batch_size=batch_size,
                   progress=progress)
    chosen = site_lib.check_index("neuron", neurons, int(model.cfg.d_mlp))
    result = fit_neurons(acts.get(site, layer, positions)[:, chosen], prompts.a, prompts.b, periods,
                         neurons=chosen, progress=progress, **kwargs)
    meta = dict(result.meta, **build_meta(model, layer=layer, site=site, position=positions))
    return dataclasses.replace(result, meta=meta)
