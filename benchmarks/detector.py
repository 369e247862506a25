"""Benchmark: the default error detector and selective repair on zoo:add-3digit-weak.

Three disjoint samples of the model's held-out problems (one per seed; problems drawn by an
earlier seed are left out of later ones). On each, the default ``ErrorDetector()`` is fitted on
``--fit`` problems and scored on ``--test`` others: accuracy against the majority-class
baseline, balanced accuracy, AUROC, error precision / recall when flagging the riskiest 10%,
and the method and threshold that cross-validation chose. Then ``repair`` re-asks the flagged
test prompts (the vote policy: a few-shot prefix does not fit this 16-token model) under each
acceptance rule, counting errors fixed, correct answers broken and the net change. With
``--transfer TEMPLATE`` the detector is also scored on the test problems written in another
format. Markdown tables go to stdout (and to ``docs/probes.md`` by hand).

    python benchmarks/detector.py [--fit 7790] [--test 2000] [--seeds 11 12 13] [--no-repair]
                                  [--transfer "+{a}+{b}="]

``--prefix`` times instead what the detector runs the model for on one prompt set, on a
random-weight Llama of SmolLM-135M's shape (``--prefix-layers`` of its 30 layers; built by
``benchmarks/evaluate.py``) with 3-shot two-digit prompts: generating the answers with and without
the shared prefix computed once (``engine.decode``), and reading every layer's slot activations
through ``collect`` (whole forwards) and through the shared-prefix base run, side by side, medians
of ``--runs``. The largest differences between the two ways are printed too.

    python benchmarks/detector.py --prefix [--prefix-prompts 400] [--prefix-layers 8] [--runs 3]

``--speed`` times ``ErrorDetector(layers=None).fit`` itself (every layer side by side, no layer
search) on ``--fit`` problems of each seed (the model's answers given, as above): the batched solver (every probe of a feature set in one vectorised
L-BFGS, the default) against the per-target one it replaced (one joint L-BFGS per target), in
alternating runs in one process, with the cross-validated scores both ways against a tightly
converged reference fit (gradient tolerance 1e-7, at most 1,000 iterations) and their largest
difference from it.

    python benchmarks/detector.py --speed [--fit 7790] [--seeds 11 12 13] [--runs 1]

``--slices K`` measures the detector the way the report's error stage builds it: ``K`` disjoint
slices of ``--size`` held-out problems (consecutive slices of one seeded order), each fitted on
its first two thirds and scored on the last third, with the earlier defaults
(``layers=None, threshold="auto"``: every layer side by side, the threshold within one point of
the best accuracy) and the current ones side by side, fit times included.

    python benchmarks/detector.py --slices 5 [--size 6000]

``--gemma GGUF`` measures it on a real model's own errors: Gemma 3 270M on the 900 prompts
``{a}+{b}=`` (a, b in 10..39, three solved examples before each), scored on three disjoint
thirds for each of ``--seeds`` (fitted on the other two thirds), with a bootstrap 95% interval
of each third's balanced accuracy and AUROC.

    python benchmarks/detector.py --gemma /path/to/gemma-3-270m-q4_k_m.gguf [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

import arithinterp as ai
from arithinterp import probes
from arithinterp.models import zoo
from arithinterp.tasks import prompts_for_pairs


def samples(model, entry, seeds, size):
    """One disjoint sample of ``size`` held-out problems per seed."""
    used: set = set()
    for seed in seeds:
        prompts = zoo.held_out_prompts(model, entry, limit=2 * size + len(used), seed=seed)
        keep = [i for i, pair in enumerate(zip(prompts.a.tolist(), prompts.b.tolist())) if pair not in used][:size]
        if len(keep) < size:
            raise SystemExit(f"seed {seed}: only {len(keep)} unused held-out problems")
        prompts = prompts[torch.tensor(keep)]
        used |= set(zip(prompts.a.tolist(), prompts.b.tolist()))
        yield seed, prompts


def spread(values):
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0:.3f}"


def bench_prefix(n_prompts: int, n_layers: int, runs: int) -> None:
    """Generation and slot reading with and without the shared prefix computed once."""
    import sys
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).parent))
    from evaluate import build, prompts_for  # the SmolLM-135M-shaped random Llama and its prompts

    from arithinterp.engine import decode
    from arithinterp.probes.slots import shared_prefix_slots

    shape = SimpleNamespace(vocab=49152, d_model=576, d_mlp=1536, layers=n_layers, heads=9, kv_heads=3)
    folder = Path(tempfile.mkdtemp()) / "smollm-shaped"
    build(folder, shape)
    model = ai.load_model(str(folder))
    prompts = prompts_for(model, n_prompts, 3)
    prompts[:4].evaluate(model)  # warm-up and the one-time decode-path check
    layers = list(range(n_layers))
    times: dict = {key: [] for key in ("generate, prefix per prompt", "generate, prefix once",
                                       "read slots, collect", "read slots, prefix once")}
    out: dict = {}
    for _ in range(runs):
        for key in times:
            decode._SHARES_PREFIX[model] = key != "generate, prefix per prompt"
            start = time.perf_counter()
            if key.startswith("generate"):
                out[key] = prompts.evaluate(model)
            elif key == "read slots, collect":
                out[key] = probes.answer_activations(model, prompts, out["generate, prefix once"], "resid_post",
                                                     layers=layers).data["resid_post"]
            else:
                out[key] = shared_prefix_slots(model, prompts, out["generate, prefix once"], "resid_post", layers, 256)
            times[key].append(time.perf_counter() - start)
    same = torch.equal(out["generate, prefix per prompt"].generated_tokens, out["generate, prefix once"].generated_tokens)
    diff = float((out["read slots, collect"] - out["read slots, prefix once"]).abs().max())
    median = {k: statistics.median(v) for k, v in times.items()}
    tokens = prompts.tokens
    shared = int((tokens == tokens[:1]).all(0).int().argmin())
    load = os.getloadavg()[0]
    print(f"Random-weight Llama of SmolLM-135M's shape with {n_layers} of its 30 layers, {len(prompts)} 3-shot two-digit "
          f"prompts ({tokens.shape[1]} tokens at most, the first {shared} shared), {prompts.answer_tokens.shape[1]} answer "
          f"tokens, every layer's resid_post read; median of {runs} alternating runs, one CPU thread; load average "
          f"{load:.1f}.\n")
    print("| step | median time | runs |")
    print("|---|---|---|")
    for key, values in times.items():
        print(f"| {key} | {median[key]:.2f} s | {', '.join(f'{t:.2f}' for t in values)} |")
    before = median["generate, prefix per prompt"] + median["read slots, collect"]
    after = median["generate, prefix once"] + median["read slots, prefix once"]
    print(f"\nper prompt set (generate, then read): {before:.2f} s before, {after:.2f} s now (**{before / after:.1f}×**); "
          f"fit and evaluate on one set used to pay it twice ({2 * before:.2f} s), now generation once "
          f"({after + median['read slots, prefix once']:.2f} s). Same greedy tokens: {same}; largest difference of "
          f"the slot activations: {diff:.1e}.")


SCORES = ("balanced_accuracy", "accuracy", "auroc")


def bench_speed(model, entry, seeds, size: int, runs: int) -> None:
    """``fit`` with ``solver="batched"`` against ``"per-target"`` (time, alternating in one process),
    and both against a tightly converged reference (scores): the same objective driven to a
    gradient tolerance of 1e-7 in at most 1,000 iterations, once per seed."""
    times: dict = {"per-target": [], "batched": []}
    rows = []
    tight_probe = probes.LogisticProbe(C=0.05, max_iter=1000, tol=1e-7)
    for seed, prompts in samples(model, entry, seeds, size):
        evaluation = prompts.evaluate(model)
        fitted: dict = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", probes.DetectorBaselineWarning)
            start = time.perf_counter()
            fitted["reference"] = probes.ErrorDetector(random_state=seed, probe=tight_probe, layers=None).fit(
                model, prompts, evaluation)
            print(f"seed {seed} reference: {time.perf_counter() - start:.1f} s", flush=True)
            for _ in range(runs):
                for solver in times:
                    start = time.perf_counter()
                    fitted[solver] = probes.ErrorDetector(random_state=seed, solver=solver, layers=None).fit(
                        model, prompts, evaluation)
                    times[solver].append(time.perf_counter() - start)
                    print(f"seed {seed} {solver}: {times[solver][-1]:.1f} s", flush=True)
        ref = fitted["reference"]
        gap = {solver: max(abs(fitted[solver].meta_["validation"][m][k] - ref.meta_["validation"][m][k])
                           for m in probes.DETECTOR_METHODS for k in SCORES) for solver in times}
        rows.append(dict(seed=seed, fitted=fitted, gap=gap))
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n`ErrorDetector().fit` on {size:,} problems of `zoo:add-3digit-weak` (answers given), one CPU thread, "
          f"median of {len(times['batched'])} fits each way, load average {os.getloadavg()[0]:.1f}: per-target "
          f"{median['per-target']:.1f} s, batched {median['batched']:.1f} s (**{median['per-target'] / median['batched']:.1f}×**)."
          f"\n")
    print("| seed | per-target | batched | ratio |\n|---|---:|---:|---:|")
    for i, r in enumerate(rows):
        own = {k: statistics.median(v[i * runs:(i + 1) * runs]) for k, v in times.items()}
        print(f"| {r['seed']} | {own['per-target']:.1f} s | {own['batched']:.1f} s | {own['per-target'] / own['batched']:.2f} |")
    print(f"| **median** | **{median['per-target']:.1f} s** | **{median['batched']:.1f} s** "
          f"| **{median['per-target'] / median['batched']:.2f}** |\n")
    print("| seed | fit | chosen (threshold) | " + " | ".join(
        f"{m} bal. acc. / acc. / AUROC" for m in probes.DETECTOR_METHODS) + " | largest difference from the reference |")
    print("|---|---|---|" + "---|" * len(probes.DETECTOR_METHODS) + "---:|")
    for r in rows:
        for solver in ("reference", "per-target", "batched"):
            det = r["fitted"][solver]
            cells = " | ".join(" / ".join(f"{det.meta_['validation'][m][k]:.4f}" for k in SCORES)
                               for m in probes.DETECTOR_METHODS)
            gap = f"{r['gap'][solver]:.4f}" if solver in r["gap"] else ""
            print(f"| {r['seed']} | {solver} | {det.method_} ({det.thresholds_[det.method_]:.3f}) | {cells} | {gap} |")


def _row(detector, result) -> dict:
    m = result.metrics()
    return dict(layers=detector.layers_, method=detector.method_, balanced=m["balanced_accuracy"], auroc=m["auroc"],
                accuracy=m["accuracy"], majority=m["majority_baseline"], n=m["n"], errors=m["n_errors"],
                beats=detector.meta_["beats_majority_baseline"])


def _bootstrap(result, draws: int = 1000, seed: int = 0) -> dict:
    """95% percentile intervals of balanced accuracy and AUROC over resampled prompts."""
    import numpy as np
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score

    column = result.methods.index(result.method)
    correct = result.correct.numpy()
    called, score = result.predicted_correct[:, column].numpy(), result.scores[:, column].numpy()
    rng, balanced, auroc = np.random.default_rng(seed), [], []
    for _ in range(draws):
        i = rng.integers(0, len(correct), len(correct))
        if correct[i].all() or not correct[i].any():
            continue
        balanced.append(balanced_accuracy_score(correct[i], called[i]))
        auroc.append(roc_auc_score(correct[i], score[i]))
    return dict(balanced_ci=np.percentile(balanced, [2.5, 97.5]), auroc_ci=np.percentile(auroc, [2.5, 97.5]))


EARLIER = dict(layers=None, threshold="auto")  # the defaults before the layer search and the balanced threshold


def bench_slices(model, entry, slices: int, size: int) -> None:
    """The report's construction on disjoint slices, earlier defaults against current ones."""
    prompts = zoo.held_out_prompts(model, entry, limit=slices * size, seed=0)
    evaluation = prompts.evaluate(model)
    rows = []
    for k in range(slices):
        part = torch.arange(k * size, (k + 1) * size)
        fit, test = part[: size * 2 // 3], part[size * 2 // 3:]
        for name, params in (("earlier", EARLIER), ("current", {})):
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", probes.DetectorBaselineWarning)
                detector = probes.ErrorDetector(**params).fit(model, prompts[fit], evaluation[fit])
            seconds = time.perf_counter() - start
            rows.append(dict(slice=k, defaults=name, seconds=seconds,
                             **_row(detector, detector.evaluate(model, prompts[test], evaluation[test]))))
            print(rows[-1], flush=True)
    print(f"\n{slices} disjoint slices of {size:,} held-out problems of `zoo:add-3digit-weak`, fitted on "
          f"{size * 2 // 3:,}, scored on {size - size * 2 // 3:,}; one CPU thread, load average "
          f"{os.getloadavg()[0]:.1f}.\n")
    print("| slice | defaults | layers | scored (errors) | balanced accuracy | AUROC | accuracy | majority baseline "
          "| fit |\n|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['slice']} | {r['defaults']} | {r['layers']} | {r['n']} ({r['errors']}) | {r['balanced']:.3f} "
              f"| {r['auroc']:.3f} | {r['accuracy']:.3f} | {r['majority']:.3f} | {r['seconds']:.1f} s |")
    for name in ("earlier", "current"):
        sel = [r for r in rows if r["defaults"] == name]
        print(f"- {name}: balanced accuracy mean {statistics.mean(r['balanced'] for r in sel):.3f}, min "
              f"{min(r['balanced'] for r in sel):.3f}; AUROC mean {statistics.mean(r['auroc'] for r in sel):.3f}; "
              f"median fit {statistics.median(r['seconds'] for r in sel):.1f} s")


def bench_gemma(path: str, seeds) -> None:
    """Gemma 3 270M's own errors on two-digit addition, three disjoint thirds per seed."""
    from arithinterp.tasks import arithmetic

    model = ai.load_model(path)
    prompts = arithmetic(model, a=range(10, 40), b=range(10, 40), template="{a}+{b}=", few_shot=3)
    evaluation = prompts.evaluate(model)
    n, rows = len(prompts), []
    for seed in seeds:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        for third in range(3):
            test = order[third * n // 3:(third + 1) * n // 3]
            fit = torch.cat([order[: third * n // 3], order[(third + 1) * n // 3:]])
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", probes.DetectorBaselineWarning)
                detector = probes.ErrorDetector().fit(model, prompts[fit], evaluation[fit])
            seconds = time.perf_counter() - start
            result = detector.evaluate(model, prompts[test], evaluation[test])
            rows.append(dict(seed=seed, third=third, seconds=seconds, warned=bool(caught), **_row(detector, result),
                             **_bootstrap(result)))
            print(rows[-1], flush=True)
    print(f"\nGemma 3 270M, {n} prompts, accuracy {evaluation.accuracy:.3f}; one CPU thread.\n")
    print("| seed | third | layers | method | scored (errors) | balanced accuracy [95% CI] | AUROC [95% CI] | accuracy "
          "| majority baseline | fit |\n|---|---|---|---|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seed']} | {r['third']} | {r['layers']} | {r['method']} | {r['n']} ({r['errors']}) "
              f"| {r['balanced']:.3f} [{r['balanced_ci'][0]:.3f}, {r['balanced_ci'][1]:.3f}] "
              f"| {r['auroc']:.3f} [{r['auroc_ci'][0]:.3f}, {r['auroc_ci'][1]:.3f}] | {r['accuracy']:.3f} "
              f"| {r['majority']:.3f} | {r['seconds']:.0f} s |")
    print(f"- balanced accuracy {spread([r['balanced'] for r in rows])} (min {min(r['balanced'] for r in rows):.3f}); "
          f"AUROC {spread([r['auroc'] for r in rows])} (min {min(r['auroc'] for r in rows):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", type=int, default=7790)
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--no-repair", action="store_true")
    parser.add_argument("--transfer", default=None, help="another template for the test problems")
    parser.add_argument("--prefix", action="store_true", help="time generation and reading on prompts sharing a prefix")
    parser.add_argument("--prefix-prompts", type=int, default=400)
    parser.add_argument("--prefix-layers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--speed", action="store_true", help="time fit: batched against per-target solver")
    parser.add_argument("--slices", type=int, default=0, help="the report's construction on this many slices")
    parser.add_argument("--size", type=int, default=6000, help="problems per slice (--slices)")
    parser.add_argument("--gemma", default=None, help="a Gemma 3 270M GGUF file: its own errors")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.prefix:
        bench_prefix(args.prefix_prompts, args.prefix_layers, args.runs)
        return
    if args.gemma:
        bench_gemma(args.gemma, args.seeds if args.seeds != [11, 12, 13] else [0, 1])
        return
    model = ai.load_model("zoo:add-3digit-weak")
    entry = zoo.get_entry("zoo:add-3digit-weak")
    if args.speed:
        bench_speed(model, entry, args.seeds, args.fit, args.runs)
        return
    if args.slices:
        bench_slices(model, entry, args.slices, args.size)
        return

    rows, repairs, transfers = [], [], []
    for seed, prompts in samples(model, entry, args.seeds, args.fit + args.test):
        evaluation = prompts.evaluate(model)
        fit, test = torch.arange(args.fit), torch.arange(args.fit, args.fit + args.test)
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", probes.DetectorBaselineWarning)
            detector = probes.ErrorDetector(random_state=seed).fit(model, prompts[fit], evaluation[fit])
        fit_s = time.perf_counter() - start
        result = detector.evaluate(model, prompts[test], evaluation[test])
        m, at = result.metrics(), result.at_budget(args.budget)
        val = detector.meta_["validation"][detector.method_]
        rows.append(dict(seed=seed, n=m["n"], errors=m["n_errors"], accuracy=m["accuracy"], majority=m["majority_baseline"],
                         gain=m["accuracy"] - m["majority_baseline"], balanced=m["balanced_accuracy"], auroc=m["auroc"],
                         flagged=m["flagged_fraction"], precision=at["error_precision"], recall=at["error_recall"],
                         method=detector.method_, threshold=detector.thresholds_[detector.method_],
                         val_balanced=val["balanced_accuracy"], val_accuracy=val["accuracy"], val_auroc=val["auroc"],
                         warned=bool(caught), fit_s=fit_s,
                         others={k: result.metrics(k) for k in result.methods if k != detector.method_}))
        print(f"seed {seed}: fitted in {fit_s:.0f} s; {detector.method_}, threshold {rows[-1]['threshold']:.3f}", flush=True)
        if not args.no_repair:
            for accept in ("always", "confidence"):
                s = probes.repair(model, prompts[test], detector, policy=probes.vote_policy(seed=seed),
                                  evaluation=evaluation[test], accept=accept).summary()
                repairs.append(dict(seed=seed, **s))
        if args.transfer:
            other = prompts_for_pairs(model, "+", prompts.a[test].tolist(), prompts.b[test].tolist(), args.transfer,
                                      answer_digits=prompts.meta.get("answer_digits", 0))
            t = detector.evaluate(model, other).metrics()
            transfers.append(dict(seed=seed, template=args.transfer, **t))

    print("\n| seed | scored (errors) | accuracy | majority baseline | gain | balanced accuracy | AUROC | flagged "
          f"| error precision @{args.budget:.0%} | error recall @{args.budget:.0%} | chosen (threshold) "
          "| CV balanced acc. / acc. / AUROC |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['n']} ({r['errors']}) | {r['accuracy']:.3f} | {r['majority']:.3f} | {r['gain']:+.3f} "
              f"| {r['balanced']:.3f} | {r['auroc']:.3f} | {r['flagged']:.3f} | {r['precision']:.3f} | {r['recall']:.3f} "
              f"| {r['method']} ({r['threshold']:.2f}) | {r['val_balanced']:.3f} / {r['val_accuracy']:.3f} / {r['val_auroc']:.3f} |")
    print(f"| mean ± sd | | {spread([r['accuracy'] for r in rows])} | {spread([r['majority'] for r in rows])} "
          f"| {spread([r['gain'] for r in rows])} | {spread([r['balanced'] for r in rows])} | {spread([r['auroc'] for r in rows])} "
          f"| | {spread([r['precision'] for r in rows])} | {spread([r['recall'] for r in rows])} | | |")
    print("\nOther methods on the same test problems (accuracy / balanced accuracy / AUROC):")
    for r in rows:
        print(f"- seed {r['seed']}: " + "; ".join(f"{k} {v['accuracy']:.3f} / {v['balanced_accuracy']:.3f} / {v['auroc']:.3f}"
                                                 for k, v in r["others"].items()))
    print("baseline warnings: " + ", ".join(f"seed {r['seed']}: {'yes' if r['warned'] else 'no'}" for r in rows))
    if repairs:
        print("\n| seed | accept | flagged | errors flagged | new answers kept | fixed | broken | net | accuracy before → after |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---|")
        for r in repairs:
            print(f"| {r['seed']} | {r['accept']} | {r['flagged']} | {r['errors_flagged']} | {r['accepted']} | {r['fixed']} "
                  f"| {r['broken']} | {r['net']:+d} | {r['accuracy_before']:.4f} → {r['accuracy_after']:.4f} |")
        for accept in ("always", "confidence"):
            sel = [r for r in repairs if r["accept"] == accept]
            print(f"- {accept}: fixed {sum(r['fixed'] for r in sel)}, broken {sum(r['broken'] for r in sel)}, "
                  f"net {sum(r['net'] for r in sel):+d}, mean accuracy gain "
                  f"{statistics.mean(r['accuracy_after'] - r['accuracy_before'] for r in sel):+.4f}")
    if transfers:
        print("\n| seed | scored on | model accuracy there | detector accuracy | majority baseline | balanced accuracy | AUROC |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in transfers:
            print(f"| {r['seed']} | `{r['template']}` | {1 - r['error_rate']:.3f} | {r['accuracy']:.3f} "
                  f"| {r['majority_baseline']:.3f} | {r['balanced_accuracy']:.3f} | {r['auroc']:.3f} |")


if __name__ == "__main__":
    main()
