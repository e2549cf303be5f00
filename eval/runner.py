"""avg@k evaluation through vLLM: n samples per problem, graded by rewards.grade, over one engine or several
(one per GPU), resumable. MQAR in Zoology's format (rows with a `sequence` column) is scored teacher-forced instead,
as Zoology does: one forward pass of the HF model over the sequence, and query j is right when the greedy next token
after its key is its value.

Output directory:
    run.json                  generation settings; a resumed run must use the same ones
    <dataset>.samples.jsonl   one line per sample, in problem order, then sample order
    shards/                   while a run is unfinished: each engine's samples so far (eval/shards.py)
    metrics.json              {dataset: metrics} (see eval/metrics.py), with the problems skipped
    results.md                the same as markdown tables

Splitting and resuming: problems x samples are split over the engines (eval/shards.py). Each problem has its own
sampling seed, derived from (seed, dataset, problem id), and sample j of it is drawn with that seed + j, so the
samples depend neither on the number of engines nor on what ran before. Each engine saves its samples after every
generate call; a restarted run draws only the samples missing (a half-written last line is dropped and drawn
again).

A problem the engine cannot take (its prompt + max_tokens over the engine's max_model_len, or a prompt vLLM
refuses) is skipped, not drawn: it is left out of the metrics and counted in them (`skipped_problems`, with the
reasons under `skipped`), and tried again when the run is resumed.
"""
import dataclasses
import itertools
import json
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path

from eval.metrics import compute_metrics
from eval.shards import append_records, file_stem, read_records, remove_shards, shard_files, shard_path, split_work
from rewards.accuracy import DEFAULT_TIMEOUT_S, grade
from rewards.retrieval import grade_answer
from rewards.text import last_boxed
from tasks import prompts
from tasks.files import write_atomic
from tasks.loaders import code_token_ids, load_benchmark
from tasks.retrieval import TASK_COLUMNS, query_answers

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """What every engine's share is drawn and graded with (`evaluate`'s arguments of the same names)."""

    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    batch_problems: int
    grading_timeout: float


@dataclass
class Plan:
    """An evaluation's datasets ({name: problem ids in order}; `exact`: the recall tasks, graded exactly), the
    samples already drawn per dataset, and the shares of the missing ones, one per engine."""

    datasets: dict[str, list[str]]
    exact: set[str]
    done: dict[str, int]
    shares: list[list[dict]] = dataclasses.field(default_factory=list)

    def reporter(self, n: int, progress):
        """A share's `report(dataset, samples it drew)` as `progress(dataset, samples done, samples)`."""
        if progress is None:
            return None
        for name, ids in self.datasets.items():
            progress(name, self.done[name], len(ids) * n)
        return lambda name, drawn: progress(name, self.done[name] + drawn, len(self.datasets[name]) * n)


class EvalFailed(RuntimeError):
    """A share of an evaluation failed (on another rank, or in an engine's process)."""


def evaluate(llm, datasets: list, out_dir: str | Path, *, n: int = 32, temperature: float = 1.0,
             top_p: float = 0.7, max_tokens: int = 32768, seed: int | None = 0, limit: int | None = None,
             batch_problems: int = 64, grading_timeout: float = DEFAULT_TIMEOUT_S, model_name: str = "",
             engines: int = 1, launch=None, ranks: bool = False, progress=None) -> dict:
    """Generate, grade and report; returns {dataset: metrics}.

    `llm`: a `vllm.LLM` (e.g. the engine GRPO generates with), or a function returning one, called only
    when some sample is missing (a finished evaluation then reruns without starting an engine).
    `model_name`: the model's directory; teacher-forced datasets load the model from it with transformers.
    `datasets`: benchmark names, paths or DataSources (tasks.loaders.benchmark_source).
    `seed` None: unseeded sampling.
    `batch_problems`: problems per `llm.generate` call; samples are saved after each call.
    `engines` > 1: the missing samples are split into that many shares, which `launch(shares, out_dir, sampling,
    report)` draws, each through its own engine (eval/workers.py: one process per GPU); `llm` is then unused.
    `ranks`: called on every rank of torch.distributed's default group, each with its own engine (GRPO's colocated
    ones): each rank draws its share and every rank returns the metrics.
    `progress(dataset, samples done, samples)`, if given, is called when a dataset starts and after each call.
    """
    out = Path(out_dir)
    sampling = Sampling(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
                        batch_problems=batch_problems, grading_timeout=grading_timeout)
    if ranks:
        return _evaluate_on_ranks(llm, datasets, out, sampling, limit, model_name)
    plan = plan_evaluation(datasets, out, sampling, engines=engines, limit=limit, model_name=model_name)
    report = plan.reporter(n, progress)
    if engines == 1:
        generate_share(llm, plan.shares[0], out, 0, sampling, report)
    else:
        launch(plan.shares, out, sampling, report)
    return finish_evaluation(plan, out, sampling)


def _evaluate_on_ranks(llm, datasets, out: Path, sampling: Sampling, limit, model_name) -> dict:
    """Rank 0 plans, every rank draws its share, rank 0 merges and scores. Each step's outcome, an error included,
    reaches every rank through a collective, so that a failure anywhere fails every rank at once: none is left
    waiting in a collective the others never enter."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    plan = _from_rank0(lambda: plan_evaluation(datasets, out, sampling, engines=world, limit=limit,
                                               model_name=model_name))
    try:
        mine = (generate_share(llm, plan.shares[rank], out, rank, sampling), None)
    except Exception as err:  # reported to every rank below
        logger.exception("rank %d: its share of the evaluation failed", rank)
        mine = (None, f"rank {rank}: {type(err).__name__}: {err}")
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    errors = [error for _, error in shares if error]
    if errors:
        raise EvalFailed(f"the evaluation failed on {'; '.join(errors)}")
    # Every rank's records: their shard files need not be on a file system rank 0 sees.
    records: dict[str, list[dict]] = {}
    for by_name, _ in shares:
        for name, new in by_name.items():
            records.setdefault(name, []).extend(new)
    return _from_rank0(lambda: finish_evaluation(plan, out, sampling, records))


def _from_rank0(work):
    """`work()` on rank 0; its result (or its error, raised) on every rank."""
    import torch.distributed as dist

    box, error = [None], None
    if dist.get_rank() == 0:
        try:
            box[0] = (work(), None)
        except Exception as err:
            error, box[0] = err, (None, f"rank 0: {type(err).__name__}: {err}")
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    result, message = box[0]
    if message:
        raise EvalFailed(f"the evaluation failed on {message}")
    return result


def plan_evaluation(datasets: list, out: Path, sampling: Sampling, *, engines: int, limit: int | None,
                    model_name: str) -> Plan:
    """Load the datasets, check them and the output directory's settings, score the teacher-forced ones, and split
    the samples not drawn yet over `engines`."""
    n = sampling.n
    out.mkdir(parents=True, exist_ok=True)
    _check_settings(out / "run.json", {
        "model": model_name, "n": n, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens, "seed": sampling.seed, "system_prompt": prompts.SYSTEM_PROMPT,
        "instruction": prompts.INSTRUCTION})
    plan, missing, scorer = Plan(datasets={}, exact=set(), done={}), [], None
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
        drawn: dict[str, set[int]] = {}
        for path in (samples_path(out, name), *shard_files(out, name)):
            for record in read_records(path, repair=True):
                if "sample" in record:
                    drawn.setdefault(record["id"], set()).add(record["sample"])
        todo = [(row, [j for j in range(n) if j not in drawn.get(row["id"], ())]) for row in rows]
        todo = [(row, samples) for row, samples in todo if samples]
        plan.datasets[name], plan.done[name] = ids, len(ids) * n - sum(len(s) for _, s in todo)
        if "task" in rows.column_names:  # a recall task: exact answers, no math equivalence (docs/retrieval.md)
            plan.exact.add(name)
        logger.info("%s: %d problems, %d of their %d samples drawn already", name, len(ids), plan.done[name],
                    len(ids) * n)
        if teacher_forced:  # no engine: scored here
            scorer = scorer or TeacherForced(model_name)
            for start in range(0, len(todo), sampling.batch_problems):
                append_records(shard_path(out, name, 0),
                               [scorer.score(row) for row, _ in todo[start:start + sampling.batch_problems]])
        else:
            keep = ["id", "prompt", "answer", *(k for k in TASK_COLUMNS if k in rows.column_names)]
            missing += [(name, {k: row[k] for k in keep}, samples) for row, samples in todo]
    plan.shares = split_work(missing, engines)
    return plan


def generate_share(llm, share: list[dict], out: Path, engine: int, sampling: Sampling,
                   report=None) -> dict[str, list[dict]]:
    """Draw and grade one engine's share (eval/shards.py: slices of problems' samples), appending the records to
    the engine's shard files after each generate call; returns {dataset: its records}. `report(dataset, samples
    drawn)`, if given, after each call."""
    records: dict[str, list[dict]] = {}
    for name, group in itertools.groupby(share, key=lambda s: s["dataset"]):
        slices, drawn = list(group), 0
        for start in range(0, len(slices), sampling.batch_problems):
            if not hasattr(llm, "generate"):  # a factory: start the engine now that it is needed
                llm = llm()
            batch = slices[start:start + sampling.batch_problems]
            new = _generate(llm, name, batch, sampling)
            _grade([r for r in new if "sample" in r], sampling.grading_timeout)
            append_records(shard_path(out, name, engine), new)
            records.setdefault(name, []).extend(new)
            drawn += sum(s["stop"] - s["start"] for s in batch)
            logger.info("%s: engine %d drew %d of its %d samples", name, engine, drawn,
                        sum(s["stop"] - s["start"] for s in slices))
            if report:
                report(name, drawn)
    return records


def finish_evaluation(plan: Plan, out: Path, sampling: Sampling, records: dict[str, list[dict]] | None = None
                      ) -> dict:
    """Merge every dataset's samples (its files, and `records` drawn elsewhere) into its samples file, score them
    and write the reports; returns {dataset: metrics}."""
    n, results = sampling.n, {}
    for name, ids in plan.datasets.items():
        shards = shard_files(out, name)
        mine = (records or {}).get(name, [])
        samples, skipped = {}, {}
        for record in itertools.chain(*(read_records(p) for p in (samples_path(out, name), *shards)), mine):
            if "sample" in record:
                samples.setdefault(record["id"], {}).setdefault(record["sample"], record)
            else:
                skipped.setdefault(record["id"], record["skipped"])
        complete = {pid: [by_j[j] for j in range(n)] for pid, by_j in samples.items() if len(by_j) == n}
        problems, skips = [], []
        for pid in ids:
            if pid in complete:
                problems.append(complete[pid])
            elif pid in skipped:
                skips.append({"id": pid, "reason": skipped[pid]})
            else:
                raise EvalFailed(f"{name}: problem {pid!r} has {len(samples.get(pid, {}))} of its {n} samples "
                                 "and was not skipped: an engine's share did not finish; run again to resume")
        if shards or mine:  # problems outside `ids` (an earlier, larger `limit`) are kept, after these
            order = [*ids, *(pid for pid in complete if pid not in set(ids))]
            write_atomic(samples_path(out, name), "".join(json.dumps(s, ensure_ascii=False) + "\n"
                                                          for pid in order if pid in complete for s in complete[pid]))
            remove_shards(out, name)
        if skips:
            logger.warning("%s: %d of %d problems skipped: %s", name, len(skips), len(ids),
                           "; ".join(f"{s['id']}: {s['reason']}" for s in skips))
        results[name] = _metrics(problems, skips, n, sampling, exact=name in plan.exact)
    _write_reports(out, results)
    return results


def _metrics(problems: list[list[dict]], skips: list[dict], n: int, sampling: Sampling, exact: bool) -> dict:
    if problems:
        metrics = compute_metrics(problems, sampling.max_tokens, equivalent=None if exact else lambda a, b: grade(
            [a], [b], sampling.grading_timeout)[0] == "correct")
    else:  # every problem was skipped: nothing to score
        metrics = {"num_problems": 0, "n": n}
    metrics["grading_failures"] = sum(s["grade"] in ("timeout", "error") for p in problems for s in p)
    return {**metrics, "skipped_problems": len(skips), "skipped": skips}


def problem_seed(seed: int, dataset: str, problem_id: str) -> int:
    """A per-problem sampling seed that does not depend on batching or on what ran before."""
    return zlib.crc32(f"{seed}/{dataset}/{problem_id}".encode())


def _generate(llm, dataset: str, slices: list[dict], sampling: Sampling) -> list[dict]:
    """The records of a batch of slices: samples, and a `skipped` record for a problem the engine cannot take."""
    from vllm import SamplingParams  # here, so that importing this module does not import vLLM

    tokenizer = llm.get_tokenizer()
    max_model_len, max_tokens, seed = llm.model_config.max_model_len, sampling.max_tokens, sampling.seed
    records, kept, requests, params = [], [], [], []
    for s in slices:
        row = s["row"]
        ids = prompts.prompt_token_ids(tokenizer, row["prompt"])
        # vLLM would silently shorten the generation limit to fit the context: samples would be cut short.
        if len(ids) + max_tokens > max_model_len:
            records.append({"id": row["id"], "skipped": f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) "
                                                       f"exceeds the engine's max_model_len ({max_model_len})"})
            continue
        kept.append(s)
        requests.append({"prompt_token_ids": ids})
        # vLLM seeds the j-th copy of a request with seed + j: this slice's samples are those of one request for all
        params.append(SamplingParams(n=s["stop"] - s["start"], temperature=sampling.temperature,
                                     top_p=sampling.top_p, max_tokens=max_tokens, seed=None if seed is None else
                                     problem_seed(seed, dataset, row["id"]) + s["start"]))
    for s, output in zip(kept, _generate_each(llm, requests, params), strict=True):
        row = s["row"]
        if isinstance(output, Exception):
            records.append({"id": row["id"], "skipped": f"refused by vLLM: {output}"})
            continue
        for j, completion in enumerate(output.outputs):
            records.append({"id": row["id"], "sample": s["start"] + j, "completion": completion.text,
                            "answer": row["answer"], "extracted": last_boxed(completion.text),
                            "num_tokens": len(completion.token_ids), "finish_reason": completion.finish_reason,
                            "truncated": completion.finish_reason == "length",
                            **{k: row[k] for k in TASK_COLUMNS if k in row}})
    return records


def _generate_each(llm, requests: list[dict], params: list) -> list:
    """`llm.generate`'s outputs, with the error in place of the output of a request vLLM refuses. vLLM refuses a
    whole batch for one such request (and drops the ones it had taken): the batch is then sent one at a time."""
    from vllm.exceptions import VLLMClientError

    refused = (ValueError, VLLMClientError)  # VLLMValidationError, or a ValueError from older checks
    if not requests:
        return []
    try:
        return llm.generate(requests, params, use_tqdm=False)
    except refused as err:
        if len(requests) == 1:
            return [err]
    outputs = []
    for request, p in zip(requests, params, strict=True):
        try:
            outputs += llm.generate([request], [p], use_tqdm=False)
        except refused as err:
            outputs.append(err)
    return outputs


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
    return Path(out_dir) / f"{file_stem(name)}.samples.jsonl"


def per_problem_accuracy(out_dir: str | Path, name: str, n: int) -> dict[str, float]:
    """{problem id: fraction of its n samples graded correct} from an evaluation's samples file."""
    by_id: dict[str, list[dict]] = {}
    for sample in read_records(samples_path(out_dir, name)):
        by_id.setdefault(sample["id"], []).append(sample)
    return {pid: sum(s["correct"] for s in samples) / n for pid, samples in by_id.items()}


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

    lines = ["| dataset | problems | skipped | n | avg@n (95% CI) | pass@1 | pass@4 | pass@16 | pass@n | maj@n | "
             "mean length | max length | truncated |", "|" + " --- |" * 13]
    for name, m in results.items():
        n, skipped = m["n"], m.get("skipped_problems", 0)
        if not m["num_problems"]:  # every problem skipped
            lines.append(f"| {name} | 0 | {skipped} | {n} |" + " - |" * 9)
            continue
        low, high = m[f"avg@{n}_ci95"]
        lines.append(f"| {name} | {m['num_problems']} | {skipped} | {n} | {pct(m[f'avg@{n}'])} ({pct(low)}-"
                     f"{pct(high)}) | {pct(m.get('pass@1'))} | {pct(m.get('pass@4'))} | {pct(m.get('pass@16'))} | "
                     f"{pct(m[f'pass@{n}'])} | {pct(m[f'maj@{n}'])} | {m['mean_length']:.0f} | {m['max_length']} | "
                     f"{pct(m['truncation_rate'])} |")
    lines += ["", "Accuracy (%) by response length in tokens (samples in brackets):", ""]
    for name, m in results.items():
        if not m["num_problems"]:
            continue
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

