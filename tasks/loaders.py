"""Datasets for the stages and for `sse-rl eval`, from the generator, local data (a .json/.jsonl/.csv/.parquet/.arrow
file, compressed or not, a glob of them, a folder of shards or a `save_to_disk` folder), a Hugging Face dataset id,
or a benchmark name (`tasks.sources.BENCHMARKS`).

Every source is normalised to TRL's conversational formats:
  SFT:       {"prompt": [messages], "completion": [assistant message]}   (loss on the completion)
  RL, eval:  {"prompt": [messages], "answer": str, "id": str}            (rewards read `answer`)
A text prompt becomes one user message in the shared prompt template (`tasks.prompts`); a prompt that
is already a list of chat messages gets the same template (`tasks.prompts.instruct`). The exception is MQAR in
Zoology's format (`options.format: zoology`): no prompt and no chat template, one sequence of codes per row
(SFT: `text`, tokenized by `tokenize_codes` with labels on the answer slots only; eval: a `sequence` column,
scored teacher-forced).
A malformed row raises DataError naming the source, the row (the line number for JSONL) and the field.

Rows are never held as Python lists: a JSONL file is read line by line into an Arrow cache (`datasets`), every
other source is `datasets`' memory-mapped Arrow, checked and converted row by row. `preview` reads only a
source's first rows (streamed), for the checks before a run.

This package is the task layer: the stages and `eval/` import it, it imports neither.
"""
import bz2
import dataclasses
import functools
import glob
import gzip
import itertools
import json
import logging
import lzma
from pathlib import Path

import datasets
from datasets.fingerprint import Hasher

from tasks.generator import generate
from tasks.prompts import build_prompt, instruct, prompt_token_ids
from tasks.retrieval import TASK_COLUMNS, answer_labels, generate_task
from tasks.sources import BENCHMARKS, DataSource, describe, did_you_mean

logger = logging.getLogger(__name__)

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


def preview(src: DataSource, kind: str, rows: int = 4) -> list[dict]:
    """The first `rows` rows of `src` as `load_sft_dataset` (kind "sft") or `load_rl_dataset` ("rl") gives them,
    reading only those rows: a missing file, a missing column or a malformed row raises DataError in seconds."""
    if src.source == "generator":
        load = load_sft_dataset if kind == "sft" else load_rl_dataset
        return load(dataclasses.replace(src, limit=min(rows, src.limit or rows))).to_list()
    make = functools.partial(_sft_row if kind == "sft" else _rl_row, src=src, label=_label(src))
    first = itertools.islice(_numbered_rows(src, streaming=True), rows)
    return [made for number, row in first if (made := make(row, number)) is not None]


def benchmark_source(spec: str | DataSource, limit: int | None = None) -> DataSource:
    """The DataSource of a benchmark name, a local .jsonl/.parquet file, or a Hugging Face id / dataset directory
    (split "test"); a config's DataSource as is. `limit` keeps the first rows only."""
    if isinstance(spec, DataSource):
        src = spec
    elif spec in BENCHMARKS:
        src = BENCHMARKS[spec]
    elif _local(spec) or "/" in spec:
        src = DataSource(source=spec, split="test")
    else:
        raise ValueError(f"unknown benchmark {spec!r}{did_you_mean(spec, list(BENCHMARKS))}: use one of "
                         f"{', '.join(sorted(BENCHMARKS))}, a local data file or folder, or a Hugging Face dataset id")
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
    local = _local(src.source)
    if local in ("file", "lines"):
        return _strip_format(Path(src.source).name)
    return Path(src.source).name if local else src.source


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
    if _local(src.source) == "lines":
        # Read here rather than by `datasets` for the messages: rows numbered by line, bad bytes and bad JSON named.
        # The fingerprint names the file's version, so an edited file is read again.
        path = _existing(Path(src.source))
        stat = path.stat()
        key = [str(path.resolve()), stat.st_size, stat.st_mtime_ns, src, make_row.__name__, features]
        try:
            ds = datasets.Dataset.from_generator(_made_lines, features=features, gen_kwargs={"src": src, "make": make},
                                                 fingerprint=Hasher.hash(key))
        except datasets.exceptions.DatasetGenerationError as e:
            raise (e.__cause__ if isinstance(e.__cause__, DataError) else e) from None
    else:
        raw = _open(src, streaming=False)
        if src.limit is not None:
            raw = raw.select(range(min(src.limit, len(raw))))
        ds = raw.map(_made_batch, fn_kwargs={"make": make, "columns": list(features)}, batched=True,
                     with_indices=True, remove_columns=raw.column_names, features=features, desc=f"Checking {label}")
    if src.candidates_field is not None:
        logger.warning("%s: %d rows have a %s trace marked true in %s; the other rows are skipped", label, len(ds),
                       src.candidates_field, src.selection_field)
    return ds


def _made_lines(src: DataSource, make):
    for number, row in _json_lines(Path(src.source), src.limit):
        made = make(row, number)
        if made is not None:
            yield made


def _made_batch(batch: dict, indices: list[int], make, columns: list[str]) -> dict:
    """A batch of rows checked and converted; a row `make` skips (None) is left out."""
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    made = [m for i, row in zip(indices, rows) if (m := make(row, i + 1)) is not None]
    return {c: [m[c] for m in made] for c in columns}


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


def _sft_row(row: dict, number: int, src: DataSource, label: str) -> dict:
    where = f"{label}: row {number}"
    if src.candidates_field is not None:
        trace = _chosen_candidate(row, src, where)
        if trace is None:
            return None
        return {"prompt": _prompt(row, src.prompt_field, where),
                "completion": [{"role": "assistant", "content": trace}]}
    if src.messages_field is not None:
        messages = _messages(row, src.messages_field, where)
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise DataError(f"{where}: {src.messages_field}: expected turns ending with an assistant turn, "
                            f"got roles {[m['role'] for m in messages]}")
        return {"prompt": instruct(messages[:-1]), "completion": messages[-1:]}
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


def _chosen_candidate(row: dict, src: DataSource, where: str) -> str | None:
    """The first candidate trace marked true in `selection_field` (the first one without it); None: none is."""
    field, marks_field = src.candidates_field, src.selection_field
    candidates = row.get(field)
    if candidates is None:
        raise _missing(row, field, where)
    if not isinstance(candidates, list) or not candidates:
        raise DataError(f"{where}: {field}: expected a non-empty list of traces, got {describe(candidates)}")
    chosen = 0
    if marks_field is not None:
        marks = row.get(marks_field)
        if marks is None:
            raise _missing(row, marks_field, where)
        if not isinstance(marks, list) or len(marks) != len(candidates):
            raise DataError(f"{where}: {marks_field}: expected a list of {len(candidates)} true/false marks, one per "
                            f"{field} entry, got {describe(marks)}")
        chosen = next((i for i, mark in enumerate(marks) if mark is True), None)
        if chosen is None:
            return None
    trace = candidates[chosen]
    if not isinstance(trace, str) or not trace.strip():
        raise DataError(f"{where}: {field}[{chosen}]: expected a non-empty string, got {describe(trace)}")
    return trace


def _prompt(row: dict, field: str, where: str) -> list[dict]:
    if isinstance(row.get(field), list):
        return instruct(_messages(row, field, where))
    return build_prompt(_text(row, field, where))


def _missing(row: dict, field: str, where: str) -> DataError:
    keys = [str(k) for k in row]
    return DataError(f"{where}: {field}: missing{did_you_mean(field, [k for k in keys if k != field])} "
                     f"(row has {', '.join(keys) or 'no fields'})")


def _text(row: dict, field: str, where: str) -> str:
    if row.get(field) is None:
        raise _missing(row, field, where)
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

FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}  # builders
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # what `datasets` also decompresses


def _strip_format(name: str) -> str:
    """`rows.jsonl.gz` -> `rows`."""
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    return next((name.removesuffix(ext) for ext in FORMATS if name.endswith(ext)), name)


def _format(name: str) -> str | None:
    """The data format of a file name or glob (`.jsonl`, `.csv`, ...; compression aside), None for another name."""
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    return next((ext for ext in FORMATS if name.endswith(ext)), None)


def _local(source: str) -> str | None:
    """What kind of local data `source` is: "lines" (one JSONL file, read here), "file" (one file of another
    format), "glob", "saved" (a `save_to_disk` folder), "folder" (of data files); None: a Hugging Face id."""
    path = Path(source)
    if path.is_dir():
        return "saved" if (path / "state.json").exists() or (path / "dataset_dict.json").exists() else "folder"
    if any(c in source for c in "*?["):
        return "glob"
    fmt = _format(source)
    # A data file's name, or a path into a local folder (a misspelled file there is named as missing).
    if fmt is None and not (path.is_absolute() or str(path.parent) != "." and path.parent.is_dir()):
        return None
    return "lines" if fmt == ".jsonl" else "file"


def _label(src: DataSource) -> str:
    if src.source == "generator":
        task = src.generator.task
        return f"generator[{src.split}]" if task == "arithmetic" else f"generator {task}[{src.split}]"
    if _local(src.source) in ("lines", "file", "glob", "saved"):
        return src.source
    return src.source + (f"[{src.subset}]" if src.subset else "") + f" (split {src.split})"


def _numbered_rows(src: DataSource, streaming: bool):
    """(row number, row) of a source that is not the generator."""
    if _local(src.source) == "lines":
        return _json_lines(Path(src.source), src.limit)
    return enumerate(itertools.islice(_open(src, streaming), src.limit), start=1)


def _open(src: DataSource, streaming: bool) -> datasets.Dataset | datasets.IterableDataset:
    """The raw rows of local data of any format `datasets` reads, or of a Hugging Face dataset; `streaming`: an
    iterable that reads only as far as it is read."""
    label, kind = _label(src), _local(src.source)
    if kind == "file":
        _existing(Path(src.source))
    if kind == "glob" and not glob.glob(src.source, recursive=True):
        raise DataError(f"{src.source}: no file matches")
    if kind in ("file", "glob") and _format(src.source) is None:
        raise DataError(f"{src.source}: not a data file name: end it with {', '.join(FORMATS)} (also compressed: "
                        f"{', '.join(COMPRESSED)})")
    try:
        if kind == "saved":
            ds = datasets.load_from_disk(src.source)
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise DataError(f"{label}: no split {src.split!r}{did_you_mean(src.split, list(ds), True)}")
                ds = ds[src.split]
            return ds.to_iterable_dataset() if streaming else ds
        if kind in ("file", "glob"):
            return datasets.load_dataset(FORMATS[_format(src.source)], data_files=src.source, split="train",
                                         streaming=streaming)
        return datasets.load_dataset(src.source, src.subset, split=src.split, streaming=streaming)
    except DataError:
        raise
    except Exception as e:  # datasets raises many kinds; the cause is kept
        raise DataError(f"{label}: cannot load dataset: {type(e).__name__}: {e}") from e


def _existing(path: Path) -> Path:
    if not path.is_file():
        siblings = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() else []
        raise DataError(f"{path}: no such file{did_you_mean(path.name, siblings)}")
    return path


def _json_lines(path: Path, limit: int | None):
    """(line number, row) of a JSON Lines file (compressed or not), the first `limit` rows, read line by line."""
    opener = next((o for suffix, o in COMPRESSED.items() if path.name.endswith(suffix)), open)
    count = 0
    with opener(_existing(path), "rb") as f:
        for number, raw in enumerate(f, start=1):
            if limit is not None and count >= limit:
                return
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
            count += 1
            yield number, row
