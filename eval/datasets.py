"""Evaluation sets by name or path, loaded by the pipeline's loaders: rows {prompt (chat messages), answer, id}.

Names resolve to Hugging Face dataset ids (the real path, through `datasets.load_dataset`); a `.jsonl` or
`.parquet` path is read locally; any other string with a `/` (or a local directory) is a Hugging Face id or
dataset directory, split "test". A malformed row raises DataError naming the file, row and field.
"""
import dataclasses
from pathlib import Path

import datasets

from pipeline.config import EVAL_PRESETS, DataSource
from pipeline.data.loaders import load_rl_dataset, source_name

# The pipeline's presets (math500, aime24, aime25) plus amc23, which they do not list.
BENCHMARKS = {
    **EVAL_PRESETS,
    "amc23": DataSource(source="math-ai/amc23", name="amc23", split="test", prompt_field="question"),
}


def benchmark_source(spec: str | DataSource, limit: int | None = None) -> DataSource:
    """The DataSource of a benchmark name, a local .jsonl/.parquet file, or a Hugging Face id / directory (or a
    config's DataSource, as is)."""
    if isinstance(spec, DataSource):
        src = spec
    elif spec in BENCHMARKS:
        src = BENCHMARKS[spec]
    elif spec.endswith((".jsonl", ".parquet")) or "/" in spec or Path(spec).is_dir():
        src = DataSource(source=spec, split="test")
    else:
        raise ValueError(f"unknown benchmark {spec!r}: use one of {', '.join(sorted(BENCHMARKS))}, a .jsonl or "
                         ".parquet file, or a Hugging Face dataset id")
    return dataclasses.replace(src, limit=limit)


def load_benchmark(spec: str | DataSource, limit: int | None = None) -> tuple[str, datasets.Dataset]:
    """(name for reports, rows) of a benchmark; `limit` keeps the first rows only."""
    src = benchmark_source(spec, limit)
    return source_name(src), load_rl_dataset(src)
