"""math_accuracy: 1 when the last `\\boxed{}` of a completion is equivalent to the gold answer, else 0.

Equivalence is math-verify's (sympy underneath): fractions and `\\dfrac`, decimals, percentages, signs,
intervals, sets, tuples, matrices, expressions, `x = 5` against `5`, units and degrees dropped, `\\text{(C)}`
against `C`. Each check runs in a worker process with a hard deadline (rewards.pool), because one
pathological answer (`\\boxed{9^{9^{9^9}}}`) can keep sympy busy forever. Identical strings skip the check,
plain numbers are compared exactly, and each distinct (answer, gold) pair is checked once and remembered:
a GRPO group often repeats an answer.
"""
import logging
import re
from fractions import Fraction

from rewards.pool import shared_pool
from rewards.registry import record_failure, register
from rewards.text import completion_text, last_boxed

DEFAULT_TIMEOUT_S = 5.0
_PLAIN_NUMBER = re.compile(r"-?\d{1,30}(?:\.\d{1,30})?")  # longer ones go to the CAS
# Verdicts of earlier checks, by (answer, gold): answers recur across GRPO steps and epochs.
_CACHE_SIZE = 200_000
_cache: dict[tuple[str, str], str] = {}


def gold_answer(answer) -> str:
    """A dataset's gold answer as a string: integers as they are, a boxed solution reduced to its box."""
    text = str(answer).strip()
    return last_boxed(text) or text


def grade(preds: list[str | None], golds: list, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Judge each extracted answer against its gold answer: "correct", "wrong", "timeout" (the check took
    longer than `timeout` seconds) or "error" (the check crashed). A missing answer (None) is "wrong"."""
    results = [""] * len(preds)
    pending: dict[tuple[str, str], list[int]] = {}
    for i, (pred, gold) in enumerate(zip(preds, golds, strict=True)):
        gold = gold_answer(gold)
        results[i] = _quick_grade(pred, gold) or _cache.get((pred, gold), "")
        if not results[i]:
            pending.setdefault((pred, gold), []).append(i)
    outcomes = shared_pool().map(verify_answer, list(pending), timeout) if pending else []
    if len(_cache) > _CACHE_SIZE:
        _cache.clear()
    for pair, indices, (status, value) in zip(pending, pending.values(), outcomes):
        result = ("correct" if value else "wrong") if status == "ok" else status
        if status == "ok":  # a timeout may pass on a less loaded machine: not cached
            _cache[pair] = result
        for i in indices:
            results[i] = result
    return results


def _quick_grade(pred: str | None, gold: str) -> str:
    """The verdict where no CAS is needed ("" otherwise): no answer, the same text, or two plain numbers."""
    if pred is None:
        return "wrong"
    if "".join(pred.split()) == "".join(gold.split()):
        return "correct"
    if _PLAIN_NUMBER.fullmatch(pred) and _PLAIN_NUMBER.fullmatch(gold):  # AIME-style integers, mostly
        return "correct" if Fraction(pred) == Fraction(gold) else "wrong"
    return ""


@register("math_accuracy")
def math_accuracy(prompts, completions, answer, *, timeout: float = DEFAULT_TIMEOUT_S, **kwargs) -> list[float]:
    """1.0 when the completion's last boxed answer equals the gold `answer` column, else 0.0 (also when the
    check crashes or takes longer than `timeout` seconds; those are counted as reward failures)."""
    preds = [last_boxed(completion_text(c)) for c in completions]
    grades = grade(preds, answer, timeout)
    for kind in ("timeout", "error"):
        failed = [i for i, g in enumerate(grades) if g == kind]
        if failed:
            record_failure(kind, len(failed), f"checking {preds[failed[0]][:80]!r} against "
                           f"{gold_answer(answer[failed[0]])!r}: {kind} (limit {timeout} s)")
    return [1.0 if g == "correct" else 0.0 for g in grades]


# ---------------------------------------------------------------------------------------------------- worker side

_extraction_config = None


def verify_answer(pred: str, gold: str) -> bool:
    """math-verify's judgement of `pred` against `gold`, both answer contents without `\\boxed`.

    Runs in a grading worker (no timeout of its own: the pool's deadline is the time limit; math-verify's
    signal-based one is switched off because it only works in a main thread).
    """
    global _extraction_config
    import math_verify

    if _extraction_config is None:
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning
        # Boxed LaTeX first; plain expressions ("14/3") as a fallback.
        _extraction_config = (math_verify.LatexExtractionConfig(boxed_match_priority=0),
                              math_verify.ExprExtractionConfig())
    gold_parsed = math_verify.parse(f"\\boxed{{{gold}}}", _extraction_config, parsing_timeout=None)
    pred_parsed = math_verify.parse(f"\\boxed{{{pred}}}", _extraction_config, parsing_timeout=None)
    return math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None)
