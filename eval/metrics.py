"""Metrics over n graded samples per problem. Every rate is a fraction in [0, 1], averaged over problems.

- avg@n: mean over problems of the fraction of the n samples that are correct (the paper's avg@32), with a
  bootstrap confidence interval from resampling problems.
- pass@k: chance that at least one of k samples is correct, by the unbiased estimator of Chen et al. 2021
  ("Evaluating Large Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k) for c correct of n.
- maj@n: whether the most frequent extracted answer is correct. Answers are grouped by equivalence: all
  correct answers form one group, the others merge when `equivalent` says so; a tie between the correct
  group and others scores 1 / (number of tied groups), the expected score of a random tie break.
- no_answer_rate: the fraction of samples without a boxed answer.
- Lengths in tokens; truncation rate: the fraction of samples cut off by the token limit.
- Recall tasks (docs/retrieval.md), when the samples carry their problem's `context_length` / `num_pairs`:
  avg@n by context length and by number of pairs, each with its bootstrap interval over that group's problems;
  with MQAR's per-query grades (`query_correct`), the mean accuracy per query (Zoology's metric) overall and by
  group, and accuracy by query position (1 = the first query asked).
"""
from collections.abc import Callable

import numpy as np

PASS_KS = (1, 4, 16)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for c correct among n samples (product form: no huge binomials)."""
    if not 0 <= c <= n or not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 0 < k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_score(answers: list[str | None], correct: list[bool],
                   equivalent: Callable[[str, str], bool] | None = None) -> float:
    """maj@n of one problem (see module docstring). Samples without an answer do not vote."""
    right = sum(1 for a, ok in zip(answers, correct, strict=True) if a is not None and ok)
    wrong: dict[str, int] = {}  # whitespace-free answer text -> votes
    for a, ok in zip(answers, correct, strict=True):
        if a is not None and not ok:
            key = "".join(a.split())
            wrong[key] = wrong.get(key, 0) + 1
    if right == 0:
        return 0.0
    # Merging wrong answers can only matter when they could outvote the correct group together.
    if equivalent is not None and sum(wrong.values()) >= right:
        groups: list[list] = []  # [representative, votes], most voted first
        for key, votes in sorted(wrong.items(), key=lambda kv: -kv[1]):
            group = next((g for g in groups if equivalent(g[0], key)), None)
            if group is None:
                groups.append([key, votes])
            else:
                group[1] += votes
        counts = [votes for _, votes in groups]
    else:
        counts = list(wrong.values())
    top = max(counts, default=0)
    if right > top:
        return 1.0
    if right < top:
        return 0.0
    return 1.0 / (1 + counts.count(top))


def bootstrap_ci(values: list[float], confidence: float = 0.95, num_resamples: int = 2000, seed: int = 0
                 ) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (one per problem)."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(num_resamples, len(x)))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def paired_change(before: list[float], after: list[float]) -> dict:
    """Change in mean accuracy from `before` to `after`, the per-problem accuracies of two models on the same
    problems in the same order, with a bootstrap interval that resamples problems with both models' results
    together: problem difficulty, shared by both, then drops out of the interval."""
    if len(before) != len(after):
        raise ValueError(f"paired change needs the same problems, got {len(before)} and {len(after)}")
    diff = np.asarray(after, dtype=float) - np.asarray(before, dtype=float)
    low, high = bootstrap_ci(diff.tolist())
    return {"change": float(diff.mean()) if len(diff) else float("nan"), "change_ci95": [low, high]}


def length_edges(max_tokens: int) -> list[int]:
    """Bucket edges for accuracy by response length: 0, L/8, L/4, L/2, L (L = the token limit)."""
    return sorted({0, *(max(1, max_tokens // d) for d in (8, 4, 2)), max_tokens})


def compute_metrics(problems: list[list[dict]], max_tokens: int,
                    equivalent: Callable[[str, str], bool] | None = None) -> dict:
    """Metrics of one dataset. `problems`: per problem, its n samples as dicts with `correct` (bool),
    `extracted` (str or None), `num_tokens` (int) and `truncated` (bool)."""
    if not problems:
        raise ValueError("no problems to compute metrics over")
    n = len(problems[0])
    if n == 0 or any(len(samples) != n for samples in problems):
        raise ValueError(f"every problem needs the same number of samples, got {sorted({len(s) for s in problems})}")
    correct = np.array([[s["correct"] for s in samples] for samples in problems], dtype=bool)
    lengths = np.array([[s["num_tokens"] for s in samples] for samples in problems])
    truncated = np.array([[s["truncated"] for s in samples] for samples in problems], dtype=bool)
    per_problem = correct.mean(axis=1)
    low, high = bootstrap_ci(per_problem.tolist())
    out = {"num_problems": len(problems), "n": n, f"avg@{n}": float(per_problem.mean()),
           f"avg@{n}_ci95": [low, high]}
    for k in sorted({*PASS_KS, n}):
        if k <= n:
            out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)]))
    out[f"maj@{n}"] = float(np.mean([
        majority_score([s["extracted"] for s in samples], [s["correct"] for s in samples], equivalent)
        for samples in problems]))
    out["no_answer_rate"] = float(np.mean([s["extracted"] is None for samples in problems for s in samples]))
    out["mean_length"] = float(lengths.mean())
    out["max_length"] = int(lengths.max())
    out["truncation_rate"] = float(truncated.mean())
    edges = length_edges(max_tokens)
    buckets = []
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        last = i == len(edges) - 2
        inside = (lengths >= lo) & ((lengths <= hi) if last else (lengths < hi))  # the last one holds L itself
        count = int(inside.sum())
        buckets.append({"tokens": f"[{lo}, {hi}{']' if last else ')'}", "count": count,
                        "accuracy": float(correct[inside].mean()) if count else None})
    out["accuracy_by_length"] = buckets
    out.update(recall_metrics(problems))
    return out


GROUP_FIELDS = ("context_length", "num_pairs")


def accuracy_by_group(values: list[float], groups: list, field: str) -> list[dict]:
    """Mean of per-problem `values` for each value of a per-problem field, in increasing order of it, with a
    bootstrap interval resampling that group's problems: [{field: value, num_problems, accuracy, ci95}]."""
    if len(values) != len(groups):
        raise ValueError(f"one {field} per problem needed, got {len(groups)} for {len(values)} problems")
    out = []
    for group in sorted(set(groups)):
        x = [v for v, g in zip(values, groups) if g == group]
        low, high = bootstrap_ci(x)
        out.append({field: group, "num_problems": len(x), "accuracy": float(np.mean(x)), "ci95": [low, high]})
    return out


def query_position_accuracy(problems: list[list[dict]]) -> list[dict]:
    """Accuracy of the j-th query over every sample whose problem asks at least j queries:
    [{position (from 1), count (samples), accuracy}]."""
    right: list[int] = []
    count: list[int] = []
    for samples in problems:
        for s in samples:
            for j, ok in enumerate(s["query_correct"]):
                if j == len(count):
                    right.append(0)
                    count.append(0)
                right[j] += bool(ok)
                count[j] += 1
    return [{"position": j + 1, "count": c, "accuracy": r / c} for j, (r, c) in enumerate(zip(right, count))]


def recall_metrics(problems: list[list[dict]]) -> dict:
    """The recall tasks' breakdowns (module docstring); {} for samples without the fields (math sets)."""
    out: dict = {}
    first = [samples[0] for samples in problems]
    fields = [f for f in GROUP_FIELDS if all(f in s for s in first)]
    per_problem = [float(np.mean([s["correct"] for s in samples])) for samples in problems]
    for field in fields:
        out[f"accuracy_by_{field}"] = accuracy_by_group(per_problem, [s[field] for s in first], field)
    if all("query_correct" in s and s["query_correct"] for samples in problems for s in samples):
        per_query = [float(np.mean([np.mean(s["query_correct"]) for s in samples])) for samples in problems]
        low, high = bootstrap_ci(per_query)
        out["query_accuracy"] = float(np.mean(per_query))
        out["query_accuracy_ci95"] = [low, high]
        for field in fields:
            out[f"query_accuracy_by_{field}"] = accuracy_by_group(per_query, [s[field] for s in first], field)
        out["accuracy_by_query_position"] = query_position_accuracy(problems)
    return out
