"""Benchmark: a probe sweep over every layer of 5,000 prompts x d_model 256.

Synthetic activations ``[5000, n_layers, 1, 256]`` with a 10-class label written along class
directions at increasing strength per layer. For each probe kind, ``probes.probe_layers`` runs 5-fold
cross-validation plus the shuffled-label control and the full-data fit at every layer; the median
wall time of ``--repeats`` runs is reported. The reference is the same sweep done with
scikit-learn (``StandardScaler`` + ``LogisticRegression(lbfgs)`` per fold, same folds and
objective), timed in the same process, with its held-out accuracy for comparison.

    python benchmarks/probes.py [--prompts 5000] [--d-model 256] [--layers 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from arithinterp import probes
from arithinterp.activations import Activations
from arithinterp.probes.cross_validation import make_folds


def synthetic(n: int, d: int, n_layers: int, seed: int = 0) -> tuple[Activations, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 10, (n,), generator=g)
    directions = torch.randn(10, d, generator=g)
    X = torch.randn(n, n_layers, 1, d, generator=g)
    for layer in range(n_layers):
        X[:, layer, 0] += (layer / max(n_layers - 1, 1)) * 0.6 * directions[label]
    return Activations(data={"resid_post": X}, layers=list(range(n_layers)), positions=["final"]), label


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def sklearn_sweep(acts: Activations, label: torch.Tensor, cv: int = 5, seed: int = 0) -> np.ndarray:
    """The reference: the same folds, shuffled control and full fit, with scikit-learn."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    y = label.numpy()
    folds = make_folds(label, cv, True, seed)
    shuffled = label[torch.randperm(len(label), generator=torch.Generator().manual_seed(seed))].numpy()
    scores = []
    for layer in range(acts.data["resid_post"].shape[1]):
        X = acts.data["resid_post"][:, layer, 0].numpy()
        fit = lambda X, y: make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=1000)).fit(X, y)  # noqa: E731
        scores.append(np.mean([fit(X[tr], y[tr]).score(X[te], y[te]) for tr, te in folds]))
        [fit(X[tr], shuffled[tr]).score(X[te], shuffled[te]) for tr, te in folds]
        fit(X, y)
    return np.array(scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5000)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference-repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kinds", default="logistic,circular,ridge,mlp")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    acts, label = synthetic(args.prompts, args.d_model, args.layers)
    probes.probe_layers(acts, label, layers=[0], progress=False)  # warm-up: imports and first-call costs

    rows = []
    for kind in args.kinds.split(","):
        target = label.float() if kind == "ridge" else label
        repeats = 1 if kind == "mlp" else args.repeats
        seconds, result = timed(lambda: probes.probe_layers(acts, target, kind=kind, progress=False), repeats)
        rows.append((f"arithinterp {kind}", seconds, repeats, result.mean[:, 0].tolist(), result.metric))
    if "logistic" in args.kinds:
        seconds, scores = timed(lambda: sklearn_sweep(acts, label), args.reference_repeats)
        rows.append(("scikit-learn logistic (reference)", seconds, args.reference_repeats, scores.tolist(), "accuracy"))

    print(f"Probe sweep: {args.prompts} prompts x d_model {args.d_model}, {args.layers} layers, 5-fold CV "
          f"+ shuffled control + full fit per layer ({args.threads} thread(s))\n")
    print("| implementation | median s | runs | s per layer | held-out score per layer |")
    print("|---|---:|---:|---:|---|")
    for name, seconds, repeats, scores, metric in rows:
        shown = ", ".join(f"{s:.3f}" for s in scores)
        print(f"| {name} | {seconds:.2f} | {repeats} | {seconds / args.layers:.2f} | {metric}: {shown} |")


if __name__ == "__main__":
    main()
