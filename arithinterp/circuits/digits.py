"""One circuit per answer digit: edge scores on teacher-forced answer digits (Quirke & Barez 2024).

A multi-digit answer is emitted token by token, and Quirke & Barez read each answer digit as
computed one token before it is emitted, by heads that read operand digits n and n − 1.
:func:`digit_circuits` scores every edge of the model's graph once per answer token ``k``: the
pair's prompts are teacher-forced with the answer's first ``k`` tokens
(:func:`arithinterp.patching.digits.digit_pairs`, the same feeding as
:func:`arithinterp.patching.digit_ablation`) and the metric is read at the position that emits
token ``k``. With pairs that vary one digit column (:func:`arithinterp.patching.digits.vary_digit`)
the result says which heads carry that column into which answer digit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from arithinterp.checks import check_belongs, check_choice, check_pairs
from arithinterp.circuits.circuit import SCORE_METHODS, Circuit, score_edges
from arithinterp.circuits.edges import run_edge_sets
from arithinterp.circuits.graph import EdgeGraph
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.metrics import metric_name
from arithinterp.patching import DIGIT_FEEDS, digit_pairs
from arithinterp.results import NON_NEGATIVE, Result, build_meta
from arithinterp.tasks.places import answer_token_places
from arithinterp.types import IndexList, IntegrationSteps, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs
    from arithinterp.types import HookedModel


@dataclass(frozen=True)
class DigitCircuits(Result):
    """Edge scores per answer token.

    ``answer_tokens [K]``: the answer token indices scored (0 = the first emitted; their places
    in ``meta["answer_places"]`` where every answer writes one digit per token in as many tokens);
    ``scores [K, n_edges]`` the mean edge score, ``pair_scores [K, N, n_edges]`` per pair;
    ``clean`` / ``corrupt`` ``[K, N]`` the metric of the unpatched runs at each digit (their
    difference is how much the pairs move that digit at all). Edge descriptions as in
    :class:`~arithinterp.circuits.Circuit`; :meth:`circuit` gives one digit's ``Circuit``.
    """

    answer_tokens: list
    scores: torch.Tensor
    pair_scores: torch.Tensor
    clean: torch.Tensor
    corrupt: torch.Tensor
    edges: list
    senders: list
    receivers: list
    channels: list
    positions: list
    method: str
    metric: str
    feed: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"answer_tokens": "digit", "scores": "digit edge", "pair_scores": "digit pair edge",
               "clean": "digit pair", "corrupt": "digit pair", "edges": "edge", "senders": "edge", "receivers": "edge",
               "channels": "edge", "positions": "edge"}
    _legal = {"answer_tokens": NON_NEGATIVE, "feed": DIGIT_FEEDS}

    def _row(self, answer_token: int) -> int:
        if answer_token not in self.answer_tokens:
            raise ConfigError(f"answer token {answer_token!r} was not scored; accepted: {self.answer_tokens}")
        return self.answer_tokens.index(answer_token)

    def graph(self) -> EdgeGraph:
        from arithinterp.engine.edges import Layout

        return EdgeGraph(Layout(**self.meta["layout"]), self.meta.get("graph_positions"))

    def circuit(self, answer_token: int) -> Circuit:
        """The :class:`~arithinterp.circuits.Circuit` of one answer token (every edge kept): extract
        and evaluate it on ``patching.digits.digit_pairs(pairs, answer_token, feed)``."""
        i = self._row(answer_token)
        graph = self.graph()
        return Circuit(
            scores=self.scores[i].clone(), pair_scores=self.pair_scores[i].clone(),
            kept=torch.ones(len(self.edges), dtype=torch.bool), edges=list(self.edges), senders=list(self.senders),
            receivers=list(self.receivers), channels=list(self.channels), positions=list(self.positions),
            nodes=[n.name for n in graph.nodes], method=self.method, metric=self.metric,
            meta={**self.meta, "answer_token": answer_token, "feed": self.feed, "extraction": "all"},
        )

    def sender_scores(self) -> tuple[list[str], torch.Tensor]:
        """Each sender's outgoing edge scores summed, ``[n_senders, K]``, with the sender names in
        graph order. For EAP and EAP-IG the sum is the sender's own attribution (its output's
        change times the gradient of everything downstream); for exact scores, the sum of its
        edges' separate effects."""
        names = [n.name for n in self.graph().senders]
        index = {name: i for i, name in enumerate(names)}
        rows = torch.tensor([index[s] for s in self.senders])
        out = torch.zeros(len(names), len(self.answer_tokens))
        out.index_add_(0, rows, self.scores.T.float())
        return names, out

    @property
    def gap(self) -> torch.Tensor:
        """Mean ``clean − corrupt`` metric per answer token ``[K]``."""
        return (self.clean - self.corrupt).mean(1)

    def agreement(self, other: "DigitCircuits"):
        """Per answer token, the Pearson correlation of these edge scores with ``other``'s (e.g.
        EAP-IG against exact patching on the same pairs) and the largest absolute difference."""
        import pandas as pd

        if not isinstance(other, DigitCircuits):
            raise AnalysisError(f"expected DigitCircuits (from circuits.digit_circuits), got {type(other).__name__}")
        if other.edges != self.edges:
            raise AnalysisError("the two results score different graphs (edges differ); score the same model and "
                                "positions")
        rows = []
        for k in self.answer_tokens:
            if k not in other.answer_tokens:
                continue
            a, b = self.scores[self._row(k)].double(), other.scores[other._row(k)].double()
            r = float(torch.corrcoef(torch.stack([a, b]))[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")
            rows.append(dict(answer_token=k, pearson=r, max_abs_difference=float((a - b).abs().max()),
                             n_edges=len(a), method=self.method, other_method=other.method))
        if not rows:
            raise AnalysisError(f"no answer token is scored in both results ({self.answer_tokens} and "
                                f"{other.answer_tokens})")
        return pd.DataFrame(rows)

    def to_frame(self):
        """One row per (answer token, edge): the edge, its sender, receiver, channel, position and score."""
        import pandas as pd

        frames = []
        for i, k in enumerate(self.answer_tokens):
            frames.append(pd.DataFrame(dict(
                answer_token=k, edge=self.edges, sender=self.senders, receiver=self.receivers, channel=self.channels,
                position=self.positions, score=self.scores[i].tolist(),
            )))
        frame = pd.concat(frames, ignore_index=True)
        frame["method"], frame["metric"], frame["feed"] = self.method, self.metric, self.feed
        frame["n_pairs"] = self.meta.get("n_pairs")
        return frame

    def plot(self, **kwargs):
        """Senders × answer tokens: each sender's summed edge score per digit (see viz.circuits)."""
        return draw(self, **kwargs)


@checked
def digit_circuits(
    model: HookedModel,
    pairs: PromptPairs,
    method: str = "eap-ig",
    *,
    answer_tokens: Optional[IndexList] = None,
    feed: str = "own",
    positions: Optional[Sequence] = None,
    ig_steps: IntegrationSteps = 5,
    metric: Union[str, Callable] = "logit_diff",
    direction: str = "denoise",
    batch_size: PositiveInt = 64,
    progress: bool = True,
) -> DigitCircuits:
    """Score every edge once per answer token (default: every token the answers have).

    For answer token ``k`` the pairs are teacher-forced with the answer's first ``k`` tokens
    (``feed``: ``"own"`` answer per prompt, or the ``"clean"`` one after both; see
    :func:`arithinterp.patching.digits.digit_pairs`) and :func:`arithinterp.circuits.score_edges`
    scores the edges at the position that emits token ``k``: ``method`` ``"exact"`` path
    patching, ``"eap"`` or ``"eap-ig"`` (``ig_steps`` interpolations); ``metric`` compares the clean
    and corrupt answers' token ``k`` (``"logit_diff"``), or scores the clean one (``"logprob"``,
    ``"prob"``), or is a callable. ``positions`` (e.g. ``["a[0]", "a[1]", "a", "emit"]``) makes
    the edges positional.

    Args:
        model: The hooked model.
        pairs: Clean / corrupt pairs with multi-token answers.
        method: ``"exact"``, ``"eap"`` or ``"eap-ig"``.
        answer_tokens: The answer tokens to score (default: every token all answers have).
        feed: ``"own"`` or ``"clean"``.
        positions: Position names that make the edges positional (default: edges over all positions).
        ig_steps: Interpolation steps of ``"eap-ig"``.
        metric: The pair metric, or a callable.
        direction: ``"denoise"`` or ``"noise"``.
        batch_size: Pairs per batch.
        progress: Show progress bars.

    Returns:
        One circuit's edge scores per answer token, with each token's unpatched baselines.

    Raises:
        ConfigError: An unknown method or feed, or answer tokens repeated or past the answers.
        AnalysisError: Pairs that cannot be patched.
        ModelMismatchError: The pairs were built for another model.
    """
    check_belongs(model, "circuits.digit_circuits", pairs=pairs)
    check_pairs(pairs)
    check_choice("method", method, SCORE_METHODS)
    check_choice("feed", feed, DIGIT_FEEDS)
    width = int(min(pairs.clean.n_answer_tokens.min(), pairs.corrupt.n_answer_tokens.min()))
    chosen = list(range(width)) if answer_tokens is None else list(answer_tokens)
    if not chosen or len(set(chosen)) != len(chosen):
        raise ConfigError(f"answer_tokens must be distinct answer token indices, got {answer_tokens!r}")
    outside = [k for k in chosen if k >= width]
    if outside:
        raise ConfigError(f"answer_tokens {outside} are past the answers: every pair's answers have {width} token(s), "
                          f"so the accepted indices are 0..{width - 1}")
    graph = EdgeGraph.of(model, positions)
    feds = {k: digit_pairs(pairs, k, feed) for k in chosen}  # every answer token is checked before the first scoring
    graph_meta: dict = {}  # the graph as score_edges records it (the same for every answer token)
    per, clean, corrupt, same = [], [], [], []
    cost = dict(forwards=0) if method == "exact" else dict(passes=0)
    for k in chosen:
        fed = feds[k]
        circuit = score_edges(model, fed, method, positions=positions, ig_steps=ig_steps, metric=metric,
                              direction=direction, batch_size=batch_size, progress=progress)
        base = run_edge_sets(model, fed, graph, torch.zeros(0, graph.n_edges), metric,  # unpatched runs only
                             progress=False)
        per.append(circuit.pair_scores)
        clean.append(base["clean"])
        corrupt.append(base["corrupt"])
        same.append(fed.meta["same_answer_token"])
        for key in cost:  # the scoring's own forwards (or passes), every answer token together
            cost[key] += circuit.meta[key]
        graph_meta = {key: circuit.meta[key] for key in ("layout", "graph_positions")}
    pair_scores = torch.stack(per)
    meta = build_meta(model, n_pairs=len(pairs), vary=getattr(pairs, "vary", None), direction=direction,
                      answer_places=answer_token_places(pairs.clean),
                      same_answer_token=same, ig_steps=ig_steps if method.startswith("eap-ig") else None, **graph_meta,
                      **cost)
    return DigitCircuits(
        answer_tokens=chosen, scores=pair_scores.mean(1), pair_scores=pair_scores, clean=torch.stack(clean),
        corrupt=torch.stack(corrupt), edges=[e.name for e in graph.edges], senders=[e.sender for e in graph.edges],
        receivers=[e.receiver for e in graph.edges], channels=[e.channel for e in graph.edges],
        positions=[e.position for e in graph.edges], method=method, metric=metric_name(metric), feed=feed, meta=meta,
    )
