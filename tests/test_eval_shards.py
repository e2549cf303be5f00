"""An evaluation over several engines, without vLLM (the stand-in engine of test_eval.py): the split of problems x
samples, the same samples and metrics from one engine, two engines and two gloo ranks, resuming after an engine
died mid-share (with another number of engines), problems the engine cannot take skipped and counted, and GRPO's
periodic eval on every rank."""
import json
import os
import socket
import types
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from eval.runner import EvalFailed, evaluate, generate_share, markdown_report, problem_seed
from eval.shards import runs, split_work
from pipeline.stages.evaluate import table
from tasks.tokenizer import train_tokenizer
from test_eval import FakeLLM

N = 4


def tokenizer():
    return train_tokenizer(["Please reason step by step", "What is 1+1?"], vocab_size=300)


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def write_problems(path, count=5, long=()):
    path.write_text("".join(json.dumps({"id": f"q{i}", "answer": str(i % 3), "problem": f"Problem {i}?" + (
        " and then some more words" * 20 if i in long else "")}) + "\n" for i in range(count)))
    return path


@pytest.fixture
def problems(tmp_path):
    return write_problems(tmp_path / "toy.jsonl")


def in_turn(llms):
    """`evaluate`'s launch, with the engines of `llms` one after the other in this process."""
    def launch(shares, out, sampling, report):
        for k, share in enumerate(shares):
            generate_share(llms[k], share, out, k, sampling, report)
    return launch


def run(problems, out, llms, **kwargs):
    engines = len(llms)
    return evaluate(llms[0], [str(problems)], out, n=N, max_tokens=8, batch_problems=2, engines=engines,
                    launch=in_turn(llms) if engines > 1 else None, **kwargs)


def test_split_covers_every_sample_once_and_balances_engines():
    rows = [{"id": f"q{i}"} for i in range(3)]
    # n >= engines: every engine draws the same share of every problem.
    shares = split_work([("d", row, list(range(8))) for row in rows], 4)
    assert [[(s["row"]["id"], s["start"], s["stop"]) for s in share] for share in shares] == [
        [(f"q{i}", 2 * k, 2 * k + 2) for i in range(3)] for k in range(4)]
    # n < engines: whole samples dealt in turn; a resumed problem's missing samples keep their indices.
    shares = split_work([("d", rows[0], [0, 1]), ("d", rows[1], [1, 3]), ("e", rows[2], [2])], 4)
    assert [[(s["dataset"], s["row"]["id"], s["start"], s["stop"]) for s in share] for share in shares] == [
        [("d", "q0", 0, 1), ("e", "q2", 2, 3)], [("d", "q0", 1, 2)], [("d", "q1", 1, 2)], [("d", "q1", 3, 4)]]
    assert runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]
    assert split_work([("d", rows[0], [0, 1, 2])], 1) == [[{"dataset": "d", "row": rows[0], "start": 0, "stop": 3}]]


def test_two_engines_give_the_samples_of_one(tok, problems, tmp_path):
    one = run(problems, tmp_path / "one", [FakeLLM(tok)])
    llms = [FakeLLM(tok), FakeLLM(tok)]
    two = run(problems, tmp_path / "two", llms)
    assert two == one
    assert (tmp_path / "two" / "toy.samples.jsonl").read_text() == (tmp_path / "one" / "toy.samples.jsonl").read_text()
    # Each engine drew half of every problem: samples 0-1 (seed + 0) on one, 2-3 (seed + 2) on the other.
    seeds = [problem_seed(0, "toy", f"q{i}") for i in range(5)]
    assert llms[0].seeds == seeds and llms[1].seeds == [s + 2 for s in seeds]
    assert not (tmp_path / "two" / "shards").exists()


def test_an_engine_dying_keeps_every_finished_batch(tok, problems, tmp_path):
    out = tmp_path / "out"
    # Engine 1 draws its first batch (2 problems x 2 samples) and dies on its second.
    with pytest.raises(RuntimeError, match="engine died"):
        run(problems, out, [FakeLLM(tok), FakeLLM(tok, crash_after=1)])
    shard = [json.loads(line) for line in (out / "shards" / "toy.1.jsonl").read_text().splitlines()]
    assert [(s["id"], s["sample"]) for s in shard] == [("q0", 2), ("q0", 3), ("q1", 2), ("q1", 3)]
    assert len((out / "shards" / "toy.0.jsonl").read_text().splitlines()) == 10
    # Resumed over three engines: only the 6 samples engine 1 had left are drawn.
    llms = [FakeLLM(tok) for _ in range(3)]
    resumed = run(problems, out, llms)
    drawn = sorted(seed for llm in llms for seed in llm.seeds)
    assert drawn == sorted(problem_seed(0, "toy", f"q{i}") + j for i in (2, 3, 4) for j in (2, 3))
    assert resumed == run(problems, tmp_path / "whole", [FakeLLM(tok)])
    assert (out / "toy.samples.jsonl").read_text() == (tmp_path / "whole" / "toy.samples.jsonl").read_text()


def test_prompts_the_engine_cannot_take_are_skipped_and_counted(tok, tmp_path):
    problems = write_problems(tmp_path / "toy.jsonl", long=(1, 3))
    # q1 and q3 are longer than the engine takes; vLLM refuses their batches whole, the runner takes each alone.
    llm = FakeLLM(tok, refuse_longer_than=100)
    m = run(problems, tmp_path / "out", [llm])["toy"]
    assert m["num_problems"] == 3 and m["skipped_problems"] == 2
    assert [s["id"] for s in m["skipped"]] == ["q1", "q3"] and "refused by vLLM" in m["skipped"][0]["reason"]
    ids = {json.loads(line)["id"] for line in (tmp_path / "out" / "toy.samples.jsonl").read_text().splitlines()}
    assert ids == {"q0", "q2", "q4"}
    assert "| toy | 3 | 2 | 4 |" in (tmp_path / "out" / "results.md").read_text()
    # Prompt + max_tokens over max_model_len: skipped before vLLM sees it, on every engine alike.
    m = run(problems, tmp_path / "short", [FakeLLM(tok, max_model_len=100), FakeLLM(tok, max_model_len=100)])["toy"]
    assert m["skipped_problems"] == 2 and "exceeds the engine's max_model_len (100)" in m["skipped"][1]["reason"]
    # Nothing left to score: reported, not raised.
    everything = run(problems, tmp_path / "none", [FakeLLM(tok, max_model_len=50)])
    assert everything["toy"]["num_problems"] == 0 and everything["toy"]["skipped_problems"] == 5
    assert "| toy | 0 | 5 | 4 |" in markdown_report(everything)
    console = table({"last": {"toy": m}, "grpo": everything}, {}, N)
    assert console.splitlines()[0].endswith("| skipped |") and "| last | toy |" in console
    assert console.splitlines()[-1] == "| grpo | toy | - | | - | - | 5 |"


# ---------------------------------------------------------------------------------------------------- ranks

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, problems: str, out: str, results, crash_rank: int | None):
    import torch.distributed as dist

    from pipeline.stages.grpo import PeriodicEval

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        llm = FakeLLM(tokenizer(), crash_after=0 if rank == crash_rank else None)
        pushes, logged = [], []
        trainer = types.SimpleNamespace(vllm_generation=types.SimpleNamespace(
            llm=llm, sync_weights=lambda: pushes.append(rank)), accelerator=types.SimpleNamespace(num_processes=world))
        cfg = types.SimpleNamespace(seed=0, data=types.SimpleNamespace(eval=[problems]), eval=types.SimpleNamespace(
            n=N, temperature=1.0, top_p=0.7, max_tokens=8, limit=None, benchmarks={}))
        run_dir = types.SimpleNamespace(stage_dir=lambda stage: Path(out) / stage,
                                        log_metrics=lambda stage, step, values: logged.append(values))
        callback = PeriodicEval(cfg, run_dir, every=2)
        callback.trainer = trainer
        state = types.SimpleNamespace(global_step=4, is_world_process_zero=rank == 0)
        try:
            callback.on_step_end(None, state, None)
            results[rank] = {"pushes": pushes, "logged": logged, "seeds": llm.seeds,
                             "step": trainer._last_loaded_step}
        except EvalFailed as err:
            results[rank] = {"error": str(err)}
    finally:
        dist.destroy_process_group()


def on_two_ranks(problems, out, crash_rank=None) -> dict:
    results = mp.Manager().dict()
    mp.spawn(rank_main, args=(2, free_port(), str(problems), str(out), results, crash_rank), nprocs=2, join=True)
    return dict(results)


def test_grpo_periodic_eval_shared_by_every_rank(tok, problems, tmp_path):
    results = on_two_ranks(problems, tmp_path)
    # Both ranks pushed their weights and drew half of every problem; rank 0 logged the merged scores.
    assert [results[r]["pushes"] for r in (0, 1)] == [[0], [1]] and results[0]["step"] == results[1]["step"] == 4
    seeds = [problem_seed(0, "toy", f"q{i}") for i in range(5)]
    assert results[0]["seeds"] == seeds and results[1]["seeds"] == [s + 2 for s in seeds]
    single = evaluate(FakeLLM(tok), [str(problems)], tmp_path / "single", n=N, max_tokens=8)["toy"]
    assert results[0]["logged"] == [{"eval/toy/avg@4": single["avg@4"], "eval/toy/skipped_problems": 0}]
    assert results[1]["logged"] == []
    merged = tmp_path / "grpo" / "eval-step-4" / "toy.samples.jsonl"
    assert merged.read_text() == (tmp_path / "single" / "toy.samples.jsonl").read_text()


def test_a_rank_failing_its_share_fails_every_rank(problems, tmp_path):
    results = on_two_ranks(problems, tmp_path, crash_rank=1)  # returns: no rank was left waiting
    assert "rank 1: RuntimeError: engine died" in results[0]["error"] == results[1]["error"]
