"""The CPU-testable logic of the GPU benchmarks bench/decode.py (the byte floor of a decode step, the cache fit, the
staged batch sizes, the step grouping) and bench/recipe_memory.py (one rank's shape, the phase driver on a tiny
model, the sharding arithmetic and its tables)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from bench import baseline, decode, recipe_memory, rollouts
from pipeline.config import load_config
from sse_model import SSEConfig

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def tiny_sse() -> SSEConfig:
    return SSEConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     layer_types=["linear_attention", "linear_attention", "full_attention"], num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, sse_num_heads=2, sse_key_dim=16, sse_value_dim=8,
                     sse_num_partitions=4, sse_top_k=1, sse_shared_partition=True, sse_lora_rank=4)


def test_floor_bytes_of_a_small_config_by_hand():
    config = tiny_sse()
    state, kv_per_token = rollouts.cache_per_sequence("SSE-H", config)
    # int16 states of 16 + 4 rows x 8 for 2 SSE layers x 2 heads x (4 + shared) partitions; bf16 K and V of 1 head x 32
    assert state == 2 * 2 * 2 * 5 * 20 * 8 == 6400
    assert kv_per_token == 2 * 1 * 32 * 2 * 1 == 128
    parts = decode.floor_bytes(config, sequences=3, context=99, weight_bytes=1000, state_bytes=state,
                               kv_bytes_per_token=kv_per_token)
    # 2 of 5 partitions touched, read and written, per sequence; the KV of 99 tokens read and the new one written
    assert parts == dict(weights=1000, states=2 * 6400 * 2 / 5 * 3, kv=128 * 100 * 3)
    qwen = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    # per layer q, k, v, o, q/k norms, MLP, 2 norms; the final norm and the head; not the input embedding
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 32 + 3 * 64 * 128 + 2 * 64
    assert rollouts.streamed_weights(qwen) == 2 * layer + 64 + 100 * 64
    assert rollouts.cache_per_sequence("Qwen3", qwen) == (0, 2 * 32 * 2 * 2)
    assert decode.floor_bytes(qwen, 2, 9, 5, 0, 256) == dict(weights=5, states=0.0, kv=256 * 10 * 2)


def test_cache_fit_and_the_batch_sizes_run():
    layout = dict(num_blocks=1000, groups=[[64, False], [64, True], [64, True]])
    assert decode.sequences_that_fit(layout, 640) == 1000 // (10 + 2)
    assert decode.sequences_that_fit(layout, 641) == 1000 // (11 + 2)
    assert decode.sequences_that_fit(None, 640) is None
    assert decode.stages([8, 32, 128], 40) == ([32, 8], [128])
    assert decode.stages([8, 32, 128], None) == ([128, 32, 8], [])
    assert decode.stages([8, 32], 4) == ([], [8, 32])


def test_step_ms_takes_decode_steps_of_exactly_that_batch():
    rows = [(0.0, 0.0, 5.0, False, 4)]  # a prefill step
    rows += [(0.1 + 0.010 * i, None, None, True, 4) for i in range(6)]
    rows += [(0.2 + 0.020 * i, 1.0, 3.5, True, 2) for i in range(5)]
    four = decode.step_ms(rows, 4)
    assert four["ms"] == pytest.approx(10) and four["steps"] == 6 - 1 - decode.SKIP and four["gpu_span_ms"] is None
    two = decode.step_ms(rows, 2)
    assert two["ms"] == pytest.approx(20) and two["steps"] == 1 and two["gpu_span_ms"] == 2.5
    assert decode.step_ms(rows, 8) is None


class FakeEngine:
    """LLMEngine's add_request / step / abort_request: a prefill over two steps (the first half of the requests
    in the first), then one token per living request per step."""

    def __init__(self):
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096))
        self.alive, self.prefilled, self.aborted = [], 0, []

    def add_request(self, request_id, prompt, params):
        assert params.ignore_eos and params.max_tokens == 4096 - len(prompt["prompt_token_ids"])
        self.alive.append(request_id)

    def step(self):
        self.prefilled = min(len(self.alive), self.prefilled + max(1, len(self.alive) // 2))
        return [SimpleNamespace(request_id=r, outputs=[SimpleNamespace(token_ids=[7])])
                for r in self.alive[:self.prefilled]]

    def abort_request(self, ids):
        self.aborted.append(list(ids))
        self.alive = [r for r in self.alive if r not in ids]

    def has_unfinished_requests(self):
        return bool(self.alive)


def test_drive_runs_each_batch_size_after_the_prefill_and_aborts_down():
    engine = FakeEngine()
    contexts = decode.drive(SimpleNamespace(llm_engine=engine), [4, 2], 100, 4, 50, torch.Generator().manual_seed(0))
    # after the prefill r0, r1 have 2 tokens, r2, r3 1; halfway through 4 steps (3 steps) 5 and 4
    assert contexts == {4: 100 + 4.5, 2: 100 + 2 + 4 + 3}
    assert engine.aborted == [["r2", "r3"], ["r0", "r1"]]


def test_table_rows_put_the_step_beside_its_floor():
    cfgs = {"SSE-H": tiny_sse()}
    results = {"SSE-H": {"runs": {"4096": {"fit": 40, "does_not_fit": [128], "batches": {
        "8": {"ms": 2.0, "context": 4100.0, "gpu_span_ms": 1.9, "steps": 40}}}}}}
    rows = decode.table_rows(results, cfgs, bandwidth=1e12)
    assert [(r["sequences"], r["note"]) for r in rows] == [(8, ""), (128, "does not fit (at most 40 at once)")]
    state, kv = rollouts.cache_per_sequence("SSE-H", cfgs["SSE-H"])
    parts = decode.floor_bytes(cfgs["SSE-H"], 8, 4100.0, 2 * rollouts.streamed_weights(cfgs["SSE-H"]), state, kv)
    assert rows[0]["floor ms"] == pytest.approx(sum(parts.values()) / 1e9)
    assert rows[0]["step / floor"] == pytest.approx(2.0 / rows[0]["floor ms"])
    assert rows[1]["step ms"] is None
    table = decode.markdown(rows, 1e12, "cpu")
    assert "| SSE-H | 8 | 4096 | 2.00 |" in table and table.endswith("|\n")
    rows[0]["sequences"] = 32
    assert decode.headline(rows) == {"label": "SSE-H decode step / byte floor, 32 sequences at 4k",
                                     "value": round(rows[0]["step / floor"], 2)}


def test_a_model_that_runs_out_of_time_keeps_the_contexts_it_finished(tmp_path, monkeypatch):
    """A worker killed at --timeout after its first context: that context's steps are kept and the result says why it
    is incomplete; a worker that finished none raises with its log's last lines."""
    import subprocess

    log = tmp_path / "worker.log"

    def killed_after_one_context(cmd, stdout, **kwargs):
        stdout.write('[SSE-H] 4096: {"fit": 40, "does_not_fit": [128], "batches": {"32": {"ms": 5.0}}}\n')
        stdout.flush()
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(decode.subprocess, "run", killed_after_one_context)
    args = SimpleNamespace(engine="{}", steps=4, sequences=[32, 128], contexts=[4096, 16384], timeout=7.0)
    result = decode.run_model("SSE-H", tiny_sse(), args, log)
    assert result == {"runs": {"4096": {"fit": 40, "does_not_fit": [128], "batches": {"32": {"ms": 5.0}}}},
                      "incomplete": "timed out after 7 s"}

    def killed_before_any(cmd, stdout, **kwargs):
        stdout.write("loading\n")
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(decode.subprocess, "run", killed_before_any)
    with pytest.raises(RuntimeError, match="(?s)timed out after 7 s.*loading"):
        decode.run_model("SSE-H", tiny_sse(), args, log)


def test_a_rank_of_the_paper_recipe():
    cfg = load_config(REPO / "configs" / "sse_h_2b.yaml")
    assert recipe_memory.rank_shape(cfg) == dict(prompts=4, generations=8, micro_batch=2, micro_batches=16)
    assert recipe_memory.model_config(cfg).hidden_size == 2304


def test_sharded_rank_arithmetic_by_hand():
    components = dict(weights=8 * GIB, gradients=8 * GIB, adam=16 * GIB, root=1 * GIB, largest_layer=GIB // 2,
                      largest_parameter=GIB // 4, **{"engine awake": 30 * GIB})
    phases = [dict(phase="update", seconds=1.0, peak_allocated=10 * GIB, device_peak=40 * GIB),
              dict(phase="push", seconds=2.0, peak_allocated=9 * GIB, device_peak=60 * GIB),
              dict(phase="rollout", seconds=3.0)]  # off a GPU: no memory figures
    rows = recipe_memory.per_rank(phases, components, ranks=8)
    # update: 40 - (8 + 8 + 16) * 7/8 + 2 * (1 + 2 * 0.5); push: 60 - (8 + 16) * 7/8 + 0.25
    assert [r["device peak GiB, 8-way sharded"] for r in rows] == [16.0, 39.25, None]
    assert rows[0]["trainer state GiB"] == 32.0 and rows[2]["device peak GiB"] is None
    table = {r["component"]: r for r in recipe_memory.component_rows(components, 8)}
    assert table["Adam state"] == {"component": "Adam state", "one rank GiB": 16.0, "per rank, 8-way GiB": 2.0}
    assert table["engine awake"]["per rank, 8-way GiB"] == 30.0
    assert table["gathered FSDP units (root + 2 layers, bf16)"]["per rank, 8-way GiB"] == 2.0


TINY_RECIPE = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
               "model.config.layer_types=[linear_attention, full_attention]", "model.config.num_attention_heads=2",
               "model.config.num_key_value_heads=2", "model.config.head_dim=32", "model.config.sse_num_heads=2",
               "model.config.sse_key_dim=16", "model.config.sse_value_dim=16", "model.config.vocab_size=512",
               "grpo.per_device_batch_size=2", "grpo.gradient_accumulation_steps=2", "grpo.num_generations=2"]
TINY_RECIPE_ARGS = ["--no-engine", "--max-tokens", "8", "--prompt-tokens", "4",
                    *[a for s in TINY_RECIPE for a in ("--set", s)]]


def test_recipe_memory_runs_the_trainer_phases_of_a_tiny_model_on_cpu(tmp_path, monkeypatch, capsys):
    """The CLI on the recipe shrunk by --set: no engine (the CPU build has no sleep mode), random completions,
    the log-probability pass and one optimizer step; the component sizes are the tensors'."""
    monkeypatch.setattr(baseline, "RUNS", tmp_path)
    report = recipe_memory.main(TINY_RECIPE_ARGS)
    assert [p["phase"] for p in report["phases"]] == ["rollout", "log-probabilities", "update"]
    assert report["shape"] == dict(prompts=2, generations=2, micro_batch=2, micro_batches=2, prompt_tokens=4,
                                   max_tokens=8)
    c = report["components"]
    assert c["gradients"] == c["weights"] and c["adam"] == 2 * c["weights"]
    cfg = load_config(REPO / "configs" / "sse_h_2b.yaml", TINY_RECIPE)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(recipe_memory.model_config(cfg))
    numel = sum(p.numel() for p in model.parameters())
    assert c["weights"] == 4 * numel  # float32 master weights
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("| update |")
    assert len(list(tmp_path.glob("recipe_memory_*.json"))) == 1


def test_recipe_memory_all_attention_measures_the_same_recipe_without_sse(tmp_path, monkeypatch):
    """--all-attention: every layer softmax attention at the recipe's shape, so the weights are an all-attention
    model's, and the baseline is the config's name with `_all_attention`."""
    monkeypatch.setattr(baseline, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(baseline, "RESULTS", tmp_path / "results")
    report = recipe_memory.main([*TINY_RECIPE_ARGS, "--all-attention", "--baseline"])
    config = recipe_memory.model_config(load_config(REPO / "configs" / "sse_h_2b.yaml", TINY_RECIPE), True)
    assert config.layer_types == ["full_attention", "full_attention"]
    with torch.device("meta"):
        numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert report["components"]["weights"] == 4 * numel
    written = json.loads((tmp_path / "results" / "recipe_memory_sse_h_2b_all_attention.json").read_text())
    assert "every layer softmax attention" in written["title"] and written["shape"] == report["shape"]
