"""GRPO with `trainer.sharding: fsdp` end to end on CPU (issue 74): the pipeline's own stage entry
(`pipeline.orchestrator.execute_stage`, what each Ray Train worker runs) on two gloo ranks spawned here, each with its
own colocated vLLM engine, a few steps of the tiny config from the init stage's random model. Ray Train would add
about a minute of start-up on two cores and change nothing the stage does.

What it shows: the model is sharded (each rank holds half the parameters); every push streams full parameters into
each rank's engine and the parity probe passes after each; checkpoints are written and a stage resumed from one ends
with the weights of the uninterrupted run; the final model loads and equals the trained full weights."""
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from rewards.text import completion_text

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
OVERRIDES = [
    "stages=[init,grpo]", "eval.models=[last]", "trainer.sharding=fsdp",
    "resources.grpo.num_workers=2", "resources.grpo.num_cpus=1", "resources.grpo.num_threads=1",
    "data.sft.generator.num_examples=400",  # the init stage trains the tokenizer on it
    "data.grpo.generator.num_examples=40",
    f"grpo.steps={STEPS}", "grpo.save_steps=1", "grpo.num_generations=4", "grpo.per_device_batch_size=4",
    "grpo.max_completion_length=16", "grpo.vllm.max_num_seqs=8",
    # a random model never answers, so math_accuracy would give every completion 0 and GRPO no gradient
    "grpo.rewards=[{name: 'test_sharded_grpo:digit_share'}]",
]


def digit_share(prompts, completions, **kwargs) -> list[float]:
    """The share of digits in a completion: varies between a random model's completions."""
    texts = [completion_text(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def rank_main(rank: int, port: int, run_path: str, model_path: str, config: dict):
    """One rank of the GRPO stage, recording what it pushed into its engine and its trained full weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    import pipeline.stages.grpo
    import pipeline.trl_seams
    from pipeline.orchestrator import execute_stage

    record = {"pushes": []}
    push_and_check, save_final_model = pipeline.trl_seams.push_and_check, pipeline.stages.grpo.save_final_model

    def recording_push(engine, model, named_tensors, *args):
        pushed = []

        def stream():
            for name, tensor in named_tensors:
                pushed.append((name, tuple(tensor.shape), hasattr(tensor, "to_local")))
                yield name, tensor

        drift = push_and_check(engine, model, stream(), *args)
        record["pushes"].append({"drift": drift, "tensors": pushed,
                                 "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}})
        return drift

    def recording_save(trainer, tokenizer, out):
        params = dict(trainer.model.named_parameters())
        record["local"] = {n: p.to_local().numel() if hasattr(p, "to_local") else p.numel() for n, p in params.items()}
        record["final"] = {n: p.full_tensor().detach().clone() for n, p in params.items()}  # every rank gathers
        return save_final_model(trainer, tokenizer, out)

    pipeline.trl_seams.push_and_check, pipeline.stages.grpo.save_final_model = recording_push, recording_save
    execute_stage("grpo", config, run_path, model_path, write_result=rank == 0)
    torch.save(record, os.path.join(run_path, f"rank{rank}.pt"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grpo_on_two_ranks(run_path, model_path: str, config: dict) -> tuple[dict, list[dict]]:
    mp.spawn(rank_main, args=(free_port(), str(run_path), model_path, config), nprocs=2)
    result = json.loads((run_path / "grpo" / "result.json").read_text())
    assert result["status"] == "done", result
    return result, [torch.load(run_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def grpo_steps(run_path) -> dict[int, dict]:
    """Rank 0's metrics of each GRPO step."""
    return {m["step"]: m for m in map(json.loads, (run_path / "metrics.jsonl").read_text().splitlines())
            if m["stage"] == "grpo" and "reward" in m}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    from pipeline.config import load_config, resolve
    from pipeline.orchestrator import execute_stage, prepare_run_dir

    cfg = load_config(REPO / "configs" / "tiny.yaml", OVERRIDES)
    run_dir = prepare_run_dir(cfg, tmp_path_factory.mktemp("sharded_grpo") / "run")
    run_dir.unlock()
    execute_stage("init", resolve(cfg), str(run_dir.path), None)
    model_path = json.loads((run_dir.stage_dir("init") / "result.json").read_text())["output"]
    result, ranks = grpo_on_two_ranks(run_dir.path, model_path, resolve(cfg))
    return cfg, run_dir.path, model_path, result, ranks


@pytest.mark.slow
def test_sharded_grpo_pushes_full_weights_into_every_ranks_engine(sharded_run):
    cfg, run, _, result, ranks = sharded_run
    assert result["steps"] == STEPS
    threshold = cfg.grpo.parity_threshold
    steps = grpo_steps(run)
    assert sorted(steps) == list(range(1, STEPS + 1)) and all(m["vllm_parity"] <= threshold for m in steps.values())
    total = sum(t.numel() for t in ranks[0]["final"].values())
    for record in ranks:
        assert sum(record["local"].values()) <= total / 2 + 64  # sharded: half of every parameter per rank
        assert len(record["pushes"]) == STEPS  # the weights of steps 0, 1 and 2, each before a rollout
        for push in record["pushes"]:
            assert push["drift"] <= threshold
            # every parameter, in full, none a shard; vLLM's names are the trainer's here
            assert [(n, s) for n, s, _ in push["tensors"]] == list(push["shapes"].items())
            assert not any(sharded for _, _, sharded in push["tensors"])


@pytest.mark.slow
def test_sharded_grpo_final_model_is_the_trained_weights(sharded_run):
    from transformers import AutoModelForCausalLM

    _, run, _, _, ranks = sharded_run
    trained = ranks[0]["final"]
    torch.testing.assert_close(ranks[1]["final"], trained, rtol=0, atol=0)
    model = AutoModelForCausalLM.from_pretrained(run / "grpo" / "final")
    assert dict(model.named_parameters()).keys() == trained.keys()
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), trained[name]), name
    saved = load_file(run / "grpo" / f"checkpoint-{STEPS}" / "model.safetensors")
    for name, weight in trained.items():
        assert torch.equal(saved[name], weight), name


@pytest.mark.slow
def test_sharded_grpo_resumes_from_a_checkpoint(sharded_run, tmp_path):
    """A stage stopped after checkpoint-2 resumes from it and ends as the uninterrupted run did."""
    cfg, run, model_path, _, ranks = sharded_run
    from pipeline.config import resolve

    again = tmp_path / "run"
    shutil.copytree(run, again)
    for name in (f"checkpoint-{STEPS}", "final", "result.json"):
        path = again / "grpo" / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    result, resumed = grpo_on_two_ranks(again, model_path, resolve(cfg))
    assert result["summary"].endswith(f"(resumed from checkpoint-{STEPS - 1})")
    assert len(resumed[0]["pushes"]) == 1  # the weights of checkpoint-2, into the new engines
    assert grpo_steps(again)[STEPS]["reward"] == grpo_steps(run)[STEPS]["reward"]  # the same rollouts at step 3
    torch.testing.assert_close(resumed[0]["final"], ranks[0]["final"], rtol=0, atol=0)
