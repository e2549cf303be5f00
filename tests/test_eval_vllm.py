"""`sse-rl eval` end to end through vLLM's CPU build on a tiny random-weight Qwen2 checkpoint built here (no
downloads): n = 4 samples on a few AIME24 and MATH-500 problems, the same over two engines, then an interrupted
run resumed.

vLLM runs in a subprocess (its workers re-import the main module), with the engine core in that process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), which starts in seconds instead of half a minute.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import shared_data_file

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tasks.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2")
    texts = [json.loads(line)["problem"] for line in shared_data_file("aime24.jsonl").read_text().splitlines()[:5]]
    tokenizer = train_tokenizer(texts + ["Please reason step by step, and put your final answer within \\boxed{}."],
                                vocab_size=400)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sse_rl_eval(checkpoint, out: Path, *extra: str) -> subprocess.CompletedProcess:
    datasets = ",".join(str(shared_data_file(f"{name}.jsonl")) for name in ("aime24", "math500"))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "eval.cli", "--model", str(checkpoint), "--datasets", datasets, "--out", str(out),
           "--n", "4", "--limit", "3", "--max-tokens", "48", "--batch-problems", "2",
           "--max-model-len", "2048", "--enforce-eager", "--gpu-memory-utilization", "0.05", *extra]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_cli_end_to_end_and_resume(checkpoint, tmp_path):
    out = tmp_path / "eval"
    result = sse_rl_eval(checkpoint, out)
    assert "| aime24 | 3 | 0 | 4 |" in result.stdout and "| math500 | 3 | 0 | 4 |" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    for name in ("aime24", "math500"):
        m = metrics[name]
        assert m["num_problems"] == 3 and m["n"] == 4
        assert {"avg@4", "avg@4_ci95", "pass@1", "pass@4", "maj@4", "mean_length", "max_length", "truncation_rate",
                "accuracy_by_length"} <= set(m)
        assert 0 < m["max_length"] <= 48
        samples = read_samples(out / f"{name}.samples.jsonl")
        assert len(samples) == 12 and sorted({s["sample"] for s in samples}) == [0, 1, 2, 3]
        assert all(s["grade"] in ("correct", "wrong") and s["num_tokens"] <= 48 for s in samples)
        assert all(s["truncated"] == (s["finish_reason"] == "length") for s in samples)
    assert "| aime24 | 3 | 0 | 4 |" in (out / "results.md").read_text()
    aime24 = (out / "aime24.samples.jsonl").read_text()

    # Two engines (two processes of the CPU build, each drawing samples 0-1 or 2-3 of every problem): the samples
    # of one.
    sse_rl_eval(checkpoint, tmp_path / "two", "--engines", "2")
    for name in ("aime24", "math500"):
        assert (tmp_path / "two" / f"{name}.samples.jsonl").read_text() == (out / f"{name}.samples.jsonl").read_text()

    # Interrupt: the last MATH-500 problem lost two samples and its last line was cut short.
    path = out / "math500.samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:10]) + lines[10][:30])
    sse_rl_eval(checkpoint, out)
    again = path.read_text().splitlines(keepends=True)
    assert again[:8] == lines[:8]  # finished problems are kept as they were, not generated again
    # Seeded per sample, the two lost samples come out as the uninterrupted run had them.
    assert again == lines
    assert (out / "aime24.samples.jsonl").read_text() == aime24
    assert json.loads((out / "metrics.json").read_text())["math500"]["num_problems"] == 3


SLOW_START = """
import sys
from eval.engine import EvalEngineSettings, build_llm, reporting_slow_start
import eval.engine
eval.engine.START_REPORT_S = 4.0  # the engine core's start takes longer than this on the CPU build
llm = build_llm(sys.argv[1], EvalEngineSettings(dtype="float32", max_model_len=256, kv_cache_gib=1,
                                                 enforce_eager=True, gpu_memory_utilization=0.05))
print("ENGINE STARTED", flush=True)
"""


def test_a_slow_engine_start_says_where_each_vllm_process_waits(checkpoint):
    """A start past START_REPORT_S reports itself on stderr with the stacks of this process and of the engine-core
    process (a child that dumps on SIGUSR1 through the plugin), then the engine starts as usual: a stalled start
    names what it waits on instead of hanging silently."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", SLOW_START, str(checkpoint)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ENGINE STARTED" in result.stdout, result.stderr[-5000:]
    assert f"the eval engine for {checkpoint}: the vLLM engine is still starting after " in result.stderr
    assert "vllm/v1/engine/core.py" in result.stderr, result.stderr[-5000:]  # the engine core's own stack
