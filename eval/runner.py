"""avg@k evaluation through vLLM: n samples per problem, graded by rewards.grade, resumable. MQAR in Zoology's
format (rows with a `sequence` column) is scored teacher-forced instead, as Zoology does: one forward pass of the
HF model over the sequence, and query j is right when the greedy next token after its key is its value.

Output directory:
    run.json                  generation settings; a resumed run must use the same ones
    <dataset>.samples.jsonl   one line per sample, appended problem batch by problem batch
    metrics.json              {dataset: metrics} (see eval/metrics.py)
    results.md                the same as markdown tables

Resuming: problems whose n samples are all in the JSONL are not generated again; a half-written last line
or a problem with missing samples (a kill mid-write) is dropped and regenerated. Each problem has its own
sampling seed, derived from (seed, dataset, problem id), so a resumed run produces the samples an
uninterrupted one would have.
"""
import json
import logging
import os
import zlib
from pathlib import Path

from eval.metrics import compute_metrics
from rewards.accuracy import DEFAULT_TIMEOUT_S, grade
from rewards.retrieval import grade_answer
from rewards.text import last_boxed
from tasks import prompts
from tasks.files import write_atomic
from tasks.loaders import code_token_ids, load_benchmark
from tasks.retrieval import TASK_COLUMNS, query_answers

logger = logging.getLogger(__name__)


def evaluate(llm, datasets: list, out_dir: str | Path, *, n: int = 32, temperature: float = 1.0,
             top_p: float = 0.7, max_tokens: int = 32768, seed: int | None = 0, limit: int | None = None,
             batch_problems: int = 64, grading_timeout: float = DEFAULT_TIMEOUT_S, model_name: str = "",
             progress=None) -> dict:
    """Generate, grade and report; returns {dataset: metrics}.

    `llm`: a `vllm.LLM` (e.g. the engine GRPO generates with), or a function returning one, called only
    when some sample is missing (a finished evaluation then reruns without starting an engine).
    `model_name`: the model's directory; teacher-forced datasets load the model from it with transformers.
    `datasets`: benchmark names, paths or DataSources (tasks.loaders.benchmark_source).
    `seed` None: unseeded sampling.
    `batch_problems`: problems per `llm.generate` call; samples are saved after each call.
    `progress(dataset, problems done, problems)`, if given, is called when a dataset starts and after each call.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"model": model_name, "n": n, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens,
                "seed": seed, "system_prompt": prompts.SYSTEM_PROMPT, "instruction": prompts.INSTRUCTION}
    _check_settings(out / "run.json", settings)
    results, scorer = {}, None
    for spec in datasets:
        name, rows = load_benchmark(spec, limit)
        teacher_forced = "sequence" in rows.column_names
        if teacher_forced and n != 1:
            raise ValueError(f"{name}: Zoology-format MQAR is scored teacher-forced (one greedy prediction per "
                             f"query), so n must be 1, got {n}")
        ids = [row["id"] for row in rows]
        if len(set(ids)) != len(ids):
            duplicate = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"{spec}: problem id {duplicate!r} appears more than once; ids must be unique")
        path = samples_path(out, name)
        finished = _load_finished(path, n)
        todo = [row for row in rows if row["id"] not in finished]
        logger.info("%s: %d problems, %d already evaluated", name, len(rows), len(rows) - len(todo))
        if progress:
            progress(name, len(rows) - len(todo), len(rows))
        for start in range(0, len(todo), batch_problems):
            batch = todo[start:start + batch_problems]
            if teacher_forced:
                scorer = scorer or TeacherForced(model_name)
                samples = [scorer.score(row) for row in batch]
            else:
                if not hasattr(llm, "generate"):  # a factory: start the engine now that it is needed
                    llm = llm()
                samples = _generate(llm, name, batch, n=n, temperature=temperature, top_p=top_p,
                                    max_tokens=max_tokens, seed=seed)
                _grade(samples, grading_timeout)
            _append(path, samples)
            for sample in samples:
                finished.setdefault(sample["id"], []).append(sample)
            done = len(rows) - len(todo) + start + len(batch)
            logger.info("%s: %d/%d problems evaluated", name, done, len(rows))
            if progress:
                progress(name, done, len(rows))
        problems = [finished[i] for i in ids]
        exact = "task" in rows.column_names  # a recall task: exact answers, no math equivalence (docs/retrieval.md)
        metrics = compute_metrics(problems, max_tokens, equivalent=None if exact else lambda a, b: grade(
            [a], [b], grading_timeout)[0] == "correct")
        metrics["grading_failures"] = sum(s["grade"] in ("timeout", "error") for p in problems for s in p)
        results[name] = metrics
    _write_reports(out, results)
    return results


def problem_seed(seed: int, dataset: str, problem_id: str) -> int:
    """A per-problem sampling seed that does not depend on batching or on what ran before."""
    return zlib.crc32(f"{seed}/{dataset}/{problem_id}".encode())


def _generate(llm, dataset: str, batch: list[dict], *, n, temperature, top_p, max_tokens, seed) -> list[dict]:
    from vllm import SamplingParams  # here, so that importing this module does not import vLLM

    tokenizer = llm.get_tokenizer()
    max_model_len = llm.model_config.max_model_len
    requests, params = [], []
    for row in batch:
        ids = prompts.prompt_token_ids(tokenizer, row["prompt"])
        # vLLM would silently shorten the generation limit to fit the context: samples would be cut short.
        if len(ids) + max_tokens > max_model_len:
            raise ValueError(f"{dataset}: problem {row['id']!r}: prompt ({len(ids)} tokens) + max_tokens "
                             f"({max_tokens}) exceeds the engine's max_model_len ({max_model_len}); raise "
                             "max_model_len or lower max_tokens")
        requests.append({"prompt_token_ids": ids})
        params.append(SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                     seed=None if seed is None else problem_seed(seed, dataset, row["id"])))
    outputs = llm.generate(requests, params, use_tqdm=False)
    samples = []
    for row, output in zip(batch, outputs, strict=True):
        for j, completion in enumerate(output.outputs):
            samples.append({"id": row["id"], "sample": j, "completion": completion.text, "answer": row["answer"],
                            "extracted": last_boxed(completion.text), "num_tokens": len(completion.token_ids),
                            "finish_reason": completion.finish_reason,
                            "truncated": completion.finish_reason == "length",
                            **{k: row[k] for k in TASK_COLUMNS if k in row}})
    return samples


class TeacherForced:
    """Zoology's MQAR accuracy: the model (transformers, float32) reads a row's whole code sequence once; query j
    is right when the argmax of the next-token logits at its key is the value's token (the sequence holds filler
    there, never the answer). Greedy decoding of one code after the same prefix gives the same prediction,
    without a generation engine."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import sse_model  # noqa: F401  (registers sse_hybrid with the Auto classes)

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def score(self, row: dict) -> dict:
        """The row's one sample, graded: `query_correct` per query, `correct` when every query is right."""
        ids = code_token_ids(self.tokenizer, row["sequence"])
        answers = query_answers(ids, row["num_pairs"])
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([ids])).logits[0]
        predicted = logits[[slot - 1 for slot, _ in answers]].argmax(-1).tolist()
        query_correct = [token == value for token, (_, value) in zip(predicted, answers, strict=True)]
        text = " ".join(self.tokenizer.decode([token]).strip() for token in predicted)
        return {"id": row["id"], "sample": 0, "completion": text, "answer": row["answer"], "extracted": text,
                "num_tokens": len(predicted), "finish_reason": "teacher_forced", "truncated": False,
                **{k: row[k] for k in TASK_COLUMNS}, "grade": "correct" if all(query_correct) else "wrong",
                "correct": all(query_correct), "query_correct": query_correct}


def _grade(samples: list[dict], timeout: float):
    """Math answers by rewards.grade; a recall task's exactly, MQAR's also query by query (rewards.retrieval)."""
    recall = [s for s in samples if "task" in s]
    for sample in recall:
        correct, queries = grade_answer(sample["task"], sample["extracted"], sample["answer"])
        sample["grade"], sample["correct"] = "correct" if correct else "wrong", correct
        if queries is not None:
            sample["query_correct"] = queries
    math = [s for s in samples if "task" not in s]
    grades = grade([s["extracted"] for s in math], [s["answer"] for s in math], timeout) if math else []
    for sample, g in zip(math, grades):
        sample["grade"] = g
        sample["correct"] = g == "correct"


# ---------------------------------------------------------------------------------------------------- files

def _check_settings(path: Path, settings: dict):
    """Samples of one output directory must come from one set of generation settings."""
    if path.exists():
        saved = json.loads(path.read_text())
        changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in settings.items() if saved.get(k) != v]
        if changed:
            raise ValueError(f"{path.parent} holds samples generated with other settings ({'; '.join(changed)}); "
                             "use a new output directory")
    else:
        write_atomic(path, json.dumps(settings, indent=2) + "\n")


def samples_path(out_dir: str | Path, name: str) -> Path:
    return Path(out_dir) / f"{name.replace('/', '__')}.samples.jsonl"  # a Hugging Face id has a slash


def per_problem_accuracy(out_dir: str | Path, name: str, n: int) -> dict[str, float]:
    """{problem id: fraction of its n samples graded correct} from an evaluation's samples file."""
    return {pid: sum(s["correct"] for s in samples) / n
            for pid, samples in _load_finished(samples_path(out_dir, name), n).items()}


def _load_finished(path: Path, n: int) -> dict[str, list[dict]]:
    """{problem id: its n samples} from a samples file; rewrites the file without incomplete problems."""
    if not path.exists():
        return {}
    by_id: dict[str, dict[int, dict]] = {}
    unreadable = 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
            by_id.setdefault(sample["id"], {})[sample["sample"]] = sample
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            unreadable += 1
    finished = {pid: [s[j] for j in range(n)] for pid, s in by_id.items() if sorted(s) == list(range(n))}
    if unreadable or len(finished) < len(by_id):
        logger.warning("%s: dropping %d unreadable lines and %d incomplete problems; they are generated again",
                       path, unreadable, len(by_id) - len(finished))
        write_atomic(path, "".join(json.dumps(s, ensure_ascii=False) + "\n"
                                    for samples in finished.values() for s in samples))
    return finished


def _append(path: Path, samples: list[dict]):
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))
        f.flush()
        os.fsync(f.fileno())


def _write_reports(out: Path, results: dict):
    """metrics.json and results.md, keeping datasets evaluated earlier into the same directory."""
    path = out / "metrics.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(results)
    write_atomic(path, json.dumps(merged, indent=2) + "\n")
    write_atomic(out / "results.md", markdown_report(merged))


def markdown_report(results: dict) -> str:
    """Markdown tables of {dataset: metrics}: the headline metrics, then accuracy by response length."""
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}"

    lines = ["| dataset | problems | n | avg@n (95% CI) | pass@1 | pass@4 | pass@16 | pass@n | maj@n | "
             "mean length | max length | truncated |", "|" + " --- |" * 12]
    for name, m in results.items():
        n = m["n"]
        low, high = m[f"avg@{n}_ci95"]
        lines.append(f"| {name} | {m['num_problems']} | {n} | {pct(m[f'avg@{n}'])} ({pct(low)}-{pct(high)}) | "
                     f"{pct(m.get('pass@1'))} | {pct(m.get('pass@4'))} | {pct(m.get('pass@16'))} | "
                     f"{pct(m[f'pass@{n}'])} | {pct(m[f'maj@{n}'])} | {m['mean_length']:.0f} | {m['max_length']} | "
                     f"{pct(m['truncation_rate'])} |")
    lines += ["", "Accuracy (%) by response length in tokens (samples in brackets):", ""]
    for name, m in results.items():
        cells = [f"{pct(b['accuracy'])} ({b['count']})" for b in m["accuracy_by_length"]]
        lines += [f"| {name} | " + " | ".join(b["tokens"] for b in m["accuracy_by_length"]) + " |",
                  "|" + " --- |" * (len(cells) + 1), "| accuracy | " + " | ".join(cells) + " |", ""]
    return "\n".join(lines + recall_report(results))


def recall_report(results: dict) -> list[str]:
    """Markdown lines of the recall tasks' breakdowns (eval/metrics.py recall_metrics); none for math sets."""
    def pct(x: float) -> str:
        return f"{100 * x:.1f}"

    lines = []
    for field, label in (("context_length", "context length"), ("num_pairs", "pairs")):
        rows = [(name, m) for name, m in results.items() if f"accuracy_by_{field}" in m]
        if not rows:
            continue
        lines += [f"Recall accuracy (%) by {label} (95% CI; problems in brackets):", "",
                  f"| dataset | {label} | avg@n | per-query accuracy |", "| --- | --- | --- | --- |"]
        for name, m in rows:
            per_query = {g[field]: g for g in m.get(f"query_accuracy_by_{field}", [])}
            for g in m[f"accuracy_by_{field}"]:
                q = per_query.get(g[field])
                q_text = f"{pct(q['accuracy'])} ({pct(q['ci95'][0])}-{pct(q['ci95'][1])})" if q else "-"
                lines.append(f"| {name} | {g[field]} | {pct(g['accuracy'])} ({pct(g['ci95'][0])}-"
                             f"{pct(g['ci95'][1])}) [{g['num_problems']}] | {q_text} |")
        lines.append("")
    for name, m in results.items():
        if "accuracy_by_query_position" not in m:
            continue
        # Positions in doubling buckets (1, 2-3, 4-7, ...): a 256-query test set would be a 256-column table.
        buckets, lo = [], 1
        positions = m["accuracy_by_query_position"]
        while lo <= len(positions):
            part = positions[lo - 1:2 * lo - 1]
            count = sum(p["count"] for p in part)
            right = sum(p["accuracy"] * p["count"] for p in part)
            buckets.append((f"{lo}" if len(part) == 1 else f"{lo}-{lo + len(part) - 1}", right / count, count))
            lo *= 2
        lines += [f"{name}: accuracy (%) by query position (samples in brackets):", "",
                  "| position | " + " | ".join(b[0] for b in buckets) + " |", "|" + " --- |" * (len(buckets) + 1),
                  "| accuracy | " + " | ".join(f"{pct(b[1])} ({b[2]})" for b in buckets) + " |", ""]
    return lines

