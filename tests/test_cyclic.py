"""Cyclic concepts: weekday / month / hour prompts, their counterfactual pairs, and the zoo model
trained on addition and weekday / month arithmetic (accuracy, period-7 weekday features)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import arithinterp as ai
from arithinterp import cyclic
from arithinterp.errors import ConfigError, TaskError


@pytest.fixture(scope="module")
def calendar_tokenizer(tmp_path_factory):
    from arithinterp.models.tokenizers import calendar_tokenizer, save_and_reload

    return save_and_reload(calendar_tokenizer(198), tmp_path_factory.mktemp("calendar_tok"))


@pytest.fixture(scope="module")
def zoo_model():
    return ai.load_model("zoo:add-cyclic")


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids if i >= 0]).replace(" ", "")


# --- builders ----------------------------------------------------------------------------------


def test_weekday_and_month_answers_wrap_around(calendar_tokenizer):
    days = cyclic.weekdays(calendar_tokenizer, offsets=range(10))
    assert len(days) == 70 and days.modulus == 7 and days.meta["concept"] == dict(name="weekday", period=7)
    i = days.texts.index("Monday + 3 days =")
    assert days.answer_texts[i] == "Thursday" and int(days.answer[i]) == 3
    i = days.texts.index("Saturday + 9 days =")  # 5 + 9 = 14 ≡ 0: wraps twice
    assert days.answer_texts[i] == "Monday" and int(cyclic.wraps(days)[i]) == 2
    assert (days.answer == (days.a + days.b) % 7).all()
    months = cyclic.months(calendar_tokenizer, months=[2], offsets=[5, 11])
    assert months.texts == ("March + 5 months =", "March + 11 months =")
    assert months.answer_texts == ("August", "February")
    # few-shot examples are written with the names too, and are right
    shot = cyclic.weekdays(calendar_tokenizer, days=[0], offsets=[3], few_shot=3, seed=1)
    lines = (shot.prefix or "").splitlines()
    assert len(lines) == 3 and shot.texts[0].endswith("Monday + 3 days =")
    for line in lines:
        match = re.fullmatch(r"(\w+) \+ (\d+) days =(\w+)", line)
        assert match is not None, line
        day, offset, answer = match.groups()
        assert cyclic.WEEKDAYS[(cyclic.WEEKDAYS.index(day) + int(offset)) % 7] == answer
    # the position "a" holds the name's token, the answer token is the answer name
    for i in range(len(days)):
        assert days.str_tokens(i)[int(days.positions["a"][i]) - days.offset(torch.tensor([i]))] == cyclic.WEEKDAYS[
            int(days.a[i])]
        assert _decode(calendar_tokenizer, days.answer_tokens[i]) == days.answer_texts[i]


def test_hours_are_numbers_mod_24(number_tokenizer):
    hours = cyclic.hours(number_tokenizer, hours=[21, 23], offsets=[5, 1], template="{a}+{b}=")
    assert dict(zip(hours.texts, hours.answer_texts)) == {"21+5=": "2", "21+1=": "22", "23+5=": "4", "23+1=": "0"}
    assert cyclic.period_of(hours) == 24


def test_multi_token_names_are_located_by_their_tokens(bpe_tokenizer):
    """Under a BPE tokenizer the names split into several pieces: 'a[0]'..'a' cover exactly the name
    and the answer tokens spell the answer name."""
    names = [" " + n for n in cyclic.MONTHS]
    prompts = cyclic.months(bpe_tokenizer, offsets=range(3), names=names)
    assert prompts.meta["operand_tokens"]["max"] > 1
    for i in range(len(prompts)):
        first, last = int(prompts.positions["a[0]"][i]), int(prompts.positions["a"][i])
        assert bpe_tokenizer.decode(prompts.tokens[i, first : last + 1].tolist()) == names[int(prompts.a[i])]
        assert bpe_tokenizer.decode([t for t in prompts.answer_tokens[i].tolist() if t >= 0]) == prompts.answer_texts[i]
    _, index = prompts.locate(["a[0]", "a", "final"])
    assert (index[:, 0] <= index[:, 1]).all() and (index[:, 1] < index[:, 2]).all()


def test_multi_token_answers_are_scored_token_by_token(bpe_tokenizer):
    """On a model whose tokenizer splits the names, the teacher-forced log-probability of an answer
    name is the sum over its tokens of a plain forward over prompt + answer."""
    from conftest import tiny_bridge

    model = tiny_bridge(bpe_tokenizer, n_ctx=64)
    prompts = cyclic.months(model, months=[0, 4, 8], offsets=[1, 7], names=[" " + n for n in cyclic.MONTHS])
    prompts = prompts.with_scoring("full-answer")
    assert prompts.meta["answer_tokens"]["max"] > 1
    ours = prompts.answer_logprob(model)
    for i in range(len(prompts)):
        prompt = prompts.tokens[i, prompts.tokens.shape[1] - int(prompts.lengths[i]) :]
        answer = prompts.answer_tokens[i][prompts.answer_tokens[i] >= 0]
        with torch.inference_mode():
            logprobs = model(torch.cat([prompt, answer])[None]).log_softmax(-1)[0]
        expected = logprobs[len(prompt) - 1 + torch.arange(len(answer)), answer].sum()
        assert abs(float(ours[i]) - float(expected)) < 1e-4


def test_prompt_set_counterfactual_keeps_the_names(calendar_tokenizer):
    days = cyclic.weekdays(calendar_tokenizer, offsets=range(10))
    pairs = days.counterfactual(vary="b", seed=0)
    assert all(t == cyclic.WEEKDAYS[int(x)] for t, x in zip(pairs.corrupt.answer_texts, pairs.corrupt.answer))
    assert pairs.corrupt.meta["names"] == list(cyclic.WEEKDAYS)
    joined = ai.tasks.concat([days[:5], days[5:]])
    assert joined.answer_texts == days.answer_texts and joined.meta["names"] == list(cyclic.WEEKDAYS)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda t: cyclic.cyclic(t, "year"), "unknown cyclic concept 'year'; accepted: 'weekday', 'month', 'hour'"),
        (lambda t: cyclic.weekdays(t, days=[7]), "values must lie in 0..6, got 7"),
        (lambda t: cyclic.weekdays(t, offsets=[-1]), "offsets must lie in >= 0, got -1"),
        (lambda t: cyclic.months(t, names=["Jan", "Feb"]), "a month has 12 values, so names needs 12 entries"),
        (lambda t: cyclic.weekdays(t, modulus=5), "cyclic prompts fix 'modulus'"),
        (lambda t: cyclic.weekdays(t, days="Monday"),  # pyright: ignore[reportArgumentType]
         "must be an int or an iterable of ints"),
        (lambda t: ai.tasks.prompts_for_pairs(t, "+", [5], [4], "{a} + {b} days =", names=cyclic.WEEKDAYS),
         "answers written as names need modulus=7"),
        (lambda t: ai.tasks.prompts_for_pairs(t, "+", [9], [4], "{a} + {b} days =", names=cyclic.WEEKDAYS,
                                              modulus=7), "with 7 names, a must lie in 0..6, got 9"),
        (lambda t: ai.tasks.prompts_for_pairs(t, "+", [0], [1], "{a} + {b} days =", names=["Monday", "Monday"],
                                              modulus=2), "at least two distinct strings"),
    ],
)
def test_bad_input_is_refused_with_the_accepted_values(calendar_tokenizer, call, match):
    with pytest.raises(ConfigError if "unknown" in match else TaskError, match=match):
        call(calendar_tokenizer)


# --- counterfactual pairs ----------------------------------------------------------------------------


@pytest.mark.parametrize("vary", ["a", "b"])
def test_counterfactual_changes_the_day_or_the_offset(calendar_tokenizer, vary):
    prompts = cyclic.weekdays(calendar_tokenizer, offsets=range(20))
    pairs = cyclic.counterfactual(prompts, vary=vary, seed=3)
    assert len(pairs) == len(prompts) and pairs.meta["dropped"] == 0
    kept = "b" if vary == "a" else "a"
    assert (getattr(pairs.clean, kept) == getattr(pairs.corrupt, kept)).all()
    assert (getattr(pairs.clean, vary) != getattr(pairs.corrupt, vary)).all()
    assert (pairs.clean.answer != pairs.corrupt.answer).all()
    assert (pairs.corrupt.answer == (pairs.corrupt.a + pairs.corrupt.b) % 7).all()
    assert all(pairs.corrupt.answer_texts[i] == cyclic.WEEKDAYS[int(x)] for i, x in enumerate(pairs.corrupt.answer))
    # seeded: the same call gives the same pairs, another seed other ones
    again = cyclic.counterfactual(prompts, vary=vary, seed=3)
    assert again.corrupt.texts == pairs.corrupt.texts
    assert cyclic.counterfactual(prompts, vary=vary, seed=4).corrupt.texts != pairs.corrupt.texts
    # partners are spread over the candidates, not always the same one
    assert len(set(pairs.corrupt.texts)) > len(prompts) // 2


def test_counterfactual_pairs_multi_token_names_of_equal_length(bpe_tokenizer):
    """PromptSet.counterfactual drops most draws under a BPE tokenizer; cyclic.counterfactual only
    draws aligned partners, so it keeps far more pairs, all aligned."""
    prompts = cyclic.weekdays(bpe_tokenizer, offsets=range(14), names=[" " + n for n in cyclic.WEEKDAYS])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = cyclic.counterfactual(prompts, vary="a")
        theirs = prompts.counterfactual(vary="a")
    assert len(ours) > 3 * len(theirs)
    assert ours.meta["kept"] + ours.meta["dropped"] == len(prompts)
    assert (ours.clean.lengths == ours.corrupt.lengths).all()
    for name in ours.clean.positions:
        assert (ours.clean.positions[name] == ours.corrupt.positions[name]).all()
    assert (ours.clean.n_answer_tokens == ours.corrupt.n_answer_tokens).all()
    # every answer here starts with the same space token: a first-token metric would be 0 on each pair
    with pytest.warns(UserWarning, match="same first token"):
        cyclic.counterfactual(prompts, vary="b")
    with pytest.raises(TaskError, match="different first answer token"):
        cyclic.counterfactual(prompts, vary="b", distinct_first_token=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scored over every answer token, the shared first token is no problem
        full = cyclic.counterfactual(prompts.with_scoring("full-answer"), vary="b")
    assert full.clean.scoring == full.corrupt.scoring == "full-answer" and full.meta["same_first_token"] == len(full)


def test_counterfactual_refuses_a_non_cyclic_set(number_tokenizer):
    prompts = ai.tasks.arithmetic(number_tokenizer, "+", range(5), range(5))
    with pytest.raises(TaskError, match="no cyclic concept"):
        cyclic.counterfactual(prompts)
    with pytest.raises(ConfigError, match="vary must be 'a'"):
        cyclic.counterfactual(cyclic.weekdays(number_tokenizer, template="{a}+{b}=", names=[str(i) for i in range(7)]),
                              vary="both")


# --- the zoo model trained on addition and weekday / month arithmetic ------------------------------


def test_zoo_model_answers_every_task_family(zoo_model):
    from arithinterp.models.zoo import evaluate, get_entry, held_out_prompts

    entry = get_entry("add-cyclic")
    result = evaluate(entry, zoo_model, limit=500)
    assert set(result["families"]) == {"addition", "weekday", "month"}
    for family, measured in result["families"].items():
        assert measured["accuracy"] >= 0.99, (family, measured)
        assert entry.card()["families"][family]["held_out_accuracy"] >= 0.99
    # held-out weekday problems are never training problems, and names parse back to their values
    days = held_out_prompts(zoo_model, entry, family="weekday")
    assert days.meta["concept"] == dict(name="weekday", period=7)
    evaluation = days.evaluate(zoo_model)
    assert (evaluation.model_answer[evaluation.correct] == days.answer[evaluation.correct]).all()
    assert set(evaluation.answer_text) <= set(cyclic.WEEKDAYS)


def _name_spectrum(model, kind: str, period: int):
    prompts = cyclic.cyclic(model, kind, offsets=range(100))
    acts = ai.collect(model, prompts, sites=["resid_post"], layers=[0], positions=["a"], progress=False)
    result = ai.fourier.spectrum(acts, values=prompts.a, numbers=range(period), site="resid_post", n_shuffles=200)
    power = result.power[0, 1:].double()
    return power / power.sum(), torch.as_tensor(result.meta["control"]["p_values"][0][1:])


# the shipped model's strongest frequency at the name's token (docs/cyclic.md): months in calendar order
# (period 12); the day token's circle has frequency 3 (period 7/3: Monday, Thursday, Sunday, ...), which
# generates the week as well as frequency 1 does. The computed day (the answer, at the final token) is the
# period-7 circle: test_the_answer_day_lies_on_a_period_7_circle
LEARNED = [("weekday", 7, 3), ("month", 12, 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "period", "frequency"), LEARNED)
def test_name_representation_is_periodic_beyond_both_controls(zoo_model, kind, period, frequency):
    """The residual at the day (month) token, over the 7 days (12 months): one frequency holds about
    half of the power, is significant against shuffled days, and a random-init model of the same
    shape has no such frequency."""
    share, p = _name_spectrum(zoo_model, kind, period)
    random_share, random_p = _name_spectrum(ai.models.random_like(zoo_model, seed=0), kind, period)
    k = frequency - 1
    assert int(share.argmax()) == k, share
    assert share[k] >= 0.45 and p[k] <= 0.05, (share, p)
    assert share[k] >= random_share[k] + 0.1, (share, random_share)
    assert random_share.max() < 0.4 and (random_p > 0.05).all(), (random_share, random_p)


def _answer_day_shares(model, values=None):
    """Variance shares [3] of frequencies 1..3 over the 7 answer days of the last layer's residual at
    the final token, and the number-axis-shuffled p-values; 14 whole weeks of offsets (balanced)."""
    days = cyclic.weekdays(model, offsets=range(98))
    acts = ai.collect(model, days, sites=["resid_post"], layers=[1], positions=["final"], progress=False)
    frame = ai.fourier.spectrum(acts, values=days.answer if values is None else values(days.answer),
                                numbers=range(7), site="resid_post", n_shuffles=200).to_frame()
    frame = frame[frame.frequency > 0]
    return torch.tensor(frame.variance_share.to_numpy()), torch.tensor(frame.p_value.to_numpy())


def test_the_answer_day_lies_on_a_period_7_circle(zoo_model):
    """Where the model holds the day it computed (the final token, last layer), a period-7 circle in
    calendar order (frequency 1 of the 7 days) explains about half of the residual's variance: the
    strongest frequency, significant against shuffled days, and absent from a random-init model of the
    same shape (whose final token barely depends on the answer day) and from shuffled answers."""
    share, p = _answer_day_shares(zoo_model)
    assert int(share.argmax()) == 0 and share[0] >= 0.45 and p[0] <= 0.05, (share, p)
    perm = torch.randperm(7 * 98, generator=torch.Generator().manual_seed(0))
    shuffled, _ = _answer_day_shares(zoo_model, values=lambda answer: answer[perm])
    assert shuffled.max() <= 0.02, shuffled
    for seed in (0, 1):
        random_share, _ = _answer_day_shares(ai.models.random_like(zoo_model, seed=seed))
        assert random_share.max() <= 0.02 and share[0] >= random_share[0] + 0.4, (share, random_share)


def test_variance_shares_see_what_scale_free_power_shares_miss():
    """Planted: the answer day y = (a + b) mod 7 over a 7 × 98 grid, a period-7 circle of y plus a
    large term that depends on the offset b alone (balanced: it cancels in the per-day means). With a
    strong circle the variance share is the circle's fraction of the variance; with the circle 1000×
    weaker the power share of the per-day means still says 'all at period 7' (it is scale-free), while
    the variance share is about 0 — the random-init model's situation at the final token."""
    from arithinterp.fourier.basis import spectrum_of
    from arithinterp.fourier.number_axes import group_by_value, variance_shares

    generator = torch.Generator().manual_seed(0)
    a, b = torch.arange(7).repeat_interleave(98), torch.arange(98).repeat(7)
    y = (a + b) % 7
    angle = 2 * torch.pi * y.double() / 7
    circle = torch.stack([angle.cos(), angle.sin()], 1) @ torch.randn(2, 16, generator=generator, dtype=torch.float64)
    offset_term = torch.randn(98, 16, generator=generator, dtype=torch.float64)[b]
    strong = variance_shares(y, circle + 0.5 * offset_term, range(7))
    expected = float(circle.var(0).sum() / (circle + 0.5 * offset_term).var(0).sum())
    assert abs(float(strong[1]) - expected) < 0.02 and float(strong[2:].max()) < 0.01, strong
    weak_acts = 1e-3 * circle + offset_term
    power = spectrum_of(group_by_value(y, weak_acts, range(7)))[1:]
    assert float(power[0] / power.sum()) > 0.99  # the per-day means hold only the tiny circle
    weak = variance_shares(y, weak_acts, range(7))
    assert float(weak[1:].max()) < 1e-4, weak


@pytest.mark.slow
def test_the_addition_circuit_carries_weekday_arithmetic(zoo_model):
    """The top-32 edges scored on addition pairs reproduce the weekday task; 32 random edges do not."""
    from arithinterp import circuits
    from arithinterp.models.zoo import get_entry, zoo_prompts

    entry = get_entry("add-cyclic")
    addition = zoo_prompts(zoo_model, entry).counterfactual(vary="a", seed=0)[:60]
    days = cyclic.counterfactual(zoo_prompts(zoo_model, entry, family="weekday"), vary="a", seed=0)[:60]
    scored = circuits.score_edges(zoo_model, addition, "eap-ig", ig_steps=3, progress=False)
    top = circuits.top_n(scored, 32)
    shuffled = scored.with_kept(torch.zeros(scored.n_edges, dtype=torch.bool).index_fill_(
        0, torch.randperm(scored.n_edges, generator=torch.Generator().manual_seed(0))[:32], True), "random 32")
    assert circuits.edge_faithfulness(zoo_model, days, top).faithfulness >= 0.9
    assert circuits.edge_faithfulness(zoo_model, days, shuffled).faithfulness <= 0.5
    day_circuit = circuits.top_n(circuits.score_edges(zoo_model, days, "eap-ig", ig_steps=3, progress=False), 32)
    assert circuits.overlap(top, day_circuit).edge_jaccard >= 0.4


def test_patching_finds_the_day_moved_to_the_final_token(zoo_model):
    """Patching the residual stream on day pairs: at layer 0 the whole answer flip sits on the day
    token, and by layer 1 layer-0 attention has moved it to the final token (nothing is left at the day)."""
    pairs = cyclic.counterfactual(cyclic.weekdays(zoo_model, offsets=range(100)), vary="a", seed=0)[:100]
    frame = ai.patching.activation_patching(zoo_model, pairs, "resid_pre", progress=False).to_frame()
    effect = {(int(layer), int(position)): float(mean)
              for layer, position, mean in zip(frame["layer"], frame["position"], frame["mean"])}
    a, final = int(pairs.clean.positions["a"][0]), int(pairs.clean.positions["final"][0])
    unpatched = effect[(0, 0)]  # the BOS token is the same in both prompts: patching it changes nothing
    full = effect[(0, a)] - unpatched
    assert full > 10  # the day decides the answer: several logits of difference
    assert effect[(1, final)] - unpatched >= 0.9 * full
    assert abs(effect[(1, a)] - unpatched) <= 0.05 * full


@pytest.mark.slow
def test_training_a_multi_family_model_measures_every_family(tmp_path):
    from arithinterp.models.train import train
    from arithinterp.models.zoo import get_entry

    card = train("add-cyclic", out=tmp_path / "m", steps=3, progress=False)
    families = card["families"]
    assert set(families) == {"addition", "weekday", "month"}
    assert card["held_out_accuracy"] == min(f["held_out_accuracy"] for f in families.values())
    assert families["weekday"]["n_train"] + families["weekday"]["n_held_out"] == 7 * 100
    assert card["n_held_out"] == sum(f["n_held_out"] for f in families.values())
    assert set(card["history"][-1]["families"]) == set(families)
    # the shipped model's split: no held-out weekday problem was a training problem
    from arithinterp.models.train import split

    train_idx, test_idx = split(get_entry("add-cyclic"), task=get_entry("add-cyclic").extra_tasks[0])
    assert len(set(train_idx.tolist()) & set(test_idx.tolist())) == 0 and len(train_idx) + len(test_idx) == 700
    model = ai.load_model(str(tmp_path / "m"))
    assert model.to_tokens("Monday + 3 days =", prepend_bos=False).shape[-1] == 5
