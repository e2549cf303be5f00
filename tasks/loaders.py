"""Datasets for the stages and for `sse-rl eval`, from the generator, a local JSONL/Parquet file, a Hugging Face
dataset id, or a benchmark name (`tasks.sources.BENCHMARKS`).

Every source is normalised to TRL's conversational formats:
  SFT:       {"prompt": [messages], "completion": [assistant message]}   (loss on the completion)
  RL, eval:  {"prompt": [messages], "answer": str, "id": str}            (rewards read `answer`)
A text prompt becomes one user message in the shared prompt template (`tasks.prompts`); a prompt that
is already a list of chat messages is kept as it is. The exception is MQAR in Zoology's format (`options.format:
zoology`): no prompt and no chat template, one sequence of codes per row (SFT: `text`, tokenized by
`tokenize_codes` with labels on the answer slots only; eval: a `sequence` column, scored teacher-forced).
A malformed row raises DataError naming the source, the row (the line number for JSONL) and the field.

This package is the task layer: the stages and `eval/` import it, it imports neither.
"""
import dataclasses
import functools
import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq

from tasks.generator import generate
from tasks.prompts import build_prompt, prompt_token_ids
from tasks.retrieval import TASK_COLUMNS, answer_labels, generate_task
from tasks.sources import BENCHMARKS, DataSource, describe

ROLES = ("system", "user", "assistant")
_MESSAGES = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
SFT_FEATURES = datasets.Features({"prompt": _MESSAGES, "completion": _MESSAGES})
RL_FEATURES = datasets.Features(
    {"prompt": _MESSAGES, "answer": datasets.Value("string"), "id": datasets.Value("string")})
# RL and eval rows of a recall task also keep what grading and the eval report's breakdowns read.
TASK_FEATURES = {"task": datasets.Value("string"), "context_length": datasets.Value("int64"),
                 "num_pairs": datasets.Value("int64")}
# Zoology-format MQAR: the code sequence (with a leading space, see `code_text`) and how many queries it holds.
CODE_FEATURES = {"sequence": datasets.Value("string"), "num_queries": datasets.Value("int64")}


class DataError(ValueError):
    """A dataset row or file that cannot be used; the message names the source, row and field."""


def load_sft_dataset(src: DataSource) -> datasets.Dataset:
    """Prompt-completion examples. Columns: `messages_field` (its last turn is the target), else
    `prompt_field` + `completion_field` (text, or chat messages). Zoology-format MQAR: `text` (the code sequence)
    and `num_pairs`, for `tokenize_codes`."""
    if is_code_sequence(src):
        rows = _generated(src)
        return datasets.Dataset.from_list(
            [{"text": r["sequence"], "num_pairs": r["num_pairs"]} for r in rows],
            datasets.Features({"text": datasets.Value("string"), "num_pairs": datasets.Value("int64")}))
    return _normalise(src, _sft_row, SFT_FEATURES)


def is_code_sequence(src: DataSource) -> bool:
    """Whether `src` is MQAR in Zoology's format (a sequence of codes, not a prompt and an answer)."""
    g = src.generator
    return src.source == "generator" and g.task == "mqar" and g.options.get("format") == "zoology"


def code_text(problem: str) -> str:
    """The text a Zoology-format sequence is tokenized from: a leading space, so that the first code is
    space-prefixed like every other and the byte-level BPE gives it the same token as the same code later on."""
    return " " + problem


def code_token_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a code sequence, one per code; a code split into several tokens would make the answer
    positions wrong (and recall a multi-token task), so it is refused."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    codes = len(text.split())
    if len(ids) != codes:
        raise DataError(f"{codes} codes gave {len(ids)} tokens ({text[:60].strip()!r}...): Zoology-format MQAR needs "
                        "one token per code; train the tokenizer on these rows (model.tokenizer.train) with enough "
                        "entries (model.tokenizer.vocab_size) or use a smaller options.vocab_size")
    return ids


def tokenize_codes(dataset: datasets.Dataset, tokenizer) -> datasets.Dataset:
    """Zoology-format SFT rows as TRL's pre-tokenized examples: `input_ids` (one token per code) and `labels`, the
    queried value at every answer slot and -100 elsewhere, so the loss is on the answers only (Zoology's loss) and
    no answer is ever an input. TRL uses a `labels` column as it is."""
    def encode(row):
        ids = code_token_ids(tokenizer, row["text"])
        return {"input_ids": ids, "labels": answer_labels(ids, row["num_pairs"])}

    return dataset.map(encode, remove_columns=dataset.column_names, desc="Tokenizing code sequences")


def load_rl_dataset(src: DataSource) -> datasets.Dataset:
    """Prompts with reference answers, for GRPO and eval. Columns: `prompt_field`, `answer_field`, `id_field`."""
    return _normalise(src, _rl_row, RL_FEATURES)


def benchmark_source(spec: str | DataSource, limit: int | None = None) -> DataSource:
    """The DataSource of a benchmark name, a local .jsonl/.parquet file, or a Hugging Face id / dataset directory
    (split "test"); a config's DataSource as is. `limit` keeps the first rows only."""
    if isinstance(spec, DataSource):
        src = spec
    elif spec in BENCHMARKS:
        src = BENCHMARKS[spec]
    elif _is_file(spec) or "/" in spec or Path(spec).is_dir():
        src = DataSource(source=spec, split="test")
    else:
        raise ValueError(f"unknown benchmark {spec!r}: use one of {', '.join(sorted(BENCHMARKS))}, a .jsonl or "
                         ".parquet file, or a Hugging Face dataset id")
    return dataclasses.replace(src, limit=limit)


def load_benchmark(spec: str | DataSource, limit: int | None = None) -> tuple[str, datasets.Dataset]:
    """(name for reports, rows) of a benchmark (see `benchmark_source`), rows as `load_rl_dataset` gives them."""
    src = benchmark_source(spec, limit)
    return source_name(src), load_rl_dataset(src)


def source_name(src: DataSource) -> str:
    """Label for metrics and reports: `name`, else the file stem, Hugging Face id or `generator-<split>`."""
    if src.name:
        return src.name
    if src.source == "generator":
        return f"generator-{src.split}" if src.generator.task == "arithmetic" else f"{src.generator.task}-{src.split}"
    path = Path(src.source)
    return path.stem if _is_file(src.source) else path.name if path.is_dir() else src.source


def filter_long_prompts(dataset: datasets.Dataset, tokenizer, max_length: int, mode: str
                        ) -> tuple[datasets.Dataset, int]:
    """Drop prompts whose chat-templated length exceeds `max_length` ("skip": returns how many), or refuse
    them ("error", naming the first). Long prompts would otherwise be truncated silently."""
    lengths = [len(prompt_token_ids(tokenizer, p)) for p in dataset["prompt"]]
    keep = [i for i, n in enumerate(lengths) if n <= max_length]
    if mode == "error" and len(keep) < len(lengths):
        first = next(i for i, n in enumerate(lengths) if n > max_length)
        raise DataError(f"prompt {dataset[first]['id']!r}: {lengths[first]} tokens, over max_prompt_length="
                        f"{max_length} ({len(lengths) - len(keep)} prompts in all; grpo.long_prompts: skip drops them)")
    return dataset.select(keep), len(lengths) - len(keep)


# ---------------------------------------------------------------------------------------------------- rows

def _normalise(src: DataSource, make_row, features: datasets.Features) -> datasets.Dataset:
    label = _label(src)
    make = functools.partial(make_row, src=src, label=label)
    if src.source == "generator":
        g = src.generator
        rows = _generated(src)
        if g.task != "arithmetic" and "answer" in features:
            extra = CODE_FEATURES if is_code_sequence(src) else {}
            features = datasets.Features({**features, **TASK_FEATURES, **extra})
            make = functools.partial(_with_task_columns, make=make, columns=[*TASK_COLUMNS, *extra])
        return datasets.Dataset.from_list([make(row, i + 1) for i, row in enumerate(rows)], features)
    if _is_file(src.source):
        rows = _read_file(Path(src.source), src)
        return datasets.Dataset.from_list([make(row, number) for number, row in rows], features)
    # A Hugging Face dataset id (or a local dataset directory): rows are checked as they are mapped, so a
    # large dataset is never held in memory as Python objects.
    try:
        ds = datasets.load_dataset(src.source, src.subset, split=src.split)
    except Exception as e:  # datasets raises many kinds; the cause is kept
        raise DataError(f"{label}: cannot load dataset: {type(e).__name__}: {e}") from e
    if src.limit is not None:
        ds = ds.select(range(min(src.limit, len(ds))))
    return ds.map(_with_row_number, fn_kwargs={"make": make}, with_indices=True, remove_columns=ds.column_names,
                  features=features, desc=f"Checking {label}")


def _generated(src: DataSource) -> list[dict]:
    """The rows of a generator source, the first `limit` of them."""
    g = src.generator
    if g.task == "arithmetic":
        return generate(g.num_examples, g.levels, g.seed, src.split, g.in_head_probability)[:src.limit]
    try:
        # Rows come one after another from one seeded stream: the first `limit` are the same either way.
        count = g.num_examples if src.limit is None else min(g.num_examples, src.limit)
        rows = generate_task(g.task, count, g.seed, src.split, g.options)
    except ValueError as e:
        raise DataError(f"{_label(src)}: {e}") from None
    if is_code_sequence(src):
        for row in rows:
            row["sequence"] = code_text(row["problem"])
    return rows


def _with_task_columns(row: dict, number: int, make, columns: list[str]) -> dict:
    return {**make(row, number), **{k: row[k] for k in columns}}


def _with_row_number(row: dict, index: int, make) -> dict:
    return make(row, index + 1)


def _sft_row(row: dict, number: int, src: DataSource, label: str) -> dict:
    where = f"{label}: row {number}"
    if src.messages_field is not None:
        messages = _messages(row, src.messages_field, where)
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise DataError(f"{where}: {src.messages_field}: expected turns ending with an assistant turn, "
                            f"got roles {[m['role'] for m in messages]}")
        return {"prompt": messages[:-1], "completion": messages[-1:]}
    completion = row.get(src.completion_field)
    if isinstance(completion, list):
        completion = _messages(row, src.completion_field, where)
    else:
        completion = [{"role": "assistant", "content": _text(row, src.completion_field, where)}]
    return {"prompt": _prompt(row, src.prompt_field, where), "completion": completion}


def _rl_row(row: dict, number: int, src: DataSource, label: str) -> dict:
    where = f"{label}: row {number}"
    answer = row.get(src.answer_field)
    # Integer answers (AIME sets often store them as numbers) are exact as text; floats and the rest are not.
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    else:
        answer = _text(row, src.answer_field, where)
    row_id = row.get(src.id_field)
    if row_id is None:
        row_id = f"{source_name(src)}-{number}"
    elif isinstance(row_id, int | str) and not isinstance(row_id, bool):
        row_id = str(row_id)
    else:
        raise DataError(f"{where}: {src.id_field}: expected a string or integer, got {describe(row_id)}")
    return {"prompt": _prompt(row, src.prompt_field, where), "answer": answer.strip(), "id": row_id}


def _prompt(row: dict, field: str, where: str) -> list[dict]:
    if isinstance(row.get(field), list):
        return _messages(row, field, where)
    return build_prompt(_text(row, field, where))


def _text(row: dict, field: str, where: str) -> str:
    if row.get(field) is None:
        raise DataError(f"{where}: {field}: missing (row has {', '.join(map(str, row)) or 'no fields'})")
    value = row[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: {field}: expected a string, got {describe(value)}")
    if not value.strip():
        raise DataError(f"{where}: {field}: empty")
    return value


def _messages(row: dict, field: str, where: str) -> list[dict]:
    value = row.get(field)
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {field}: expected a non-empty list of chat messages, got {describe(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {field}[{i}]: expected {{role: {'|'.join(ROLES)}, content: str}}, "
                            f"got {describe(m)}")
        if not m["content"].strip():
            raise DataError(f"{where}: {field}[{i}].content: empty")
    # Only role and content: extra keys (tool calls, metadata) would turn into ragged Arrow columns.
    return [{"role": m["role"], "content": m["content"]} for m in value]


# ---------------------------------------------------------------------------------------------------- files

def _is_file(source: str) -> bool:
    return source.endswith((".jsonl", ".parquet"))


def _label(src: DataSource) -> str:
    if src.source == "generator":
        task = src.generator.task
        return f"generator[{src.split}]" if task == "arithmetic" else f"generator {task}[{src.split}]"
    if _is_file(src.source):
        return src.source
    return src.source + (f"[{src.subset}]" if src.subset else "") + f" (split {src.split})"


def _read_file(path: Path, src: DataSource):
    """(row number, row) pairs of a local file, the first `src.limit` rows. JSONL rows are numbered by line."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".parquet":
        rows = pq.read_table(path).to_pylist()
        return list(enumerate(rows, start=1))[:src.limit]
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if src.limit is not None and len(rows) >= src.limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: row {number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: row {number}: invalid JSON: {e.msg} at column {e.colno}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {number}: expected a JSON object, got {describe(row)}")
            rows.append((number, row))
    return rows
