"""An evaluation's work split over engines, and the files each engine's share is kept in.

The work is a dataset's problems x samples. Sample j of a problem is drawn with seed `problem seed + j` (vLLM
seeds the j-th copy of a request with `seed + j`), so samples [a, b) of a problem are one request with n = b - a
and seed `problem seed + a`, on any engine, and give what one request for all n samples gives: the merged samples
do not depend on how the work was split, nor on how often it was restarted.

Each engine appends its records (samples, and the problems it skipped) to its own shard file,
`shards/<dataset>.<engine>.jsonl`, after every generate call. A restarted evaluation reads every shard file and
plans only the samples missing from all of them; the finished evaluation merges them into
`<dataset>.samples.jsonl` in problem order, then sample order, and removes the shard files.
"""
import json
import os
from pathlib import Path

from tasks.files import write_atomic

SHARDS = "shards"


def split_work(missing: list[tuple[str, dict, list[int]]], engines: int) -> list[list[dict]]:
    """Per engine, its slices {"dataset", "row", "start", "stop"} of `missing` (per problem, in order: its dataset,
    its row and the sample indices still to draw). A problem's missing samples are cut into min(engines, their
    number) near-equal blocks, and the blocks of all problems are dealt to the engines in turn: with n >= engines
    every engine draws the same share of every problem, which balances the engines whatever the problems' lengths."""
    shares: list[list[dict]] = [[] for _ in range(engines)]
    turn = 0
    for dataset, row, samples in missing:
        blocks = min(engines, len(samples))
        for b in range(blocks):
            block = samples[b * len(samples) // blocks:(b + 1) * len(samples) // blocks]
            shares[turn % engines] += [{"dataset": dataset, "row": row, "start": start, "stop": stop}
                                       for start, stop in runs(block)]
            turn += 1
    return shares


def runs(samples: list[int]) -> list[tuple[int, int]]:
    """Sorted sample indices as [start, stop) runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for j in samples:
        if out and out[-1][1] == j:
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out


def file_stem(name: str) -> str:
    return name.replace("/", "__")  # a Hugging Face id has a slash


def shard_path(out_dir: str | Path, name: str, engine: int) -> Path:
    return Path(out_dir) / SHARDS / f"{file_stem(name)}.{engine}.jsonl"


def shard_files(out_dir: str | Path, name: str) -> list[Path]:
    return sorted((Path(out_dir) / SHARDS).glob(f"{file_stem(name)}.*.jsonl"))


def read_records(path: Path, repair: bool = False) -> list[dict]:
    """The records of a samples or shard file. A line cut short by a kill is left out, and with `repair` the file
    is rewritten without it, so that an engine can append to it again."""
    if not path.exists():
        return []
    records, unreadable = [], 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if "id" not in record or ("sample" not in record and "skipped" not in record):
                raise ValueError(line)
            records.append(record)
        except ValueError:
            unreadable += 1
    if unreadable and repair:
        write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return records


def append_records(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def remove_shards(out_dir: str | Path, name: str) -> None:
    """A dataset's shard files, once merged; the shards folder too when nothing else is left in it."""
    for path in shard_files(out_dir, name):
        path.unlink()
    folder = Path(out_dir) / SHARDS
    if folder.is_dir() and not any(folder.glob("*.jsonl")):
        for leftover in folder.iterdir():  # the engines' plans, logs and progress files
            leftover.unlink()
        folder.rmdir()
