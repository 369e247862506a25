"""Training the zoo models from scratch.

Training runs on TransformerLens's plain ``NativeModel`` — the very module a
``TransformerBridge.boot_native`` bridge wraps — so the weights saved here load into the
bridge unchanged (``load_model`` checks the logits agree). Saved per model, in one folder:
``model.safetensors``, ``config.json`` (the bridge config), ``tokenizer.json`` (+ HF tokenizer
files), ``card.json`` (measured held-out accuracy, wall time, steps) and, for models with
snapshots, ``snapshots/step_N.safetensors`` (float16 weights every ``snapshot_every`` steps). The
folder is written whole: everything goes into a temp folder beside it, renamed into place when
training and measuring are done, so a run stopped early (Ctrl-C, an error) leaves it as it was.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from arithinterp.checks import STEPS_MAX, integer
from arithinterp.outputs import check_target, write_file, write_folder, write_tensors, writes
from arithinterp.models import tokenizers as toks
from arithinterp.models.zoo import Task, ZooEntry, get_entry, operand_grid, split
from arithinterp.progress import progress_bar


TRAIN_ACCURACY_SAMPLE = 20_000  # training problems re-checked for the card (all of them for small tasks)


@dataclass
class Dataset:
    """Every problem of a zoo task as token ids.

    ``inputs`` [N, T] are the prompt plus all answer tokens but the last; the logits at
    positions ``answer_logit_pos`` [n_answer] predict ``targets`` [N, n_answer].
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    answer_logit_pos: torch.Tensor
    train_idx: torch.Tensor
    test_idx: torch.Tensor


def make_tokenizer(entry: ZooEntry):
    kind, _, arg = entry.tokenizer.partition(":")
    if kind == "calendar":
        return toks.calendar_tokenizer(int(arg))
    return toks.number_tokenizer(int(arg)) if kind == "number" else toks.digit_tokenizer()


def answer_string(task: Task, a: int, b: int) -> str:
    value = (a + b) % task.modulus if task.modulus else a + b
    if task.names:
        return task.names[value]
    return f"{value:0{task.answer_digits}d}" if task.answer_digits else str(value)


def prompt_string(task: Task, a: int, b: int) -> str:
    return task.template.format(a=task.names[a] if task.names else a, b=b)


def make_dataset(entry: ZooEntry, tokenizer, seed: Optional[int] = None, task: Optional[Task] = None) -> Dataset:
    """All (a, b) pairs of the task (default the main one), tokenized, with the seeded train /
    held-out split."""
    task = entry.task if task is None else task
    a, b = operand_grid(task)
    texts = [prompt_string(task, x, y) + answer_string(task, x, y) for x, y in zip(a.tolist(), b.tolist())]
    ids = torch.tensor(tokenizer(texts, add_special_tokens=False)["input_ids"])
    if entry.prepend_bos:
        ids = torch.cat([torch.full((len(ids), 1), tokenizer.bos_token_id), ids], dim=1)
    n_answer = len(tokenizer(answer_string(task, 0, 0), add_special_tokens=False)["input_ids"])
    prompt_len = ids.shape[1] - n_answer
    train_idx, test_idx = split(entry, seed, task)
    return Dataset(
        inputs=ids[:, :-1],
        targets=ids[:, prompt_len:],
        answer_logit_pos=torch.arange(prompt_len - 1, ids.shape[1] - 1),
        train_idx=train_idx,
        test_idx=test_idx,
    )


def bridge_config(entry: ZooEntry, d_vocab: int, seed: int):
    from transformer_lens.config import TransformerBridgeConfig

    return TransformerBridgeConfig(
        **entry.config, d_vocab=d_vocab, seed=seed, default_prepend_bos=entry.prepend_bos
    )


def logits_at(net: Any, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``net(inputs)[:, positions]`` computed without the last block's work at other positions.

    Training reads logits at a few answer positions only; in the last block no other position
    matters except as attention keys and values, so its queries, MLP and unembedding run on
    ``positions`` alone (3x less work for the 3-token modular-addition model). ``net`` is a
    TransformerLens ``NativeModel`` with standard positional embeddings.
    """
    seq = inputs.shape[1]
    x = net.tok_embed(inputs) + net.pos(torch.arange(seq, device=inputs.device))
    for block in net.layers[:-1]:
        (x,) = block(x)
    block = net.layers[-1]
    attn = block.attn
    h = block.ln1(x)
    batch, n_heads, d_head = inputs.shape[0], attn.n_heads, attn.d_head
    q = attn.q(h[:, positions]).view(batch, len(positions), n_heads, d_head).transpose(1, 2)
    k = attn.k(h).view(batch, seq, n_heads, d_head).transpose(1, 2)
    v = attn.v(h).view(batch, seq, n_heads, d_head).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / attn.scale
    future = torch.arange(seq, device=inputs.device)[None, :] > positions[:, None]
    pattern = scores.masked_fill(future, float("-inf")).softmax(-1)
    z = (pattern @ v).transpose(1, 2).reshape(batch, len(positions), n_heads * d_head)
    x = x[:, positions] + attn.o(z)
    if not net.cfg.attn_only:
        x = x + block.mlp(block.ln2(x))
    return net.head(net.ln_out(x))


@torch.inference_mode()
def exact_match(net: torch.nn.Module, data: Dataset, idx: torch.Tensor, batch_size: int = 4096) -> float:
    """Fraction of problems whose every answer token is the argmax under teacher forcing.

    This equals greedy-generation exact match: while every earlier answer token is right,
    the greedy and teacher-forced inputs are identical.
    """
    correct = 0
    for chunk in idx.split(batch_size):
        logits = logits_at(net, data.inputs[chunk], data.answer_logit_pos)
        correct += (logits.argmax(-1) == data.targets[chunk]).all(-1).sum().item()
    return correct / max(len(idx), 1)


@writes
def train(
    name: str,
    out: Optional[Path] = None,
    seed: Optional[int] = None,
    steps: Optional[int] = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Train zoo model ``name`` from scratch with its recipe and save it to ``out`` (default: the zoo
    entry's checkpoint folder). A folder that already holds files — the checkpoint the package ships,
    which every later user loads, included — is refused before training unless ``overwrite=True``.
    The folder is written whole at the end (:func:`~arithinterp.outputs.write_folder`): a run that is
    interrupted or fails leaves it as it was, absent or holding its previous contents.

    Args:
        name: The zoo model.
        out: The folder to save it in (default: the zoo entry's checkpoint folder).
        seed: The random seed (default: the recipe's).
        steps: Optimizer steps (default: the recipe's).
        progress: Show a progress bar.
        overwrite: Replace a folder that already holds files (strictly a bool).

    Returns:
        The card (measured held-out accuracy, wall time, steps run, history).

    Raises:
        ModelSpecError: An unknown zoo model.
        ConfigError: ``steps`` not in 1..:data:`~arithinterp.checks.STEPS_MAX`, or an ``out`` that
            cannot be written or (without ``overwrite``) already holds files; ``overwrite`` not a bool.
    """
    entry = get_entry(name)
    recipe = entry.recipe
    seed = recipe.seed if seed is None else seed
    steps = integer("steps", recipe.steps if steps is None else steps, minimum=1, maximum=STEPS_MAX)
    out = check_target(Path(out) if out is not None else entry.directory, overwrite=overwrite, what="out",
                       folder=True)  # before training
    with write_folder(out, overwrite=overwrite) as folder:
        return _train_into(folder, name, entry, seed, steps, progress)


def _train_into(out: Path, name: str, entry: ZooEntry, seed: int, steps: int, progress: bool) -> dict:
    """Train ``entry`` and write every file of its folder into ``out``; returns the card."""
    from transformer_lens.model_bridge.sources.native import NativeModel, initialize_native_model

    recipe = entry.recipe
    tokenizer = toks.save_and_reload(make_tokenizer(entry), out)
    # one dataset per task family (their prompts differ in length); batches draw from all of them
    datasets = [make_dataset(entry, tokenizer, seed, task) for task in entry.tasks]
    families = [task.family for task in entry.tasks]
    owner = torch.cat([torch.full((len(d.train_idx),), i) for i, d in enumerate(datasets)])
    pool = torch.cat([d.train_idx for d in datasets])
    cfg = bridge_config(entry, len(tokenizer), seed)

    torch.manual_seed(seed)
    net = NativeModel(copy.deepcopy(cfg))
    initialize_native_model(net, cfg)
    optimizer = torch.optim.AdamW(
        net.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, betas=recipe.betas
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / recipe.warmup))
    generator = torch.Generator().manual_seed(seed)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    snapshot_steps: list[int] = []
    stop_at_step: Optional[int] = None
    history = []
    # periodic checks use a fixed slice of each held-out set; the card measures all of it
    monitor = [d.test_idx[: recipe.monitor_size] for d in datasets]
    start = time.perf_counter()
    bar = progress_bar(range(1, steps + 1), desc=f"train {name}", disable=not progress)
    accuracy = 0.0
    step = 0
    for step in bar:
        if recipe.batch_size is None:
            pick = torch.arange(len(pool))
        else:
            pick = torch.randint(len(pool), (recipe.batch_size,), generator=generator)
        logits, targets = [], []
        for i, data in enumerate(datasets):
            batch = pool[pick[owner[pick] == i]]
            logits.append(logits_at(net, data.inputs[batch], data.answer_logit_pos).flatten(0, 1))
            targets.append(data.targets[batch].flatten())
        loss = F.cross_entropy(torch.cat(logits), torch.cat(targets))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % recipe.eval_every == 0 or step == steps:
            accuracies = [exact_match(net, data, idx) for data, idx in zip(datasets, monitor)]
            accuracy = min(accuracies)  # every task family must reach the target
            history.append(dict(step=step, train_loss=loss.item(), held_out_accuracy=accuracy,
                                **(dict(families=dict(zip(families, accuracies))) if len(datasets) > 1 else {})))
            bar.set_postfix(loss=f"{loss.item():.4f}", held_out=f"{accuracy:.4f}")
        if recipe.snapshot_every and step % recipe.snapshot_every == 0:
            snapshot_steps.append(step)
            snapshots[step] = {k: v.detach().to(torch.float16).clone() for k, v in net.state_dict().items()}
        if stop_at_step is None and recipe.stop_at_accuracy is not None and accuracy >= recipe.stop_at_accuracy:
            stop_at_step = step + recipe.steps_after_stop
        if stop_at_step is not None and step >= stop_at_step:
            break
    wall = time.perf_counter() - start

    weights = {k: v.contiguous() for k, v in net.state_dict().items()}
    write_tensors(out / "model.safetensors", weights, overwrite=False)
    for step_run, state in snapshots.items():  # one file per step keeps every file small
        write_tensors(out / "snapshots" / f"step_{step_run}.safetensors", state, overwrite=False)
    config = dict(entry.config, d_vocab=len(tokenizer), seed=seed, default_prepend_bos=entry.prepend_bos)
    write_file(out / "config.json", json.dumps(config, indent=2), overwrite=False)
    measured = {
        family: dict(
            held_out_accuracy=exact_match(net, data, data.test_idx),
            train_accuracy=exact_match(net, data, data.train_idx[:TRAIN_ACCURACY_SAMPLE]),
            n_train=len(data.train_idx),
            n_held_out=len(data.test_idx),
        )
        for family, data in zip(families, datasets)
    }
    card = dict(
        name=name,
        seed=seed,
        steps_run=step,
        # with several task families: the lowest accuracy of any, and the problem counts of all
        held_out_accuracy=min(m["held_out_accuracy"] for m in measured.values()),
        train_accuracy=min(m["train_accuracy"] for m in measured.values()),
        n_train=sum(m["n_train"] for m in measured.values()),
        n_held_out=sum(m["n_held_out"] for m in measured.values()),
        **(dict(families=measured) if len(datasets) > 1 else {}),
        wall_seconds=round(wall, 1),
        torch_threads=torch.get_num_threads(),
        recipe=asdict(recipe),
        snapshot_steps=snapshot_steps,
        history=history,
    )
    write_file(out / "card.json", json.dumps(card, indent=2), overwrite=False)
    return card
