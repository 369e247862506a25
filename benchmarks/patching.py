"""Exact activation patching: arithinterp's ``patching.activation_patching`` versus TransformerLens 4's functions.

Both run in one process on the same model and pairs, alternating, one thread:

* ``zoo:add-100`` (2 layers, d_model 128, prompts ``{a}+{b}=``, 5 tokens), 200 pairs varying a;
* a randomly initialised TransformerLens-native 4-layer model, d_model 256, 4 heads, d_mlp 1024,
  with a few-shot prefix of solved examples (≥ 40 tokens) before each prompt;
* Llama-architecture models (rotary positions, RMSNorm, gated MLP, grouped-query attention) saved
  as local Hugging Face folders with random weights and loaded with ``load_model``: 4 layers,
  d_model 256 (8 heads, 2 key/value heads, d_mlp 688), and 12 layers, d_model 768 (12 heads, 4
  key/value heads, d_mlp 2048, fewer pairs) — the same few-shot prompts.

Peak memory is the largest resident-set increase over the process's size before the call, sampled
every millisecond. With a CUDA device present, the Llama setups run there too (peak = the largest
CUDA allocation).

For ``resid_pre`` (layer × position) and head outputs by position (``attn_z``, layer × position ×
head) it reports the median wall time of ``--runs`` runs, the speed-up over TransformerLens, the
largest difference between the two results (logit difference per pair and cell), and the ratio to
the *floor*: one forward per cell that starts at the patched layer and position, estimated as
``Σ_cells (n_layers − layer) / n_layers × (T − position) / T`` unpatched forwards of the pairs
(the time of one unpatched forward is measured too). TransformerLens's time includes the clean
``run_with_cache`` its functions need; arithinterp's includes its clean and corrupt runs.

    python benchmarks/patching.py [--runs 5] [--pairs 200] [--fewshot-pairs 4] [--deep-pairs 2] [--write docs/benchmarks.md]
    python benchmarks/patching.py --quick      # a small smoke run

``--prefix`` times instead, on a random-weight Llama of SmolLM-135M's shape (``--prefix-layers``
of its 30 layers; built by ``benchmarks/evaluate.py``) with 3-shot two-digit prompts scored on
the whole answer, head patching without positions (``attn_z``, ``per_position=False``) against the
``resid_pre`` sweep by position on the same pairs: median of ``--runs`` alternating runs, their
ratio, and the largest difference of the head sweep from whole forwards on a few pairs.

    python benchmarks/patching.py --prefix [--prefix-pairs 48] [--prefix-layers 8] [--runs 3] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

BEGIN, END = "<!-- patching:begin -->", "<!-- patching:end -->"
PREFIX_BEGIN, PREFIX_END = "<!-- patching-prefix:begin -->", "<!-- patching-prefix:end -->"
GEMMA3_BEGIN, GEMMA3_END = "<!-- patching-gemma3:begin -->", "<!-- patching-gemma3:end -->"


def median_time(fn, runs: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(runs):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


class PeakMemory:
    """Largest resident-set (or CUDA) increase while the block runs, in MiB."""

    def __init__(self, device: str = "cpu"):
        self.device, self.peak = device, 0.0

    def __enter__(self):
        if self.device != "cpu":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        import psutil

        process = psutil.Process()
        self.start, self.running = process.memory_info().rss, True

        def sample():
            while self.running:
                self.peak = max(self.peak, (process.memory_info().rss - self.start) / 2**20)
                time.sleep(0.001)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.device != "cpu":
            torch.cuda.synchronize()
            self.peak = (torch.cuda.max_memory_allocated() - self.start) / 2**20
        else:
            self.running = False
            self.thread.join()
        return False


def logit_diff_metric(pairs):
    clean, corrupt = pairs.clean_answer_token, pairs.corrupt_answer_token

    def metric(logits):
        final = logits[:, -1]
        return final.gather(-1, clean[:, None])[:, 0] - final.gather(-1, corrupt[:, None])[:, 0]

    return metric


def few_shot_model(quick: bool):
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    from arithinterp.models.tokenizers import number_tokenizer, save_and_reload

    tokenizer = save_and_reload(number_tokenizer(198), Path(tempfile.mkdtemp()))
    size = dict(d_model=64, d_head=32, n_heads=2, n_layers=2, d_mlp=256) if quick else dict(d_model=256, d_head=64, n_heads=4, n_layers=4, d_mlp=1024)
    cfg = TransformerBridgeConfig(**size, n_ctx=64, d_vocab=len(tokenizer), act_fn="relu", normalization_type="LN", seed=0)
    model = TransformerBridge.boot_native(cfg, tokenizer=tokenizer, model_name="random-4L-d256" if not quick else "random-2L-d64").eval()
    model.arithinterp_spec = model.cfg.model_name
    return model


def llama_model(n_layers: int, d_model: int, heads: int, kv_heads: int, d_mlp: int, device: str = "cpu"):
    """A random-weight Llama-architecture model saved as a Hugging Face folder and loaded from it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import arithinterp as ai
    from arithinterp.models.tokenizers import number_tokenizer

    tokenizer = number_tokenizer(198)
    directory = Path(tempfile.mkdtemp()) / f"llama-{n_layers}L-d{d_model}"
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=d_mlp, max_position_embeddings=128, initializer_range=0.1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return ai.load_model(str(directory), device=None if device == "cpu" else device)


def gemma3_model(n_layers: int, d_model: int, heads: int, kv_heads: int, d_mlp: int, device: str = "cpu"):
    """A random-weight Gemma 3 model (QK-norm, post-norms on both branches, sliding-window layers of 16
    tokens between global ones, each with its own rotary base) saved as a Hugging Face folder and loaded."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    import arithinterp as ai
    from arithinterp.models.tokenizers import number_tokenizer

    tokenizer = number_tokenizer(198)
    directory = Path(tempfile.mkdtemp()) / f"gemma3-{n_layers}L-d{d_model}"
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=d_model // heads, intermediate_size=d_mlp, max_position_embeddings=128,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"] * (n_layers // 2),
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        query_pre_attn_scalar=d_model // heads, initializer_range=0.1,
    )
    config.bos_token_id = config.eos_token_id = config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return ai.load_model(str(directory), device=None if device == "cpu" else device)


def bench_setup(name, model, pairs, runs: int, device: str = "cpu", tl_cells: int = 0) -> list[dict]:
    """Time both on every cell; with ``tl_cells``, TransformerLens runs only that many sampled cells
    (its cost is one whole forward per cell, so its time for all cells is extrapolated)."""
    from transformer_lens import patching as tl_patching

    from arithinterp import patching

    metric = logit_diff_metric(pairs)
    clean, corrupt = pairs.clean.tokens.to(device), pairs.corrupt.tokens.to(device)
    n_layers, length = model.cfg.n_layers, clean.shape[1]
    with torch.inference_mode():
        forward, _ = median_time(lambda: model(corrupt, return_type="logits"), max(runs, 3))
    rows = []
    for site, tl_fn, label in (
        ("resid_pre", tl_patching.get_act_patch_resid_pre, "resid_pre (layer × position)"),
        ("attn_z", tl_patching.get_act_patch_attn_head_out_by_pos, "heads by position (layer × position × head)"),
    ):

        axes = ["layer", "pos"] + (["head_index"] if site == "attn_z" else [])
        shape = [n_layers, length] + ([model.cfg.n_heads] if site == "attn_z" else [])
        n_cells = int(torch.tensor(shape).prod())
        sample = None
        if tl_cells and tl_cells < n_cells:
            import pandas as pd

            flat = torch.randperm(n_cells, generator=torch.Generator().manual_seed(0))[:tl_cells]
            sample = torch.stack(torch.unravel_index(flat, shape), dim=1)
            index_df = pd.DataFrame(sample.numpy(), columns=axes)

        def run_tl():
            with torch.inference_mode():
                _, cache = model.run_with_cache(clean)
                if sample is None:
                    return tl_fn(model, corrupt, cache, metric, reduce="none").values
                return tl_fn(model, corrupt, cache, metric, reduce="none", index_axis_names=None, index_df=index_df).values

        def run_ours():
            return patching.activation_patching(model, pairs, site, progress=False)

        tl_times, our_times, tl_peak, our_peak = [], [], [], []
        for _ in range(runs):  # alternate so both see the same machine load
            with PeakMemory(device) as peak:
                t, tl_values = median_time(run_tl, 1)
            tl_times.append(t)
            tl_peak.append(peak.peak)
            with PeakMemory(device) as peak:
                t, ours = median_time(run_ours, 1)
            our_times.append(t)
            our_peak.append(peak.peak)
        tl_values = tl_values.permute(-1, *range(tl_values.ndim - 1)).cpu()
        ours_values = ours.values if sample is None else ours.values[(slice(None), *sample.T)]
        if sample is not None:  # extrapolate: the clean cache once, then one forward per cell
            tl_times = [t * n_cells / tl_cells for t in tl_times]
        units = model.cfg.n_heads if site == "attn_z" else 1
        work = sum((n_layers - layer) / n_layers * (length - p) / length for layer in range(n_layers) for p in range(length)) * units
        floor = work * forward
        ours_t, tl_t = statistics.median(our_times), statistics.median(tl_times)
        rows.append(
            dict(
                setup=name,
                site=label,
                pairs=len(pairs),
                tokens=length,
                cells=int(ours.values[0].numel()),
                cells_run=int(ours.meta["cells_run"]),
                tl_s=tl_t,
                ours_s=ours_t,
                speedup=tl_t / ours_t,
                floor_s=floor,
                vs_floor=ours_t / floor,
                max_abs_diff=float((ours_values - tl_values).abs().max()),
                tl_sampled=tl_cells if sample is not None else 0,
                tl_mib=statistics.median(tl_peak),
                ours_mib=statistics.median(our_peak),
                device=device,
                engine=ours.meta["engine"][0].split(" (")[0],
            )
        )
        print(rows[-1], flush=True)
    return rows


def table(rows: list[dict], runs: int) -> str:
    lines = [
        f"Median of {runs} runs each, one CPU thread, both in one process (alternating). "
        "Speed-up = TransformerLens time / arithinterp time; floor = one forward per cell from the "
        "patched layer and position on (estimated from a measured unpatched forward); "
        "max |diff| = largest difference of the per-pair logit difference over all cells. "
        "cells (run): cells swept (cells actually run; the others are the base run — they patch in an "
        "activation identical to the base run's: every position before the varied operand, and at layer 0 every "
        "token the prompts share — or the source run — a residual patch that makes the whole residual stream the "
        "source's, as at layer 0 on the operand). "
        "Beating the floor comes from stacking cells into large batches, starting each at the patched layer "
        "and its first changed position with earlier keys and values reused, running the last block at the final "
        "position only and a patched block at the patched position only, and the settled cells. "
        "TransformerLens / floor is the most any one-forward-per-cell method could gain over TransformerLens. "
        "† TransformerLens ran a random sample of the cells (its cost is one whole forward per cell) and its time "
        "is extrapolated to all cells; max |diff| is over the sampled cells. Peak MiB: the largest resident-set "
        "increase during the call (CUDA: the largest allocation).",
        "",
        "| setup | device | site | pairs × tokens | cells (run) | TransformerLens | arithinterp | speed-up | peak MiB TL / ours | TransformerLens / floor | arithinterp / floor | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['device']} | {r['site']}{' †' if r['tl_sampled'] else ''} | {r['pairs']} × {r['tokens']} | {r['cells']} ({r['cells_run']}) | {r['tl_s']:.3f} s | {r['ours_s']:.3f} s | "
            f"**{r['speedup']:.1f}×** | {r['tl_mib']:.0f} / {r['ours_mib']:.0f} | {r['tl_s'] / r['floor_s']:.1f}× | {r['vs_floor']:.2f} | {r['max_abs_diff']:.1e} |"
        )
    lines += [
        "",
        "The zoo and the random native model are TransformerLens-native models, whose attention takes no key/value "
        "cache argument: the engine gives it one while it steps them (`arithinterp.engine.native`). On the zoo's "
        "5-token prompts the base run is a fixed cost that few cells amortise (TransformerLens's `resid_pre` sweep "
        "there is 11 forwards); it runs the base and source prompts together, computes prefixes the prompts share "
        "once, and runs the last block at the final position only.",
    ]
    return "\n".join(lines)


def write_section(path: Path, body: str, markers: tuple = (BEGIN, END), title: str = "Activation patching",
                  command: str = "python benchmarks/patching.py") -> None:
    """Replace (or append) one section of ``path``, leaving other sections as they are."""
    begin, end = markers
    section = f"{begin}\n## {title}\n\nWritten by `{command} --write {path}`.\n\n{body}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def bench_prefix(n_pairs: int, n_layers: int, runs: int, parity_pairs: int = 3) -> str:
    """Head patching without positions against the resid_pre sweep, prompts sharing a 3-shot prefix."""
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from evaluate import build, prompts_for  # the SmolLM-135M-shaped random Llama and its prompts

    import arithinterp as ai
    from arithinterp import patching

    shape = argparse.Namespace(vocab=49152, d_model=576, d_mlp=1536, layers=n_layers, heads=9, kv_heads=3)
    folder = Path(tempfile.mkdtemp()) / "smollm-shaped"
    build(folder, shape)
    model = ai.load_model(str(folder))
    prompts = prompts_for(model, 400, 3)
    pairs = prompts.counterfactual(vary="a", seed=0)
    pairs = pairs[pairs.clean.length_groups()[0][:n_pairs]]
    tokens = pairs.clean.tokens
    shared = int((tokens == tokens[:1]).all(0).int().argmin())
    sweeps = {
        "resid_pre": dict(per_position=True),
        "attn_z": dict(per_position=False),
    }
    times: dict = {site: [] for site in sweeps}
    results: dict = {}
    for _ in range(runs):  # alternating, so both see the same machine load
        for site, kwargs in sweeps.items():
            start = time.perf_counter()
            results[site] = patching.activation_patching(model, pairs, site, scoring="full-answer", progress=False,
                                                         **kwargs)
            times[site].append(time.perf_counter() - start)
    few = pairs[: min(parity_pairs, len(pairs))]
    fast = patching.activation_patching(model, few, "attn_z", per_position=False, scoring="full-answer", progress=False)
    slow = patching.activation_patching(model, few, "attn_z", per_position=False, scoring="full-answer",
                                        engine="hooks", progress=False)
    diff = float((fast.values - slow.values).abs().max())
    median = {site: statistics.median(t) for site, t in times.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"Random-weight Llama of SmolLM-135M's shape with {n_layers} of its 30 layers (d_model 576, 9 heads / 3 "
        f"key-value heads, d_mlp 1536, vocabulary 49,152; `benchmarks/evaluate.py`'s `build`), {len(pairs)} pairs of "
        f"3-shot two-digit prompts varying `a` ({tokens.shape[1]} tokens, the first {shared} shared by every "
        f"prompt), `scoring=\"full-answer\"` (both answers teacher-forced: {2 * len(pairs)} rows per run). Median "
        f"of {runs} alternating runs, one CPU thread; load average {load:.1f} on {os.cpu_count()} CPUs.",
        "",
        "| sweep | cells (run) | median time | runs |",
        "|---|---|---|---|",
    ]
    for site in sweeps:
        r = results[site]
        label = "`resid_pre`, layer × position" if site == "resid_pre" else "`attn_z`, layer × head, `per_position=False`"
        lines.append(f"| {label} | {r.values[0].numel()} ({r.meta['cells_run']}) | {median[site]:.2f} s | "
                     f"{', '.join(f'{t:.2f}' for t in times[site])} |")
    lines += [
        "",
        f"attn_z / resid_pre = **{median['attn_z'] / median['resid_pre']:.2f}**; the head sweep's largest difference "
        f"from whole forwards (`engine=\"hooks\"`, {len(few)} pairs): {diff:.1e}.",
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def main(argv=None) -> list[dict]:
    import arithinterp as ai
    from arithinterp.errors import ModelFileError
    from arithinterp.tasks import arithmetic

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--fewshot-pairs", type=int, default=4)
    parser.add_argument("--deep-pairs", type=int, default=2, help="pairs for the 12-layer d768 Llama-family model")
    parser.add_argument("--few-shot", type=int, default=9, help="solved examples in the prefix (9 give a 45-token prefix)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run: 1 run, few pairs, a 2-layer model with a short prefix")
    parser.add_argument("--write", type=Path, default=None, help="write the table into this markdown file's patching section")
    parser.add_argument("--prefix", action="store_true", help="time head patching without positions on prompts sharing a prefix")
    parser.add_argument("--prefix-pairs", type=int, default=48)
    parser.add_argument("--prefix-layers", type=int, default=8, help="layers of the SmolLM-135M-shaped model (30: full size)")
    parser.add_argument("--gemma3", action="store_true", help="time only a random-weight Gemma 3 (4 layers, d_model 256)")
    args = parser.parse_args(argv)
    if args.gemma3:
        torch.set_num_threads(1)
        model = gemma3_model(4, 256, 4, 1, 1024)
        prompts = arithmetic(model, a=range(100), b=range(100), few_shot=args.few_shot)
        prefix_tokens = len(model.tokenizer(prompts.prefix, add_special_tokens=False)["input_ids"])
        pairs = prompts.counterfactual(vary="a", seed=0)[: args.fewshot_pairs]
        rows = bench_setup(f"Gemma 3 4L d256 (HF folder), {prefix_tokens}-token few-shot prefix", model, pairs, args.runs)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        text = table(rows, args.runs) + f"\n\nLoad average (1 min) at the end of the run: {load:.2f} on {os.cpu_count()} CPUs."
        print(text)
        if args.write:
            write_section(args.write, text, (GEMMA3_BEGIN, GEMMA3_END), "Activation patching on Gemma 3",
                          f"python benchmarks/patching.py --gemma3 --fewshot-pairs {args.fewshot_pairs} --runs {args.runs}")
        return rows
    if args.prefix:
        torch.set_num_threads(1)
        text = bench_prefix(args.prefix_pairs, args.prefix_layers, args.runs)
        if args.write:
            write_section(args.write, text, (PREFIX_BEGIN, PREFIX_END), "Activation patching on prompts sharing a prefix",
                          f"python benchmarks/patching.py --prefix --prefix-layers {args.prefix_layers} "
                          f"--prefix-pairs {args.prefix_pairs} --runs {args.runs}")
        return []
    if args.quick:
        args.runs, args.pairs, args.fewshot_pairs, args.few_shot, args.deep_pairs = 1, 12, 1, 3, 1
    torch.set_num_threads(1)
    rows = []
    try:
        model = ai.load_model("zoo:add-100")
    except ModelFileError as error:
        print(f"skipping zoo:add-100: {error}")
    else:
        prompts = arithmetic(model, a=range(100), b=range(100))
        pairs = prompts.correct_only(model).counterfactual(vary="a", seed=0)[: args.pairs]
        rows += bench_setup("zoo:add-100", model, pairs, args.runs)
    model = few_shot_model(args.quick)
    prompts = arithmetic(model, a=range(100), b=range(100), few_shot=args.few_shot)
    prefix_tokens = len(model.tokenizer(prompts.prefix, add_special_tokens=False)["input_ids"])
    pairs = prompts.counterfactual(vary="a", seed=0)[: args.fewshot_pairs]
    rows += bench_setup(f"{model.cfg.model_name}, {prefix_tokens}-token few-shot prefix", model, pairs, args.runs)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    # the quick run samples TransformerLens's cells on the Llama too (the path the 12-layer row takes)
    shapes = [("Llama 4L d256", (4, 256, 8, 2, 688), args.fewshot_pairs, 24 if args.quick else 0)]
    if not args.quick:
        shapes.append(("Llama 12L d768", (12, 768, 12, 4, 2048), args.deep_pairs, 48))
    for device in devices:
        for label, shape, n_pairs, tl_cells in shapes:
            model = llama_model(*shape, device=device)
            prompts = arithmetic(model, a=range(100), b=range(100), few_shot=args.few_shot)
            pairs = prompts.counterfactual(vary="a", seed=0)[:n_pairs]
            runs = args.runs if not tl_cells else max(1, args.runs // 2)
            rows += bench_setup(f"{label} (HF folder), {prefix_tokens}-token few-shot prefix", model, pairs, runs, device, tl_cells)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = table(rows, args.runs) + f"\n\nLoad average (1 min) at the end of the run: {load:.2f} on {os.cpu_count()} CPUs."
    print(text)
    if args.write:
        write_section(args.write, text)
    return rows


if __name__ == "__main__":
    main()
