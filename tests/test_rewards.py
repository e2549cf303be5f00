"""Rewards: answer extraction, math_accuracy on real MATH-500 answers and many answer forms, adversarial
completions under the time limit, failure accounting, the registry and its TRL-facing wrappers."""
import json
import logging
import math
import os
import pickle
import random
import re
import threading
import time

import pytest

import rewards
from conftest import shared_data_file
from rewards.accuracy import verify_answer
from rewards.format import has_format
from rewards.pool import DeadlinePool, shared_pool
from rewards.text import completion_text, last_boxed


@pytest.fixture(autouse=True)
def _fresh_counts():
    rewards.reset_failure_counts()
    yield
    rewards.reset_failure_counts()


def accuracy(completions, answers, **options):
    func = rewards.build_reward("math_accuracy", options)
    return func(["prompt"] * len(completions), completions, answer=answers)


# ---------------------------------------------------------------------------------------------------- extraction

@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{5}.", "5"),
    ("\\boxed{1} then \\boxed{2}", "2"),  # the last box wins
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are not nesting
    ("\\fbox{7}", "7"),
    ("\\boxed {  x = 3 }", "x = 3"),
    ("\\boxed{1} and finally \\boxed{2", None),  # the last box is cut off: no answer
    ("no box here", None),
    ("\\boxed{}", None),
    ("\\boxed{3} \\boxedfoo", "3"),  # another command that starts like \boxed
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_completion_text_forms():
    assert completion_text("abc") == "abc"
    assert completion_text([{"role": "assistant", "content": "a \\boxed{1}"}]) == "a \\boxed{1}"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "x"}]}]) == "x"
    assert accuracy([[{"role": "assistant", "content": "so \\boxed{4}"}]], ["4"]) == [1.0]


# ---------------------------------------------------------------------------------------------------- MATH-500

def _math500():
    with shared_data_file("math500.jsonl").open() as f:
        return [json.loads(line) for line in f]


def test_math500_gold_answers_equal_themselves():
    rows = _math500()
    golds = [r["answer"] for r in rows]
    # Through the reward, as a model would write it...
    completions = [f"Step by step... so the final answer is $\\boxed{{{g}}}$." for g in golds]
    assert accuracy(completions, golds) == [1.0] * len(rows)
    # ...and through math-verify itself (the reward skips it for identical strings).
    outcomes = shared_pool().map(verify_answer, [(g, g) for g in golds], 30.0)
    assert [g for g, o in zip(golds, outcomes) if o != ("ok", True)] == []
    assert rewards.failure_counts()["math_accuracy"] == {"error": 0, "timeout": 0, "invalid": 0}


# Pairs of MATH-500 answers that differ in value and that math-verify still accepts for each other: it compares
# an open interval with the set of its endpoints. (Found by checking all 45,150 pairs of distinct answers.)
LENIENT_PAIRS = {("(-2,1)", "-2,1"), ("(-2,1)", "1,-2")}


def _canonical(answer: str) -> str:
    """Test-side normalisation of the ways MATH-500 writes one value differently, to tell genuinely equal
    answers apart from answers the grader must reject: units and degrees ('30^\\circ' is 30, '15\\mbox{ cm}^2'
    is 15), a dollar sign, thousands separators ('10,\\!080'), '\\frac14', 'x=5', a base subscript ('40_9' is
    answered by its digits) and the order of a list of solutions ('1,-2' and '-2,1')."""
    s = answer
    for old, new in (("\\!", ""), ("\\$", ""), ("\\left", ""), ("\\right", ""), ("dfrac", "frac"), ("^\\circ", "")):
        s = s.replace(old, new)
    s = re.sub(r"\\mbox\{[^}]*\}(\^\d)?|\\text\{ [^}]*\}|_\{?\d+\}?$|^[a-z]\s*=", "", s).replace(" ", "")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    while re.search(r"\d,\d{3}(?!\d)", s):
        s = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", s)
    if "," in s and not re.search(r"[()\[\]{}]", s):  # an unordered list of solutions
        s = ",".join(sorted(s.split(",")))
    return s


def test_math500_answers_differ_from_other_problems():
    answers = sorted({r["answer"] for r in _math500()})
    rng = random.Random(0)
    pairs = set()
    while len(pairs) < 300:
        a, b = rng.sample(answers, 2)
        if _canonical(a) != _canonical(b) and (a, b) not in LENIENT_PAIRS and (b, a) not in LENIENT_PAIRS:
            pairs.add((a, b))
    pairs = sorted(pairs)
    scores = accuracy([f"\\boxed{{{pred}}}" for _, pred in pairs], [gold for gold, _ in pairs], timeout=30.0)
    assert [p for p, s in zip(pairs, scores) if s != 0.0] == []


def test_canonical_form_groups_the_equal_math500_answers():
    for a, b in [("120", "120^\\circ"), ("15", "15\\mbox{ cm}^2"), ("2 \\sqrt{5}", "2\\sqrt{5}"), ("36", "\\$36"),
                 ("40", "40_9"), ("5", "x=5"), ("\\frac14", "\\frac{1}{4}"), ("10,\\!080", "10080"), ("-2,1", "1,-2"),
                 ("5.4", "5.4 \\text{ cents}")]:
        assert _canonical(a) == _canonical(b), (a, b)
    assert _canonical("(8,-2)") != _canonical("(-2,8)") and _canonical("2k") != _canonical("2k+2")


@pytest.mark.parametrize("gold, pred, expected", [
    ("\\frac{14}{3}", "\\dfrac{14}{3}", 1.0),
    ("\\frac{14}{3}", "14/3", 1.0),
    ("\\frac{14}{3}", "4\\frac{2}{3}", 1.0),  # mixed number
    ("\\frac{14}{3}", "\\frac{13}{3}", 0.0),
    ("0.5", "\\frac12", 1.0),
    ("1.25", "\\frac{5}{4}", 1.0),
    ("1.25", "1.250", 1.0),
    ("1.25", "1.26", 0.0),
    ("50\\%", "50", 1.0),
    ("50\\%", "0.5", 1.0),
    ("-3", "-3.0", 1.0),
    ("-3", "3", 0.0),
    ("25", "025", 1.0),
    ("27", "27.0", 1.0),
    ("(3,4]", "(3, 4]", 1.0),
    ("(3,4]", "[3,4)", 0.0),
    ("(-\\infty, 0]", "(-\\infty,0]", 1.0),
    ("(0,9) \\cup (9,36)", "(0,9)\\cup(9,36)", 1.0),
    ("\\{1,2\\}", "\\{2,1\\}", 1.0),
    ("1,-2", "-2, 1", 1.0),
    ("(8,-2)", "(8, -2)", 1.0),
    ("(8,-2)", "(-2,8)", 0.0),  # tuples are ordered
    ("x^2+2x+1", "(x+1)^2", 1.0),
    ("x^2+2x+1", "(x-1)^2", 0.0),
    ("3\\sqrt{13}", "\\sqrt{117}", 1.0),
    ("\\text{(C)}", "C", 1.0),
    ("\\text{(C)}", "\\text{(C)}", 1.0),
    ("\\text{(C)}", "B", 0.0),
    ("C", "\\textbf{(C)}", 1.0),
    ("E", "\\text{(E)}", 1.0),
    ("D", "C", 0.0),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}", 1.0),
    ("x \\in [-2,7]", "[-2,7]", 1.0),
    ("10\\%", "0.1", 1.0),
    ("864 \\mbox{ inches}^2", "864", 1.0),
    ("5.4 \\text{ cents}", "5.4", 1.0),
    ("30^\\circ", "30", 1.0),
    ("\\$18.90", "18.90", 1.0),
    ("10,\\!080", "10080", 1.0),
    ("x=5", "5", 1.0),
    ("5", "x = 5", 1.0),
    ("y = 2x + 3", "2x+3", 1.0),
    ("\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}", "\\begin{pmatrix} 0.2 \\\\ -3.6 \\end{pmatrix}", 1.0),
    ("3 \\pm 2 \\sqrt{2}", "3+2\\sqrt{2}, 3-2\\sqrt{2}", 1.0),
    ("6 - 5i", "6-5i", 1.0),
    ("\\pi", "3.14159", 0.0),
])
def test_answer_forms(gold, pred, expected):
    assert accuracy([f"The answer is $\\boxed{{{pred}}}$."], [gold]) == [expected]


def test_gold_given_as_a_boxed_solution_and_as_an_integer():
    assert accuracy(["\\boxed{204}", "\\boxed{205}"], ["so it is \\boxed{204}.", 204]) == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------------- adversarial

def test_adversarial_completions_finish_within_the_time_limit():
    limit = 1.0
    nested = "\\frac{1}{" * 400 + "2" + "}" * 400
    completions = [
        "no box at all",
        "\\boxed{\\frac{1}{2}",  # unbalanced
        "\\boxed{" + "{" * 5000,
        "x" * 2_000_000 + " \\boxed{5}",  # megabytes of text, correct answer at the end
        "\\boxed{" + "1" * 1_000_000 + "}",  # a megabyte-long number
        "\\boxed{" + nested + "}",  # deeply nested LaTeX
        "\\boxed{10^{10^{10}}}",  # a CAS that tries this never finishes
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{(10^{100})!}",
        "\\boxed{2^{2^{40}} + 5}",
    ]
    start = time.monotonic()
    scores = accuracy(completions, ["5"] * len(completions), timeout=limit)
    elapsed = time.monotonic() - start
    assert scores[3] == 1.0
    assert [s for i, s in enumerate(scores) if i != 3] == [0.0] * (len(completions) - 1)
    # Checks run two at a time at least: every hanging check costs at most `limit`, plus worker restarts.
    assert elapsed < len(completions) * limit + 10, elapsed
    counts = rewards.failure_counts()["math_accuracy"]
    assert counts["timeout"] + counts["error"] >= 3  # the huge powers were cut off, not computed
    # The pool still works after killing workers.
    assert accuracy(["\\boxed{\\frac{1}{2}}"], ["0.5"]) == [1.0]


def test_grading_works_from_threads():
    results = {}

    def work(i):
        results[i] = accuracy([f"\\boxed{{\\dfrac{{{i}}}{{7}}}}", "\\boxed{3}"], [f"\\frac{{{i}}}{{7}}", "4"])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: [1.0, 0.0] for i in range(1, 5)}


def test_deadline_pool_kills_stuck_and_crashed_workers():
    pool = DeadlinePool(num_workers=2)
    try:
        start = time.monotonic()
        out = pool.map(time.sleep, [(30,), (0,), (30,)], timeout=0.5)
        assert out == [("timeout", None), ("ok", None), ("timeout", None)]
        assert time.monotonic() - start < 10
        out = pool.map(os._exit, [(3,)], timeout=5)
        assert out[0][0] == "error" and "died" in out[0][1]
        assert pool.map(math.factorial, [(5,), (-1,)], timeout=5) == [
            ("ok", 120), ("error", "ValueError: factorial() not defined for negative values")]
    finally:
        pool.close()


# ---------------------------------------------------------------------------------------------------- failures

def test_raising_user_reward_gives_zero_and_is_counted(caplog):
    def picky(prompts, completions, **kwargs):
        if any("bad" in c for c in completions):
            raise RuntimeError("cannot score this one")
        return [1.0] * len(completions)

    func = rewards.SafeReward(picky, "picky")
    logged = []
    with caplog.at_level(logging.WARNING, logger="rewards.registry"):
        # One bad completion: the batch is retried completion by completion, so only it gets 0.
        assert func(["p"] * 3, ["ok", "bad", "ok"], log_metric=lambda k, v: logged.append((k, v))) == [1.0, 0.0, 1.0]
        assert func(["p"], ["bad"]) == [0.0]
    assert rewards.failure_counts()["picky"] == {"error": 2, "timeout": 0, "invalid": 0}
    assert logged == [("rewards/picky/failed", 1 / 3)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot score this one" in warnings[0].getMessage()  # logged once


def test_invalid_returns_are_zero_and_counted():
    func = rewards.SafeReward(lambda prompts, completions, **kw: [float("nan"), None, "x", True], "odd")
    assert func(["p"] * 4, ["a"] * 4) == [0.0, None, 0.0, 1.0]  # None stays None: TRL's "not applicable"
    short = rewards.SafeReward(lambda prompts, completions, **kw: [1.0], "short")
    assert short(["p"] * 3, ["a"] * 3) == [0.0, 0.0, 0.0]
    counts = rewards.failure_counts()
    assert counts["odd"]["invalid"] == 2 and counts["short"]["invalid"] == 3


def test_missing_answer_column_is_counted_not_raised():
    func = rewards.build_reward("math_accuracy")
    assert func(["p"], ["\\boxed{1}"]) == [0.0]
    assert rewards.failure_counts()["math_accuracy"]["error"] == 1


# ---------------------------------------------------------------------------------------------------- registry

def user_reward(prompts, completions, *, bonus: float = 1.0, **kwargs):
    return [bonus] * len(completions)


def test_build_rewards_for_trl():
    from trl.trainer.utils import get_callable_name, is_async_callable

    funcs, weights = rewards.build_rewards([
        {"name": "math_accuracy", "weight": 1.0},
        {"name": "format", "weight": 0.1, "kwargs": {"structure": "think"}},
        {"name": "overlong_penalty", "weight": 0.5, "kwargs": {"max_length": 100, "buffer": 20}},
        {"name": "test_rewards:user_reward", "kwargs": {"bonus": 2.0}},
    ])
    assert [get_callable_name(f) for f in funcs] == ["math_accuracy", "format", "overlong_penalty", "user_reward"]
    assert weights == [1.0, 0.1, 0.5, 1.0]
    assert not any(is_async_callable(f) for f in funcs)
    # What GRPOTrainer._calculate_rewards passes: every column, completion_ids, trainer_state, log_* callbacks.
    columns = dict(answer=["4", "4"], id=["a", "b"], completion_ids=[[1] * 10, [1] * 95], trainer_state=None,
                   log_extra=lambda *a: None, log_metric=lambda *a: None)
    completions = ["<think>hmm</think> so \\boxed{4}", "\\boxed{5}"]
    assert [f(["p", "p"], completions, **columns) for f in funcs] == [
        [1.0, 0.0], [1.0, 0.0], [0.0, -0.75], [2.0, 2.0]]
    # Wrapped rewards pickle (TRL and Ray may send them to other processes).
    assert pickle.loads(pickle.dumps(funcs[1]))(["p"], ["\\boxed{1}"]) == [0.0]


def test_build_rewards_accepts_the_pipeline_spec_objects():
    class Spec:  # the attributes of pipeline.config.RewardSpec
        name, weight, kwargs = "format", 0.2, {}

    funcs, weights = rewards.build_rewards([Spec()])
    assert funcs[0].__name__ == "format" and weights == [0.2]


@pytest.mark.parametrize("specs, message", [
    (["nope"], "unknown reward 'nope'"),
    ([{"name": "format", "wieght": 1}], "unknown key(s) wieght"),
    ([{"name": "format", "weight": "high"}], "'weight' must be a finite number"),
    ([{"name": "format", "kwargs": {"strucure": "think"}}],
     "unknown option(s) strucure (did you mean 'structure'?); options: structure"),
    ([{"name": "overlong_penalty"}], "missing required option(s) max_length"),
    ([{"name": "no_such_module_xyz:f"}], "cannot import module 'no_such_module_xyz'"),
    ([{"name": "rewards.text:nothing"}], "has no function 'nothing'"),
    (["format", "format"], "two rewards would be logged as 'format'"),
])
def test_build_rewards_errors(specs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        rewards.build_rewards(specs)


def test_register_and_get_reward():
    @rewards.register("test_constant_reward")
    def constant(prompts, completions, **kwargs):
        return [0.5] * len(completions)

    assert rewards.get_reward("test_constant_reward") is constant
    assert "test_constant_reward" in rewards.registered()
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("test_constant_reward")(user_reward)
    funcs, _ = rewards.build_rewards([{"name": "format", "log_name": "format_think"}, "format"])
    assert [f.__name__ for f in funcs] == ["format_think", "format"]


# ---------------------------------------------------------------------------------------------------- format, length

@pytest.mark.parametrize("text, structure, expected", [
    ("so the answer is \\boxed{5}", "boxed", True),
    ("so the answer is $\\boxed{5}$.", "boxed", True),
    ("\\[\\boxed{5}\\]", "boxed", True),
    ("**\\boxed{5}**", "boxed", True),
    ("\\boxed{5} and then more words", "boxed", False),
    ("no box", "boxed", False),
    ("\\boxed{5", "boxed", False),
    ("<think>reasoning</think>\nSo \\boxed{5}", "think", True),
    ("reasoning</think>\nSo \\boxed{5}", "think", True),  # the template opened the think section
    ("<think>reasoning \\boxed{5}</think>", "think", False),  # the answer must follow the reasoning
    ("<think>a</think><think>b</think>\\boxed{5}", "think", False),
    ("So \\boxed{5}", "think", False),
    ("<think>r</think> <answer>It is \\boxed{5}.</answer>", "think_answer", True),
    ("<think>r</think> <answer>It is 5.</answer>", "think_answer", False),
    ("<think>r</think> \\boxed{5}", "think_answer", False),
])
def test_format(text, structure, expected):
    assert has_format(text, structure) is expected


def test_overlong_penalty():
    func = rewards.build_reward("overlong_penalty", {"max_length": 100, "buffer": 20})
    ids = [[0] * n for n in (0, 80, 90, 100, 101)]
    assert func(["p"] * 5, ["x"] * 5, completion_ids=ids) == [0.0, 0.0, -0.5, -1.0, -1.0]
    # Outside TRL there are no completion_ids: lengths are estimated from characters (4 per token).
    assert func(["p", "p"], ["x" * 40, "x" * 360], completion_ids=None) == [0.0, -0.5]
    # The default buffer is a fifth of the limit, as in DAPO (4096 of 20480).
    default = rewards.build_reward("overlong_penalty", {"max_length": 100})
    assert default(["p"], ["x"], completion_ids=[[0] * 90]) == [-0.5]


def test_overlong_penalty_is_trls_soft_overlong_punishment(monkeypatch):
    """TRL's reward computes it (not a copy of it here), with max_length as its limit and buffer as its cache."""
    import rewards.length

    calls = []

    def trl_reward(max_completion_len, soft_punish_cache):
        calls.append((max_completion_len, soft_punish_cache))
        return lambda completion_ids: [float(len(ids)) for ids in completion_ids]

    monkeypatch.setattr(rewards.length, "get_soft_overlong_punishment", trl_reward)
    func = rewards.build_reward("overlong_penalty", {"max_length": 100, "buffer": 30})
    assert func(["p"], ["x"], completion_ids=[[0] * 7]) == [7.0]
    assert func(["p"], ["x" * 9], completion_ids=None) == [3.0]  # 9 characters: 3 tokens, rounded up
    assert calls == [(100, 30), (100, 30)]


def sleepy_reward(prompts, completions, **kwargs):
    time.sleep(3600)


def length_reward(prompts, completions, *, scale: float = 1.0, **kwargs):
    return [scale * len(c) for c in completions]


def test_a_hanging_reward_with_a_timeout_scores_zero_and_is_counted():
    """A user reward that hangs (here: sleeps for an hour) is killed at its deadline; the batch scores 0, the
    completions are counted as timeouts, and training goes on."""
    from rewards import build_reward, failure_counts, reset_failure_counts

    reset_failure_counts()
    reward = build_reward(f"{__name__}:sleepy_reward", timeout=1.0)
    start = time.monotonic()
    assert reward(["p"] * 3, ["a", "b", "c"], answer=["1"] * 3) == [0.0, 0.0, 0.0]
    assert time.monotonic() - start < 30
    assert failure_counts()["sleepy_reward"]["timeout"] == 3


def test_a_reward_with_a_timeout_computes_the_same_in_its_worker():
    from rewards import build_reward

    inline = build_reward(f"{__name__}:length_reward", {"scale": 2.0})
    isolated = build_reward(f"{__name__}:length_reward", {"scale": 2.0}, timeout=30.0)
    completions = ["ab", "abcd", ""]
    assert (isolated(["p"] * 3, completions, log_metric=lambda *a: None) == inline(["p"] * 3, completions)
            == [4.0, 8.0, 0.0])
