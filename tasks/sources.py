"""Where a dataset comes from (`DataSource`, the `data` entries of a run config) and the named benchmarks, part of
the task layer so that loading data needs nothing from the pipeline; `pipeline.config` validates these
dataclasses as part of a run's config."""
import difflib
from dataclasses import dataclass, field
from typing import Any

from tasks import retrieval


@dataclass(frozen=True, kw_only=True)
class GeneratorSettings:
    num_examples: int = 2000
    levels: list[int] = field(default_factory=lambda: [1, 2])  # difficulty levels, mixed uniformly
    seed: int = 0
    in_head_probability: float = 0.0  # chance the teacher writes a multi-digit sum in one line, no columns
    task: str = "arithmetic"  # or a recall task of tasks.retrieval: mqar, niah_word, s_niah
    options: dict[str, Any] = field(default_factory=dict)  # the recall task's options (docs/retrieval.md)


@dataclass(frozen=True, kw_only=True)
class DataSource:
    # "generator", a Hugging Face dataset id, or local data: a .json/.jsonl/.csv/.parquet/.arrow file (also
    # compressed: .jsonl.gz, ...), a glob of them, a folder of shards, or a folder written by `save_to_disk`
    source: str = "generator"
    name: str | None = None  # label in metrics and reports; None: derived from source
    split: str = "train"
    subset: str | None = None  # Hugging Face config name
    limit: int | None = None  # first N rows
    generator: GeneratorSettings = field(default_factory=GeneratorSettings)
    # column mapping
    prompt_field: str = "problem"
    answer_field: str = "answer"
    completion_field: str = "solution"  # SFT target when messages_field is unset
    messages_field: str | None = None  # SFT: a chat column whose last turn is the assistant's answer
    id_field: str = "id"  # rows without it get "<name>-<row>"
    # SFT from several candidate traces per row (OpenR1-Math: `generations` with `correctness_math_verify`): the
    # completion is the first candidate whose entry in `selection_field` is true (the first candidate when
    # `selection_field` is unset); rows without one are skipped and counted in the log.
    candidates_field: str | None = None
    selection_field: str | None = None


# Evaluation sets by name: the one registry of `data.eval` entries and `sse-rl eval --datasets`
# (tasks.loaders.benchmark_source resolves a name, a file or a Hugging Face id).
BENCHMARKS = {
    "math500": DataSource(source="HuggingFaceH4/MATH-500", name="math500", split="test", id_field="unique_id"),
    "aime24": DataSource(source="HuggingFaceH4/aime_2024", name="aime24", split="train"),
    "aime25": DataSource(source="math-ai/aime25", name="aime25", split="test"),
    "amc23": DataSource(source="math-ai/amc23", name="amc23", split="test", prompt_field="question"),
    # Recall tasks (docs/retrieval.md): mqar_test, niah_word_4k, niah_word_noinst_4k, s_niah_uuid_8k, ...
    **{name: DataSource(source="generator", name=name, split="test",
                        generator=GeneratorSettings(task=task, num_examples=rows, options=options))
       for name, (task, rows, options) in retrieval.BENCHMARKS.items()},
}


def describe(value) -> str:
    """Type and (shortened) repr of a value, for error messages."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def did_you_mean(word: str, choices: list[str], show_all: bool = False) -> str:
    """` (did you mean 'x'?)` for the closest of `choices`, else ` (valid: ...)` with `show_all`, else ''."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (valid: {', '.join(choices)})" if show_all else ""
