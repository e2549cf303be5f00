"""retrieval_accuracy: exact grading of the recall tasks (tasks/retrieval.py, docs/retrieval.md).

The completion's last `\\boxed{}` must equal the gold answer as a string, after whitespace runs are made one
space and a final period is dropped: no CAS, no numeric equivalence (`0042` is not `42`, a UUID is text). For
MQAR the answer is the queried keys' values in order, space separated, and each query is also graded on its
own: query j is right when the j-th code of the boxed answer is the j-th value (Zoology's accuracy per query).
"""
from rewards.registry import register
from rewards.text import completion_text, last_boxed


def normalise(text: str | None) -> str | None:
    """An answer as graded: whitespace runs made one space, ends stripped, a final period dropped."""
    if text is None:
        return None
    text = " ".join(text.split())
    return text[:-1].rstrip() if text.endswith(".") else text


def grade_answer(task: str, extracted: str | None, answer: str) -> tuple[bool, list[bool] | None]:
    """(exact match, per-query matches for MQAR else None) of an extracted answer (None: no boxed answer)."""
    pred, gold = normalise(extracted), normalise(answer)
    correct = pred is not None and pred == gold
    if task != "mqar":
        return correct, None
    got = pred.split() if pred is not None else []
    return correct, [j < len(got) and got[j] == value for j, value in enumerate(gold.split())]


@register("retrieval_accuracy")
def retrieval_accuracy(prompts, completions, answer, task=None, *, per_query: bool = False, **kwargs) -> list[float]:
    """1.0 for an exact answer, else 0.0; with `per_query` (MQAR), the fraction of queries answered right.
    `task` is the dataset column of the recall tasks' rows."""
    tasks = task if task is not None else [None] * len(completions)
    scores = []
    for c, gold, t in zip(completions, answer, tasks, strict=True):
        correct, queries = grade_answer(t or "", last_boxed(completion_text(c)), gold)
        scores.append(sum(queries) / len(queries) if per_query and queries else float(correct))
    return scores
