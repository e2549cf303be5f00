"""The benchmark suite's own machinery (bench/README.md): the operator registry run on the CPU, the A/B against
another git revision in a worktree, the baselines and the files generated from them."""
import json
import subprocess
from pathlib import Path

import pytest

from bench import baseline, op, report, train_step

REPO = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--lengths", "16", "40", "--heads", "2", "--dim", "8", "--partitions", "2"]


def test_generated_docs_are_what_the_committed_baselines_give():
    """docs/performance.md, docs/cost.md and README.md's table are `python -m bench.report`'s output: this fails
    when a baseline changed and the report was not run again (or one of them was edited by hand)."""
    baselines = baseline.load_baselines()
    assert (REPO / "docs" / "performance.md").read_text() == report.performance(baselines)
    readme = (REPO / "README.md").read_text()
    assert report.with_block(readme, report.readme_block(baselines)) == readme
    assert report.main(["--check"]) == 0
    for name, _ in report.README_ROWS:  # every README row links to its baseline
        assert f"(bench/results/{name}.json)" in readme


def test_every_baseline_says_where_and_how_it_was_measured():
    for name, b in baseline.load_baselines().items():
        assert {"device", "date", "commit", "command", "title", "rows"} <= set(b), name
        assert b["command"].startswith("python -m bench.") and "--baseline" not in b["command"], name
        report.benchmark(name)  # belongs to a benchmark's section
    changed = {**baseline.load_baselines()}
    changed["train_step_8k"] = dict(changed["train_step_8k"], headline={"label": "x", "value": 9.0})
    assert "| x | 9.00x |" in report.readme_block(changed)
    with pytest.raises(ValueError, match="needs one"):
        report.with_block("# no markers\n", report.readme_block(changed))


def test_write_baseline_keeps_one_file_per_configuration(tmp_path, monkeypatch):
    monkeypatch.setattr(baseline, "RESULTS", tmp_path)
    for value in (1.0, 2.0):
        baseline.write_baseline("op_x", device="D", title="t", rows=[{"T": 1, "ms": value}], command="c")
    assert [p.name for p in tmp_path.iterdir()] == ["op_x.json"]
    assert json.loads((tmp_path / "op_x.json").read_text())["rows"] == [{"T": 1, "ms": 2.0}]
    with pytest.raises(ValueError, match="same keys"):
        baseline.write_baseline("op_x", device="D", title="t", rows=[{"T": 1}, {"N": 2}], command="c")
    assert baseline.command("bench.op", ["--baseline", "--lengths", "1"]) == "python -m bench.op --lengths 1"


def test_registry_times_the_cpu_paths_and_skips_what_cannot_run(tmp_path):
    out = tmp_path / "run.json"
    op.main([*TINY, "--ops", "sse_chunk_torch_varlen", "sse_reference", "sse_triton_indexed", "sdpa",
             "--against", "sdpa", "--out", str(out)])
    rows = json.loads(out.read_text())["training"]
    assert [r["T"] for r in rows] == [16, 40]
    assert all(r["sse_chunk_torch_varlen ms"] > 0 and r["sdpa ms"] > 0 for r in rows)
    assert rows[0]["sse_triton_indexed ms"] is None  # CUDA only
    assert rows[0]["sse_reference ms"] > 0 and rows[1]["sse_reference / sdpa"] > 0
    assert rows[0]["sse_chunk_torch_varlen / sdpa"] == rows[0]["sse_chunk_torch_varlen ms"] / rows[0]["sdpa ms"]


def test_without_drops_options_and_their_values():
    argv = ["--base", "HEAD~1", "--lengths", "16", "--out=x", "--baseline", "--base=main", "--against", "sdpa"]
    assert op.without(argv, "--base", "--out", "--baseline") == ["--lengths", "16", "--against", "sdpa"]


def test_base_runs_the_same_benchmark_on_another_revision_in_a_worktree(tmp_path, capsys):
    """`--base REV`: REV's library in a temporary worktree with this checkout's bench/, then this checkout; both
    side by side. The worktree is gone afterwards."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    out = tmp_path / "ab.json"
    op.main(["--device", "cpu", "--lengths", "16", "--heads", "2", "--dim", "8", "--ops", "sse_chunk_torch_varlen",
             "--against", "sse_chunk_torch_varlen", "--base", head.strip(), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["base"] == head.strip()
    assert saved["base_result"]["training"][0]["T"] == saved["this"]["training"][0]["T"] == 16
    table = capsys.readouterr().out
    assert "| training | T = 16 | sse_chunk_torch_varlen ms |" in table
    worktrees = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    assert "bench-base-" not in worktrees


def test_train_step_baselines_one_per_length():
    rounds = {"tokens_per_s": 100.0, "peak_gib": None, "rounds": [100, 100]}
    rows = [dict(T=8192, packed=p, checkpointing=c, **{"SSE-H": rounds, "Qwen3-flex": None},
                 paired=[1.0, 1.1, 1.3] if not p else None) for p in (False, True) for c in (False, True)]
    found = train_step.baselines(dict(rows=rows, device="D", date="2026-12-01T00:00", compiled=False,
                                      shape=train_step.SHAPE))
    (name, b), = found.items()
    assert name == "train_step_8k" and b["headline"]["value"] == 1.1 and b["date"] == "2026-12-01"
    assert b["rows"][0] == {"packed rows": "no", "checkpointing": "off", "SSE-H tokens/s": 100,
                            "Qwen3-flex tokens/s": None, "SSE-H / fastest Qwen3": 1.1}
