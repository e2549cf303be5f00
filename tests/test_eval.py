"""Evaluation without vLLM: metrics against hand-worked cases, benchmark loading (real files, the Hugging Face
path offline, malformed rows), and the runner's output and resume logic with a stand-in engine."""
import json
from math import comb
from types import SimpleNamespace

import datasets
import pytest
from vllm.exceptions import VLLMValidationError

from conftest import shared_data_file
from eval.metrics import bootstrap_ci, compute_metrics, length_edges, majority_score, paired_change, pass_at_k
from eval.runner import evaluate, problem_seed
from pipeline import config
from pipeline.config import DataSource
from tasks.loaders import DataError, benchmark_source, load_benchmark
from tasks.tokenizer import train_tokenizer

# ---------------------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25),
    (4, 0, 4, 0.0),
    (4, 1, 4, 1.0),
    (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
    (16, 2, 4, 1 - 1001 / 1820),  # 1 - C(14,4)/C(16,4)
    (32, 5, 16, 1 - comb(27, 16) / comb(32, 16)),
    (32, 32, 1, 1.0),
])
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_score():
    assert majority_score(["2", "2", "3", None], [True, True, False, False]) == 1.0
    assert majority_score(["3", "3", "2", "4"], [False, False, True, False]) == 0.0
    assert majority_score([None, None], [False, False]) == 0.0
    assert majority_score(["2", "3"], [True, False]) == 0.5  # a tie: the expected score of a random break
    assert majority_score(["2", "3", "4"], [True, False, False]) == pytest.approx(1 / 3)
    # All correct answers are one group, whatever their text.
    assert majority_score(["1/2", "0.5", "7", None], [True, True, False, False]) == 1.0
    # Wrong answers that are equivalent pool their votes when an equivalence is given.
    answers, correct = ["1", "1", "\\frac{1}{2}", "0.5"], [True, True, False, False]
    assert majority_score(answers, correct) == 1.0

    def half(a, b):
        return {a, b} <= {"\\frac{1}{2}", "0.5"}

    assert majority_score(answers, correct, half) == 0.5
    assert majority_score(["0.5", "\\frac{1}{2}", "0.5", "1"], [False, False, False, True], half) == 0.0


def test_bootstrap_ci():
    assert bootstrap_ci([0.5] * 10) == (0.5, 0.5)
    low, high = bootstrap_ci([0.0, 1.0] * 50)
    assert 0.38 < low < 0.5 < high < 0.62  # mean 0.5, standard error 0.05
    assert bootstrap_ci([0.0, 1.0] * 50) == (low, high)  # seeded


def test_paired_change():
    """Pairing removes problem difficulty: a model better by 0.25 on every one of 100 problems of very different
    difficulty has a change of exactly 0.25 with no spread, which unpaired intervals could not show."""
    before = [0.0, 0.25, 0.5, 0.75] * 25
    assert paired_change(before, [b + 0.25 for b in before]) == {"change": 0.25, "change_ci95": [0.25, 0.25]}
    mixed = paired_change(before, [b + (0.25 if i % 2 else -0.25) for i, b in enumerate(before)])
    low, high = mixed["change_ci95"]
    assert mixed["change"] == 0.0 and -0.06 < low < 0 < high < 0.06  # mean 0, standard error 0.025
    with pytest.raises(ValueError, match="the same problems, got 3 and 2"):
        paired_change([0, 1, 1], [0, 1])


def test_compute_metrics_hand_worked():
    def s(correct, extracted, tokens, truncated=False):
        return {"correct": correct, "extracted": extracted, "num_tokens": tokens, "truncated": truncated}

    problems = [
        [s(True, "5", 1), s(False, "6", 3), s(False, "6", 16, True), s(False, None, 16, True)],
        [s(True, "7", 2), s(True, "7", 5), s(True, "7", 9), s(True, "7.0", 12)],
    ]
    m = compute_metrics(problems, max_tokens=16)
    assert m["num_problems"] == 2 and m["n"] == 4
    assert m["avg@4"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["pass@1"] == pytest.approx(0.625)
    assert m["pass@4"] == 1.0
    assert "pass@16" not in m  # k > n is skipped
    assert m["maj@4"] == 0.5  # problem 1: "6" outvotes the correct "5"; problem 2: all correct
    assert m["mean_length"] == pytest.approx((1 + 3 + 16 + 16 + 2 + 5 + 9 + 12) / 8)
    assert m["max_length"] == 16
    assert m["truncation_rate"] == 0.25
    assert m["no_answer_rate"] == 0.125
    assert length_edges(16) == [0, 2, 4, 8, 16]
    assert m["accuracy_by_length"] == [
        {"tokens": "[0, 2)", "count": 1, "accuracy": 1.0},
        {"tokens": "[2, 4)", "count": 2, "accuracy": 0.5},
        {"tokens": "[4, 8)", "count": 1, "accuracy": 1.0},
        {"tokens": "[8, 16]", "count": 4, "accuracy": 0.5},
    ]
    lo, hi = m["avg@4_ci95"]
    assert lo <= m["avg@4"] <= hi
    with pytest.raises(ValueError, match="same number of samples"):
        compute_metrics([problems[0], problems[1][:3]], max_tokens=16)


# ---------------------------------------------------------------------------------------------------- datasets

@pytest.mark.parametrize("name, rows", [("aime24", 30), ("aime25", 30), ("math500", 500)])
def test_load_shared_benchmark_files(name, rows):
    label, ds = load_benchmark(str(shared_data_file(f"{name}.jsonl")))
    assert label == name and len(ds) == rows
    assert len(set(ds["id"])) == rows and all(a.strip() for a in ds["answer"])
    prompt = ds[0]["prompt"]
    assert prompt[-1]["role"] == "user" and "\\boxed{}" in prompt[-1]["content"]
    assert load_benchmark(str(shared_data_file(f"{name}.jsonl")), limit=3)[1]["id"] == ds["id"][:3]


def test_benchmark_names_resolve_to_hugging_face_ids():
    assert (benchmark_source("math500").source, benchmark_source("math500").split) == ("HuggingFaceH4/MATH-500",
                                                                                      "test")
    assert benchmark_source("math500").id_field == "unique_id"
    assert benchmark_source("aime24").source == "HuggingFaceH4/aime_2024"
    assert benchmark_source("aime25").source == "math-ai/aime25"
    assert benchmark_source("amc23").source == "math-ai/amc23"
    assert benchmark_source("org/some-set").source == "org/some-set"
    with pytest.raises(ValueError, match="unknown benchmark 'aime2024'"):
        benchmark_source("aime2024")


def test_one_benchmark_registry_for_configs_and_sse_rl_eval(tmp_path):
    """Every benchmark `sse-rl eval --datasets` knows is also a valid `data.eval` entry (amc23 was not)."""
    path = tmp_path / "c.yaml"
    path.write_text("name: t\nmodel: {tokenizer: {train: true}}\n")
    cfg = config.load_config(path, [f"data.eval=[{', '.join(config.BENCHMARKS)}]"])
    assert [benchmark_source(name).source for name in cfg.data.eval] == [
        s.source for s in config.BENCHMARKS.values()]
    assert "amc23" in cfg.data.eval


def test_the_task_layer_imports_neither_eval_nor_the_pipeline():
    import subprocess
    import sys

    code = ("import sys, tasks.files, tasks.loaders, tasks.prompts, tasks.retrieval, tasks.sources; "
            "print([m for m in sys.modules if m.split('.')[0] in ('eval', 'pipeline')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sse_rl_eval_engine_options_are_the_eval_vllm_settings():
    """`sse-rl eval`'s engine options build the eval stage's settings class, with its defaults."""
    from eval.cli import _parser, engine_settings
    from eval.engine import EvalEngineSettings

    required = ["--model", "m", "--out", "o"]
    assert engine_settings(_parser().parse_args(required)) == EvalEngineSettings()
    args = _parser().parse_args(required + [
        "--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.5",
        "--kv-cache-gib", "3", "--tensor-parallel-size", "2", "--enforce-eager", "--state-dtype", "float32"])
    assert engine_settings(args) == EvalEngineSettings(
        dtype="bfloat16", max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.5, kv_cache_gib=3,
        tensor_parallel_size=2, enforce_eager=True, state_dtype="float32")


def test_hugging_face_path_offline(tmp_path, monkeypatch):
    """A preset goes through datasets.load_dataset; here it points at a local dataset directory laid out like
    the Hub's MATH-500 (parquet under data/), so the same path runs without a download."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    datasets.Dataset.from_list([
        {"problem": "What is $1+1$?", "solution": "...", "answer": "2", "unique_id": "test/a/1.json"},
        {"problem": "What is $2+2$?", "solution": "...", "answer": "4", "unique_id": "test/a/2.json"},
    ]).to_parquet(str(tmp_path / "data" / "test-00000-of-00001.parquet"))
    local = DataSource(source=str(tmp_path), name="math500", split="test", id_field="unique_id")
    monkeypatch.setitem(config.BENCHMARKS, "math500", local)
    name, ds = load_benchmark("math500")
    assert name == "math500"
    assert ds["id"] == ["test/a/1.json", "test/a/2.json"] and ds["answer"] == ["2", "4"]


def test_malformed_rows_name_file_row_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "a", "problem": "p", "answer": "1"}) + "\n"
                    + json.dumps({"id": "b", "problem": "p"}) + "\n")
    with pytest.raises(DataError, match=rf"{path}: row 2: answer: missing"):
        load_benchmark(str(path))
    path.write_text(json.dumps({"id": "a", "problem": "p", "answer": "1"}) + "\n{not json\n")
    with pytest.raises(DataError, match=rf"{path}: row 2: invalid JSON"):
        load_benchmark(str(path))


# ---------------------------------------------------------------------------------------------------- runner

class FakeLLM:
    """Stands in for vllm.LLM: sample j of a request answers (seed + j) % 3, in ((seed + j) % 4 + 1) * 2 tokens
    (vLLM seeds the j-th copy of a request with seed + j: a sample depends on that seed alone). Like vLLM, it
    refuses a whole batch when one prompt is longer than `refuse_longer_than` tokens; after `crash_after` calls
    it fails as a dead engine would."""

    def __init__(self, tokenizer, max_model_len=4096, refuse_longer_than=None, crash_after=None):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=max_model_len)
        self.refuse_longer_than, self.crash_after = refuse_longer_than, crash_after
        self.seeds = []

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, requests, params, use_tqdm=False):
        if self.crash_after is not None:
            if self.crash_after == 0:
                raise RuntimeError("engine died")
            self.crash_after -= 1
        for request in requests:
            if self.refuse_longer_than and len(request["prompt_token_ids"]) > self.refuse_longer_than:
                raise VLLMValidationError(f"The decoder prompt (length {len(request['prompt_token_ids'])}) is "
                                          "longer than the maximum model length")
        outputs = []
        for request, p in zip(requests, params, strict=True):
            assert request["prompt_token_ids"] and (p.temperature, p.top_p, p.max_tokens) == (1.0, 0.7, 8)
            self.seeds.append(p.seed)
            outputs.append(SimpleNamespace(outputs=[
                SimpleNamespace(text=f"so \\boxed{{{(p.seed + j) % 3}}}", token_ids=[0] * ((p.seed + j) % 4 + 1) * 2,
                                finish_reason="length" if ((p.seed + j) % 4 + 1) * 2 >= p.max_tokens else "stop")
                for j in range(p.n)]))
        return outputs


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["Please reason step by step", "What is 1+1?"], vocab_size=300)


@pytest.fixture
def problems_file(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "problem": f"Problem {i}?", "answer": str(i % 3)}) + "\n"
                            for i in range(5)))
    return path


def run(llm, problems_file, out, **kwargs):
    return evaluate(llm, [str(problems_file)], out, n=4, max_tokens=8, batch_problems=2, **kwargs)["toy"]


def test_runner_outputs(tokenizer, problems_file, tmp_path):
    llm = FakeLLM(tokenizer)
    metrics = run(llm, problems_file, tmp_path / "out")
    samples = [json.loads(line) for line in (tmp_path / "out" / "toy.samples.jsonl").read_text().splitlines()]
    assert len(samples) == 20 and {s["sample"] for s in samples} == {0, 1, 2, 3}
    assert llm.seeds == [problem_seed(0, "toy", f"q{i}") for i in range(5)]
    for s in samples:
        i = int(s["id"][1:])
        expected = (problem_seed(0, "toy", s["id"]) + s["sample"]) % 3
        assert s["extracted"] == str(expected) and s["correct"] == (expected == i % 3)
    # Per problem, the 4 samples answer 4 consecutive values mod 3: the gold answer appears once or twice.
    per_problem = {}
    for s in samples:
        per_problem.setdefault(s["id"], []).append(s["correct"])
    assert metrics["avg@4"] == pytest.approx(sum(sum(c) / 4 for c in per_problem.values()) / 5)
    assert metrics["pass@4"] == 1.0 and metrics["truncation_rate"] == 0.25 and metrics["max_length"] == 8
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["toy"] == metrics
    report = (tmp_path / "out" / "results.md").read_text()
    assert report.startswith("| dataset |") and "| toy | 5 | 0 | 4 |" in report
    assert metrics["skipped_problems"] == 0 and not (tmp_path / "out" / "shards").exists()
    assert json.loads((tmp_path / "out" / "run.json").read_text())["top_p"] == 0.7


def test_runner_resumes_without_regenerating(tokenizer, problems_file, tmp_path):
    out = tmp_path / "out"
    first = run(FakeLLM(tokenizer), problems_file, out)
    path = out / "toy.samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    # A kill while appending: problem q4 has 2 of its samples and the last line is cut short.
    path.write_text("".join(lines[:18]) + lines[18][:25])
    llm = FakeLLM(tokenizer)
    assert run(llm, problems_file, out) == first
    # Only q4's lost samples (2 and 3) were drawn again, as one request seeded for its sample 2.
    assert llm.seeds == [problem_seed(0, "toy", "q4") + 2]
    assert path.read_text().splitlines(keepends=True) == lines  # and it came out the same (seeded)

    def no_engine():
        raise AssertionError("a finished evaluation must not start an engine")

    assert run(no_engine, problems_file, out) == first


def test_runner_refuses_other_settings(tokenizer, problems_file, tmp_path):
    run(FakeLLM(tokenizer), problems_file, tmp_path / "out")
    with pytest.raises(ValueError, match="other settings .*temperature: 1.0 -> 0.6"):
        run(FakeLLM(tokenizer), problems_file, tmp_path / "out", temperature=0.6)
