"""Interchange datasets: base and source prompts, the variable swapped, the counterfactual answer.

For each base prompt a source prompt is drawn and the causal model says what the answer becomes
when the variable takes the source's value (Geiger et al. 2024). The pairs are *balanced*: the
source value is drawn uniformly among the values that differ from the base's, and a pair is kept
only when its counterfactual answer differs from both the base and the source answers, so that
copying either prompt scores nothing. Train and held-out pairs come from disjoint operand pairs
``(a, b)`` (neither a base nor a source of a held-out pair is seen in training).

The control (``shuffle=True``) is a *shuffled copy* of the variable: every prompt gets the value
of another random prompt (a permutation within each split), which the model does not compute;
sources are drawn by that value and the label follows it. An intervention that moves the true
variable scores :attr:`InterchangeDataset.chance` there (where the copy happens to agree). The
other control, ``value_from="product_parity"``, takes the label from another variable the model
has no reason to compute (the parity of ``a·b`` for a carry) in the same way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from arithinterp.causal.models import CausalModel, for_prompts
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.tasks import PromptSet, answer_text
from arithinterp.types import checked


@dataclass(frozen=True)
class InterchangeDataset:
    """Interchange pairs for one variable: base and source prompts and the counterfactual answer.

    Attributes:
        base: The base prompts, N of them, aligned with the sources (same token length).
        source: The source prompts, whose value of the variable is moved into the base.
        variable: The interchanged variable.
        causal_model: The causal model it belongs to.
        answer (Int[Tensor, "pair"]): The counterfactual answer (the base's and the source's own
            answers keep theirs).
        answer_tokens (Int[Tensor, "pair k"]): Its tokens.
        train (Int[Tensor, "n_train"]): The training pairs' indices.
        test (Int[Tensor, "n_test"]): The held-out pairs' indices (held out by operand pair).
        shuffled: Whether the variable is a shuffled copy (the control).
        chance: The held-out score of an intervention that does not follow the variable: 0 for a
            real variable (the balance makes copying either prompt wrong); for a shuffled copy, the
            share of pairs where moving the *true* variable from the source gives the shuffled label anyway.
        meta: How the pairs were drawn and how many were dropped.
        value_from: The variable whose values stand in for ``variable`` (the other control), or ``None``.
    """

    base: PromptSet
    source: PromptSet
    variable: str
    causal_model: CausalModel = field(repr=False)
    answer: torch.Tensor
    answer_tokens: torch.Tensor
    train: torch.Tensor
    test: torch.Tensor
    shuffled: bool = False
    chance: float = 0.0
    meta: dict = field(default_factory=dict, compare=False)
    value_from: Optional[str] = None

    def __len__(self) -> int:
        return len(self.base)

    @property
    def base_value(self) -> torch.Tensor:
        """Int[Tensor, "pair"]: The variable's value in each base prompt."""
        return self.causal_model.values(self.base.a, self.base.b)[self.variable]

    @property
    def source_value(self) -> torch.Tensor:
        """Int[Tensor, "pair"]: The variable's value in each source prompt."""
        return self.causal_model.values(self.source.a, self.source.b)[self.variable]

    def chance_over(self, rows: torch.Tensor) -> float:
        """:attr:`chance` over some of the pairs.

        Args:
            rows (Int[Tensor, "k"]): The pairs' indices.

        Returns:
            0 for a real variable; for a shuffled copy, the share of the rows where moving the true
            variable from the source gives the shuffled label.
        """
        if not (self.shuffled or self.value_from) or len(rows) == 0:
            return 0.0
        base = self.base[rows]
        true_cf = self.causal_model.answer(base.a, base.b, {self.variable: self.source_value[rows]})
        return float((true_cf == self.answer[rows]).float().mean())


def _answer_tokens(prompts: PromptSet, rows: list[int], answers: list[int]) -> list[Optional[list[int]]]:
    """Tokens of ``answers`` written after prompt ``rows`` (as tasks builds them), ``None`` where the
    tokenizer does not know them."""
    tok = prompts.tokenizer
    digits = int(prompts.meta.get("answer_digits", 0))
    texts = [prompts.texts[i] for i in rows]
    plain = tok(texts, add_special_tokens=False)["input_ids"]
    full = tok([t + answer_text(x, digits) for t, x in zip(texts, answers)], add_special_tokens=False)["input_ids"]
    out: list[Optional[list[int]]] = []
    for p, f, x in zip(plain, full, answers):
        tail = f[len(p):]
        bad = x < 0 or f[: len(p)] != p or not tail or (tok.unk_token_id is not None and tok.unk_token_id in tail)
        out.append(None if bad else tail)
    return out


@checked
def interchange_dataset(
    prompts: PromptSet,
    variable: str,
    causal_model: Optional[CausalModel] = None,
    *,
    n: Optional[int] = None,
    test_fraction: float = 0.3,
    shuffle: bool = False,
    value_from: Optional[str] = None,
    seed: int = 0,
    max_tries: int = 32,
) -> InterchangeDataset:
    """Balanced interchange pairs for ``variable`` from ``prompts``.

    Args:
        prompts: the prompts (use ``correct_only(model)`` first: a pair the model gets wrong
            unpatched says nothing about a variable).
        variable: the variable to interchange (:func:`variables_of` lists them).
        causal_model: defaults to the built-in model for these prompts (:func:`for_prompts`).
        n: pairs to draw (default: one per prompt; at most ``len(prompts) ** 2``); pairs with no balanced source after
            ``max_tries`` draws, or whose counterfactual answer does not tokenize like the base
            answer, are dropped and counted in ``meta``.
        test_fraction: the share of operand pairs held out.
        shuffle: the control: a shuffled copy of the variable (each prompt takes another's value).
        value_from: the other control: each prompt's value of ``variable`` is taken from this
            variable of the causal model instead (``"product_parity"`` for a carry: the same values,
            a function of the operands the sum does not use); sources and labels follow it.
        seed: seeds the draws and the split.
        max_tries: draws of a balanced source per base before the pair is dropped.

    Returns:
        The pairs, their counterfactual answers and the train / test split.

    Raises:
        AnalysisError: Fewer than 4 prompts, a bad ``test_fraction`` or ``n``, an unknown variable,
            a causal model whose output disagrees with the prompts' answers, a misused control, or
            too few pairs left.
    """
    if not isinstance(prompts, PromptSet):
        raise ConfigError(f"prompts must be a PromptSet, got {type(prompts).__name__}")
    if len(prompts) < 4:
        raise AnalysisError(f"an interchange dataset needs at least 4 prompts, got {len(prompts)}")
    if not 0.0 < float(test_fraction) < 1.0:
        raise ConfigError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction!r}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 2):
        raise ConfigError(f"n must be an int >= 2 or None, got {n!r}")
    if n is not None and n > len(prompts) ** 2:  # drawn one by one: a typo's count would hang, not add pairs
        raise ConfigError(f"n={n:,} is more pairs than the {len(prompts):,} prompts make ({len(prompts) ** 2:,} "
                          "pairs of a base and a source prompt); give fewer pairs or more prompts")
    if causal_model is None:
        causal_model = for_prompts(prompts.op, prompts.modulus, int(prompts.meta.get("n_digits", 1)),
                                   prompts.single_token_operands and int(prompts.meta.get("answer_digits", 0)) == 0)
    causal_model.check_variable(variable)
    if value_from is not None:
        causal_model.check_variable(value_from)
        if value_from == variable or shuffle:
            raise ConfigError(f"value_from={value_from!r} is a control label for {variable!r}: it must name another "
                                "variable, and it replaces shuffle=True (use one control at a time)")
    rng = random.Random(seed)
    values = causal_model.values(prompts.a, prompts.b)
    if not torch.equal(values[causal_model.output], prompts.answer):
        wrong = int((values[causal_model.output] != prompts.answer).sum())
        raise AnalysisError(f"causal model {causal_model.name!r} gives another answer than the prompts for {wrong} of "
                            f"{len(prompts)} prompts; it must describe the task the prompts pose")
    value = values[variable].tolist()
    pair_keys = sorted(set(zip(prompts.a.tolist(), prompts.b.tolist())))
    rng.shuffle(pair_keys)
    n_test = max(1, round(test_fraction * len(pair_keys)))
    test_keys = set(pair_keys[:n_test])
    is_test = [(a, b) in test_keys for a, b in zip(prompts.a.tolist(), prompts.b.tolist())]
    n_answer = prompts.n_answer_tokens.tolist()
    keys = [(is_test[i], int(prompts.lengths[i]), n_answer[i]) for i in range(len(prompts))]
    if shuffle:  # a shuffled copy of the variable: each prompt gets another prompt's value (same pool)
        drawn = list(value)
        for key in set(keys):
            members = [i for i in range(len(prompts)) if keys[i] == key]
            permuted = members[:]
            rng.shuffle(permuted)
            for i, j in zip(members, permuted):
                drawn[i] = value[j]
    elif value_from is not None:  # another variable's value stands in for this one's
        drawn = values[value_from].tolist()
    else:
        drawn = value
    pools: dict[tuple, dict[int, list[int]]] = {}  # (split, length, answer tokens) -> drawn value -> prompts
    for i in range(len(prompts)):
        pools.setdefault(keys[i], {}).setdefault(drawn[i], []).append(i)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    want = len(prompts) if n is None else n
    bases = [order[j % len(order)] for j in range(want)]
    base_rows, source_rows, value_rows, no_source = [], [], [], 0
    for i in bases:
        pool = pools[keys[i]]
        others = [v for v in pool if v != value[i]]
        found = None
        for _ in range(max_tries if others else 0):
            v = rng.choice(others)
            j = rng.choice(pool[v])
            cf = int(causal_model.answer(prompts.a[i: i + 1], prompts.b[i: i + 1], {variable: torch.tensor([v])}))
            if cf != int(prompts.answer[i]) and cf != int(prompts.answer[j]):
                found = (j, v)
                break
        if found is None:
            no_source += 1
            continue
        base_rows.append(i)
        source_rows.append(found[0])
        value_rows.append(found[1])
    if len(base_rows) < 2:
        raise AnalysisError(
            f"no balanced interchange pairs for {variable!r}: its value varies too little in these {len(prompts)} "
            "prompts (the counterfactual answer must differ from both prompts' answers); widen the operand ranges"
        )
    base_idx = torch.tensor(base_rows)
    set_to = {variable: torch.tensor(value_rows)}
    cf = causal_model.answer(prompts.a[base_idx], prompts.b[base_idx], set_to)
    tokens = _answer_tokens(prompts, base_rows, cf.tolist())
    keep = [t is not None and len(t) == n_answer[i] for t, i in zip(tokens, base_rows)]
    untokenized = len(keep) - sum(keep)
    rows = [r for r, k in enumerate(keep) if k]
    if len(rows) < 2:
        raise AnalysisError(f"the counterfactual answers for {variable!r} do not tokenize like the prompts' answers")
    width = prompts.answer_tokens.shape[1]
    answer_tokens = torch.full((len(rows), width), -1, dtype=torch.long)
    for r_new, r in enumerate(rows):
        t = tokens[r]
        assert t is not None
        answer_tokens[r_new, : len(t)] = torch.tensor(t)
    base = prompts[[base_rows[r] for r in rows]]
    source = prompts[[source_rows[r] for r in rows]]
    cf = cf[rows]
    test_mask = torch.tensor([is_test[base_rows[r]] for r in rows])
    meta = dict(requested=want, kept=len(rows), no_balanced_source=no_source, untokenizable_answer=untokenized,
                test_operand_pairs=n_test, train_operand_pairs=len(pair_keys) - n_test, seed=seed)
    dataset = InterchangeDataset(
        base=base, source=source, variable=variable, causal_model=causal_model, answer=cf,
        answer_tokens=answer_tokens, train=torch.nonzero(~test_mask).flatten(), test=torch.nonzero(test_mask).flatten(),
        shuffled=shuffle, meta=meta, value_from=value_from,
    )
    # what moving the true variable (the source's own value) scores on the held-out pairs
    return replace(dataset, chance=dataset.chance_over(dataset.test))

