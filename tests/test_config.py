"""Config loading: shipped configs validate and round-trip; bad configs fail naming the file and the key."""
import os
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, config_from_dict, load_config, resolve, save_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    assert config_from_dict(resolve(cfg)) == cfg
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_model_config_builds(path):
    from sse_model.configuration_sse import SSEConfig

    settings = dict(load_config(path).model.config)
    if "preset" in settings:
        SSEConfig.from_preset(settings.pop("preset"), **settings)
    elif settings:
        SSEConfig(vocab_size=512, **settings)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_rewards_are_registered(path):
    from rewards import get_reward

    for spec in load_config(path).grpo.rewards:
        get_reward(spec.name)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_keep_only_their_last_checkpoints(path):
    """A checkpoint of the 2B recipe takes ~24 GB: every training stage a shipped config runs keeps its last
    checkpoints only (TRL's save_total_limit; the final model is written apart, in final/)."""
    cfg = load_config(path)
    for stage in {"sft", "grpo"} & set(cfg.stages):
        assert (getattr(cfg, stage).trl.get("save_total_limit") or 0) >= 1, stage


def test_ray_runtime_env_keys_are_checked():
    tiny = CONFIGS[0].with_name("tiny.yaml")
    env = load_config(tiny, ["ray.runtime_env.py_modules=[rewards_pkg]", "ray.runtime_env.env_vars={A: '1'}"])
    env = env.ray.runtime_env
    assert env.py_modules == ["rewards_pkg"] and env.env_vars == {"A": "1"} and env.working_dir is None
    with pytest.raises(ConfigError, match=r"ray\.runtime_env\.py_module: unknown key.*py_modules"):
        load_config(tiny, ["ray.runtime_env.py_module=[rewards_pkg]"])
    with pytest.raises(ConfigError, match=r"ray\.runtime_env\.env_vars\.A: expected str"):
        load_config(tiny, ["ray.runtime_env.env_vars={A: 1}"])


def test_shipped_set_is_complete():
    assert {p.name for p in CONFIGS} >= {"tiny.yaml", "tiny_gla.yaml", "tiny_transformer.yaml", "sse_h_2b.yaml",
                                         "convert_qwen3_1p7b.yaml", "gpu_small.yaml"}


def test_baselines_differ_from_tiny_only_in_architecture():
    for name, arch in [("tiny_gla.yaml", {"sse_num_partitions": 1, "sse_top_k": 1, "sse_shared_partition": False}),
                       ("tiny_transformer.yaml", {"layer_types": ["full_attention"] * 4})]:
        tiny = resolve(load_config(CONFIGS[0].parent / "tiny.yaml"))
        base = resolve(load_config(CONFIGS[0].parent / name))
        assert base["model"]["config"] == {**tiny["model"]["config"], **arch}
        for d in (base, tiny):
            d.pop("name"), d["model"].pop("config")
        assert base == tiny


def test_paper_recipe_numbers():
    cfg = load_config(CONFIGS[0].parent / "sse_h_2b.yaml")
    assert cfg.model.config == {"preset": "paper_2b"}
    assert (cfg.sft.epochs, cfg.sft.trl["max_length"], cfg.data.sft.limit) == (5, 32768, 80000)
    assert (cfg.grpo.steps, cfg.grpo.trl["num_generations"], cfg.grpo.trl["max_completion_length"]) == (230, 8, 32768)
    assert (cfg.eval.n, cfg.eval.temperature, cfg.eval.top_p) == (32, 1.0, 0.7)
    assert cfg.data.eval == ["aime24", "aime25", "math500"]
    assert (cfg.resources.eval.num_workers, cfg.resources.eval.num_gpus) == (8, 1)  # an engine on each GPU


def test_periodic_eval_with_a_sharded_trainer(tmp_path):
    # Every rank pushes its weights and evaluates its share (pipeline/stages/grpo.py PeriodicEval): each takes part
    # in the sharded weight gather.
    cfg = load_config(_write(tmp_path, "name: t\nmodel: {tokenizer: {train: true}}\ntrainer: {sharding: fsdp}\n"
                                       "resources: {sft: {num_workers: 2}, grpo: {num_workers: 2}}\n"
                                       "grpo: {eval_every: 5}\n"))
    assert (cfg.trainer.sharding, cfg.grpo.eval_every) == ("fsdp", 5)


class _Tokenizer:  # what build_config reads of a tokenizer
    pad_token_id, bos_token_id, eos_token_id = 1, 0, 3

    def __len__(self):
        return 512


@pytest.mark.parametrize("model_config, vocab", [
    ({"hidden_size": 256}, 512),  # the tokenizer's
    ({"hidden_size": 256, "vocab_size": 4096}, 4096),  # padded past it
    ({"preset": "paper_2b"}, 151936),  # the preset's real vocabulary
])
def test_model_vocabulary_is_the_tokenizers_unless_a_larger_one_is_named(model_config, vocab):
    from pipeline.stages.init import build_config

    cfg = config_from_dict({"name": "v", "model": {"init": "scratch", "tokenizer": {"train": True},
                                                   "config": model_config}})
    assert build_config(cfg, _Tokenizer()).vocab_size == vocab


def test_model_vocabulary_smaller_than_the_tokenizer_is_refused():
    from pipeline.stages.init import build_config

    cfg = config_from_dict({"name": "v", "model": {"init": "scratch", "tokenizer": {"train": True},
                                                   "config": {"vocab_size": 100}}})
    with pytest.raises(ValueError, match=r"model.config.vocab_size 100 is smaller than the tokenizer's 512 tokens"):
        build_config(cfg, _Tokenizer())


def test_rollouts_longer_than_the_models_positions_are_refused_before_training():
    from pipeline.stages.init import check_rollout_length
    from sse_model.configuration_sse import SSEConfig

    cfg = load_config(CONFIGS[0].parent / "sse_h_2b.yaml")  # 1024-token prompts + 32768-token completions
    check_rollout_length(cfg, SSEConfig.from_preset("paper_2b"))
    with pytest.raises(ValueError, match=r"grpo.max_prompt_length \+ grpo.max_completion_length = 33792 tokens "
                                         r"exceed the model's max_position_embeddings \(32768\)"):
        check_rollout_length(cfg, SSEConfig.from_preset("paper_2b", max_position_embeddings=32768))


@pytest.mark.parametrize("master, weights, engine", [(False, "bfloat16", "bfloat16"), (True, "float32", "bfloat16")])
def test_fp32_master_weights_train_float32_weights_and_serve_model_dtype(master, weights, engine):
    import torch

    from pipeline.rollouts import engine_kwargs
    from pipeline.training import weights_dtype

    cfg = config_from_dict({"name": "m", "model": {"dtype": "bfloat16", "fp32_master_weights": master,
                                                   "tokenizer": {"train": True}}})
    assert weights_dtype(cfg) == getattr(torch, weights)
    assert engine_kwargs(cfg, "ckpt")["dtype"] == engine  # "auto" is model.dtype, not the float32 checkpoint's


def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


BAD = [
    ("sft: {learning_rate: abc}", "sft.learning_rate: expected float, got str 'abc'"),
    ("sft: {learnig_rate: 0.1}", "sft.learnig_rate: unknown key (did you mean 'learning_rate'?)"),
    ("sft: {zzz: 1}", "sft.zzz: unknown key: neither a key of the pipeline (epochs, lr_scheduler, warmup_ratio, "
     "per_device_batch_size, token_weights, report_to) nor a field of trl.SFTConfig"),
    ("ray: {zzz: 1}", "ray.zzz: unknown key (valid: address, num_cpus, num_gpus, max_failures, runtime_env)"),
    # TRL settings: checked against trl.SFTConfig / trl.GRPOConfig, their types and declared choices
    ("sft: {adam_beta2: high}", "sft.adam_beta2: expected float, got str 'high'"),
    ("sft: {truncation_mode: middle}", "sft.truncation_mode: expected one of 'keep_end', 'keep_start', got str "
     "'middle'"),
    ("grpo: {top_entropy_quantile: [1]}", "grpo.top_entropy_quantile: expected float, got list [1]"),
    ("sft: {output_dir: /tmp/x}", "sft.output_dir: set by the pipeline (the run directory)"),
    ("sft: {num_train_epochs: 2}", "sft.num_train_epochs: set by the pipeline (from epochs)"),
    ("grpo: {max_steps: 2}", "grpo.max_steps: set by the pipeline (from steps)"),
    ("grpo: {vllm_mode: server}", "grpo.vllm_mode: set by the pipeline (the rollout engine is set up from grpo.vllm)"),
    ("eval: {models: []}", "eval.models: must name at least one model: 'last' or stages before eval"),
    # The eval engine has its own section, eval.vllm: not GRPO's (no prefix caching there)
    ("eval: {vllm: {max_modle_len: 10}}", "eval.vllm.max_modle_len: unknown key (did you mean 'max_model_len'?)"),
    ("eval: {vllm: {enable_prefix_caching: true}}", "eval.vllm.enable_prefix_caching: unknown key (valid: "
     "gpu_memory_utilization, kv_cache_gib, max_num_seqs, dtype, enforce_eager, state_dtype, max_model_len, "
     "tensor_parallel_size)"),
    ("eval: {vllm: {dtype: bf16}}", "eval.vllm.dtype: expected one of 'auto', 'float32', 'bfloat16', 'float16', "
     "got str 'bf16' (did you mean 'bfloat16'?)"),
    ("eval: {vllm: {gpu_memory_utilization: 1.5}}", "eval.vllm.gpu_memory_utilization: must be in (0, 1], got 1.5"),
    ("grpo: {vllm: {gpu_memory_utilization: 0}}", "grpo.vllm.gpu_memory_utilization: must be in (0, 1], got 0"),
    ("eval: {max_tokens: 512, vllm: {max_model_len: 512}}", "eval.vllm.max_model_len: must exceed "
     "eval.max_tokens=512 (the context holds the prompt and the answer), got 512"),
    ("resources: {sft: {num_gpus: 1}}", "resources.sft.num_gpus: GPUs go to a stage with use_gpu: true (then "
     "num_gpus per worker, 1 when 0)"),
    ("grpo: {rewards: [{name: math_accuracy, weight: high}]}",
     "grpo.rewards[0].weight: expected float, got str 'high'"),
    ("grpo: {rewards: [{weight: 1.0}]}", "grpo.rewards[0].name: missing required key"),
    ("grpo: {rewards: math_accuracy}", "grpo.rewards: expected list of mapping, got str 'math_accuracy'"),
    ("model: {path: 3}", "model.path: expected str or null, got int 3"),
    ("grpo: {loss_type: dapoo}", "grpo.loss_type: expected one of 'grpo', 'dr_grpo', 'dapo', 'bnpo', 'cispo', "
     "'sapo', 'luspo', 'vespo', got str 'dapoo' (did you mean 'dapo'?)"),
    ("stages: [init, sft, rl]", "stages[2]: expected one of 'init', 'convert', 'sft', 'grpo', 'eval', got str 'rl'"),
    ("seed: true", "seed: expected int, got bool True"),
    ("sft: {packing: 1}", "sft.packing: expected bool, got int 1"),
    ("convert: {attention_layers: [1, x]}", "convert.attention_layers[1]: expected int, got str 'x'"),
    ("data: {eval: [{source: x.jsonl, limt: 3}]}", "data.eval[0].limt: unknown key (did you mean 'limit'?)"),
    ("data: {eval: [math50]}", "data.eval[0]: unknown eval set 'math50' (did you mean 'math500'?); name a "
     "benchmark or give a mapping with `source`"),
    ("model: {config: [1]}", "model.config: expected a mapping, got list [1]"),
    ("model: {fp32_master_weights: true}", "model.fp32_master_weights: needs model.dtype bfloat16 (with float32 "
     "the weights are float32 already)"),
    ("stages: [grpo, eval]", "stages: must start with init or convert, which give the later stages their model "
     "(init with model.init 'pretrained' starts from model.path), got ['grpo', 'eval']"),
    ("stages: [sft, init]", "stages: must be in the order init, convert, sft, grpo, eval without repeats, "
     "got ['sft', 'init']"),
    ("model: {init: pretrained}", "model.path: required when model.init is 'pretrained'"),
    ("grpo: {num_generations: 3}", "grpo.per_device_batch_size: per_device_batch_size * resources.grpo.num_workers "
     "* gradient_accumulation_steps = 8 completions per step must be a multiple of num_generations=3"),
    ("grpo: {warmup_ratio: 0.1}", "grpo.warmup_ratio: the constant schedule ignores warmup: use lr_scheduler: "
     "constant_with_warmup"),
    ("sft: {warmup_ratio: 1.5}", "sft.warmup_ratio: must be in [0, 1), got 1.5"),
    ("sft: {padding_free: true, max_length: 128}", "sft.max_length: must be null with padding_free and no packing "
     "(TRL truncates nothing then), got 128"),
    ("sft: {report_to: [tensorbord]}", "sft.report_to[0]: expected one of 'tensorboard', 'wandb', got str "
     "'tensorbord' (did you mean 'tensorboard'?)"),
    ("grpo: {reward_failure: {max_share: 0}}", "grpo.reward_failure.max_share: must be in (0, 1], got 0"),
    ("grpo: {reward_failure: {steps: 0}}", "grpo.reward_failure.steps: must be at least 1, got 0"),
    ("eval: {benchmarks: {aime_24: x.jsonl}}", "eval.benchmarks.aime_24: not a benchmark name (did you mean "
     "'aime24'?)"),
    ("data: {sft: {selection_field: ok}}", "data.sft.selection_field: marks the entries of candidates_field: set "
     "candidates_field too"),
    ("data: {sft: {candidates_field: gens, messages_field: m}}", "data.sft.candidates_field: the completion comes "
     "from either candidates_field or messages_field, not both"),
    ("trainer: {sharding: zero3}", "trainer.sharding: expected one of 'none', 'fsdp', got str 'zero3'"),
    ("trainer: {sharding: fsdp}", "trainer.sharding: fsdp shards the trainer state over the sft stage's workers: "
     "needs resources.sft.num_workers >= 2, got 1"),
    ("resources: {eval: {num_workers: 0}}", "resources.eval.num_workers: must be at least 1, got 0"),
    ("resources: {init: {num_workers: 2}}", "resources.init.num_workers: the init stage runs as one Ray task; only "
     "sft, grpo and eval spread over several workers, got 2"),
    ("trainer: {logprob_chunk_vocab: 0}", "trainer.logprob_chunk_vocab: must be at least 1, got 0"),
    ("sft: {fsdp_config: {version: 2}}", "sft.fsdp_config: set by the pipeline (trainer.sharding)"),
    ("grpo: {num_iterations: 4, save_steps: 10}", "grpo.save_steps: must be a multiple of num_iterations=4 (a "
     "checkpoint between two updates on one rollout batch could not resume exactly), got 10"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_config_names_file_and_key(tmp_path, text, message):
    # A valid model section unless the case is about the model section.
    path = _write(tmp_path, f"name: t\n{text}\n" + ("" if "model:" in text else "model: {tokenizer: {train: true}}\n"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: {message}"


def test_missing_required_and_not_a_mapping(tmp_path):
    path = _write(tmp_path, "seed: 1\n")
    with pytest.raises(ConfigError, match=rf"^{path}: name: missing required key$"):
        load_config(path)
    path = _write(tmp_path, "- a\n")
    with pytest.raises(ConfigError, match=rf"^{path}: expected a mapping at the top level, got list \['a'\]$"):
        load_config(path)


def test_yaml_problems(tmp_path):
    path = _write(tmp_path, "name: t\nseed: 1\nseed: 2\n")
    with pytest.raises(ConfigError, match=rf"^{path}: invalid YAML at line 3, column 1: duplicate key 'seed'$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_scientific_notation_is_a_float(tmp_path):
    cfg = load_config(_write(tmp_path, "name: t\nmodel: {tokenizer: {train: true}}\nsft: {learning_rate: 1e-4}\n"),
                      ["grpo.learning_rate=5e-7"])
    assert (cfg.sft.trl["learning_rate"], cfg.grpo.trl["learning_rate"]) == (1e-4, 5e-7)


def test_overrides(tmp_path):
    path = _write(tmp_path, "name: t\nmodel: {tokenizer: {train: true}, config: {hidden_size: 128}}\n")
    cfg = load_config(path, ["grpo.num_generations=4", "data.eval=[math500, aime24]",
                             "model.config.num_hidden_layers=2", "ray.address=auto", "model.path=null"])
    assert cfg.grpo.trl["num_generations"] == 4
    assert cfg.data.eval == ["math500", "aime24"]
    assert cfg.model.config == {"hidden_size": 128, "num_hidden_layers": 2}
    assert cfg.ray.address == "auto" and cfg.model.path is None
    for item, message in [
        ("grpo.num_generations=abc", "--set: grpo.num_generations: expected int or null, got str 'abc'"),
        ("grpo.num_genrations=8", "--set: grpo.num_genrations: unknown key (did you mean 'num_generations'?)"),
        ("grpo", "--set 'grpo': expected KEY=VALUE, e.g. --set grpo.num_generations=8"),
        ("name.x=1", "--set: name: is not a mapping, cannot set name.x"),
        ("seed.x=1", "--set: seed: expected int, got dict {'x': 1}"),
        # a cross-key rule names both the file that set one key and the override that set the other
        ("grpo.num_generations=3", f"{path} and --set: grpo.per_device_batch_size: per_device_batch_size * "
         "resources.grpo.num_workers * gradient_accumulation_steps = 8 completions per step must be a multiple of "
         "num_generations=3"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(path, [item])
        assert str(e.value) == message


def test_extends_merges_and_blames_the_right_file(tmp_path):
    base = _write(tmp_path, "name: base\nmodel: {tokenizer: {train: true}, config: {hidden_size: 64, a: 1}}\n"
                  "sft: {epochs: 3}\n", "base.yaml")
    child = _write(tmp_path, "extends: base.yaml\nname: child\nmodel: {config: {hidden_size: 32}}\n", "child.yaml")
    cfg = load_config(child)
    assert (cfg.name, cfg.sft.epochs, cfg.model.config) == ("child", 3.0, {"hidden_size": 32, "a": 1})
    base.write_text(base.read_text() + "grpo: {temperature: hot}\n")
    with pytest.raises(ConfigError, match=rf"^{base}: grpo.temperature: expected float, got str 'hot'$"):
        load_config(child)
    _write(tmp_path, "extends: child.yaml\nname: loop\n", "base.yaml")
    with pytest.raises(ConfigError, match="extends itself"):
        load_config(child)


def test_trl_settings_pass_through(tmp_path):
    """A TRL setting the pipeline has no key for reaches TRL's config as written; the pipeline's defaults hold where
    they differ from TRL's; the resolved config keeps TRL settings beside the section's own keys."""
    from pipeline.training import common_training_args

    path = _write(tmp_path, "name: t\nmodel: {tokenizer: {train: true}}\nsft: {adam_beta2: 0.95, epochs: 2}\n"
                  "grpo: {top_entropy_quantile: 0.2, loss_type: grpo}\n")
    cfg = load_config(path)
    assert cfg.sft.trl == {"learning_rate": 1e-5, "gradient_checkpointing": False, "save_steps": 100,
                           "adam_beta2": 0.95}
    args = common_training_args(cfg, cfg.sft, tmp_path / "sft")
    assert (args["adam_beta2"], args["learning_rate"], args["per_device_train_batch_size"]) == (0.95, 1e-5, 8)
    assert (cfg.grpo.trl["top_entropy_quantile"], cfg.grpo.trl["loss_type"]) == (0.2, "grpo")
    resolved = resolve(cfg)
    assert resolved["sft"]["adam_beta2"] == 0.95 and resolved["sft"]["epochs"] == 2 and "trl" not in resolved["sft"]
    assert config_from_dict(resolved) == cfg


def test_resolved_config_is_plain_yaml():
    cfg = load_config(CONFIGS[0].parent / "tiny.yaml")
    text = yaml.safe_dump(resolve(cfg))
    assert config_from_dict(yaml.safe_load(text)) == cfg
    assert cfg.run_dir == Path("runs/tiny")


def test_stage_cpu_threads():
    """Without a GPU a stage computes with resources.<stage>.num_threads, by default one fewer than its CPUs."""
    import torch

    from pipeline.config import StageResources
    from pipeline.orchestrator import limit_cpu_threads

    before = torch.get_num_threads()
    try:
        for res, threads in [(StageResources(num_cpus=3), 2), (StageResources(num_cpus=1), 1),
                             (StageResources(num_cpus=2, num_threads=2), 2)]:
            limit_cpu_threads(res)
            assert torch.get_num_threads() == threads, res
    finally:
        torch.set_num_threads(before)
    assert load_config(Path(__file__).parents[1] / "configs" / "tiny.yaml").resources.sft.num_threads == 2


def test_grpo_vllm_settings_reach_the_rollout_engine():
    """grpo.vllm.enforce_eager (off by default: vLLM's own default; on in the tiny config) and grpo.vllm.state_dtype
    (vLLM's mamba_ssm_cache_dtype) go to the GRPO engine's arguments."""
    from pipeline.config import VLLMSettings
    from pipeline.rollouts import engine_kwargs

    tiny = Path(__file__).parents[1] / "configs" / "tiny.yaml"
    assert VLLMSettings().enforce_eager is False
    assert engine_kwargs(load_config(tiny, ["grpo.vllm.enforce_eager=false"]), "m")["enforce_eager"] is False
    assert VLLMSettings().state_dtype == "auto"
    assert engine_kwargs(load_config(tiny), "m")["mamba_ssm_cache_dtype"] == "auto"
    with pytest.raises(ConfigError, match=r"grpo\.vllm\.state_dtype"):
        load_config(tiny, ["grpo.vllm.state_dtype=float16"])  # a long-memory state's sum can pass float16's range
    cfg = load_config(tiny, ["grpo.vllm.state_dtype=bfloat16"])
    assert engine_kwargs(cfg, "m")["enforce_eager"] is True
    assert engine_kwargs(cfg, "m")["mamba_ssm_cache_dtype"] == "bfloat16"


def test_the_eval_stage_builds_its_engines_from_eval_vllm_not_grpo_vllm(monkeypatch, tmp_path):
    import eval.workers as workers
    import pipeline.stages.evaluate as evaluate
    from eval.engine import EvalEngineSettings
    from pipeline.rundir import RunDir

    tiny = Path(__file__).parents[1] / "configs" / "tiny.yaml"
    grpo = ["grpo.vllm.state_dtype=bfloat16", "grpo.vllm.gpu_memory_utilization=0.2", "grpo.vllm.kv_cache_gib=3",
            "grpo.vllm.max_num_seqs=8", "grpo.vllm.enforce_eager=false", "grpo.vllm.dtype=bfloat16"]
    own = ["eval.vllm.state_dtype=float32", "eval.vllm.gpu_memory_utilization=0.6", "eval.vllm.max_model_len=512",
           "eval.vllm.max_num_seqs=16", "eval.vllm.kv_cache_gib=2"]
    cfg = load_config(tiny, ["eval.models=[last]", "eval.state_problems=0", *grpo, *own])
    built = []
    monkeypatch.setattr(workers, "build_llm", lambda path, settings, *, seed: built.append((path, settings, seed)))
    monkeypatch.setattr(evaluate, "evaluate", lambda engine, *a, **k: engine() or {})
    monkeypatch.setattr(evaluate, "changes", lambda *a, **k: {})
    # evaluate.run sets the process environment for its in-process engines; restored after the test, or every
    # vLLM engine started later from this process (tests/test_vllm_backend.py's worker) gets it
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    run = RunDir(tmp_path / "run")
    run.create()
    evaluate.run(cfg, run, "model")
    # dtype "auto" is model.dtype (float32 in the tiny config); enforce_eager is the tiny config's eval.vllm
    assert built == [("model", EvalEngineSettings(
        dtype="float32", state_dtype="float32", gpu_memory_utilization=0.6, max_model_len=512, max_num_seqs=16,
        kv_cache_gib=2, enforce_eager=True), cfg.seed)]


@pytest.mark.parametrize("installed", [False, True])
def test_report_to_reaches_trl_beside_metrics_when_the_tracker_is_installed(tmp_path, monkeypatch, installed):
    """`report_to` is checked for its package at validation (no network: the tracker itself is not started) and
    handed to TRL's TrainingArguments; metrics.jsonl is written either way (StageCallback)."""
    import importlib.util

    import trl

    from pipeline.training import common_training_args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (real("json") if installed else None) if name in ("tensorboard", "tensorboardX") else real(name, *a)))
    path = _write(tmp_path, "name: t\nmodel: {tokenizer: {train: true}}\nsft: {report_to: [tensorboard]}\n")
    if not installed:
        with pytest.raises(ConfigError, match=r"sft.report_to\[0\]: tensorboard is not installed here \(pip install "
                                              r"tensorboard\)$"):
            load_config(path)
        return
    cfg = load_config(path)
    args = common_training_args(cfg, cfg.sft, tmp_path)
    assert args["report_to"] == ["tensorboard"]
    assert trl.SFTConfig(**args).report_to == ["tensorboard"]
    assert common_training_args(cfg, cfg.grpo, tmp_path)["report_to"] == []  # per stage


def test_benchmark_names_map_to_local_files(tmp_path):
    from pipeline.config import eval_datasets
    from tasks.sources import BENCHMARKS

    path = _write(tmp_path, "name: t\nmodel: {tokenizer: {train: true}}\ndata: {eval: [aime24, amc23, math500]}\n"
                  "eval: {benchmarks: {aime24: /data/aime24.jsonl, amc23: {source: /data/amc23.jsonl}}}\n")
    aime24, amc23, math500 = eval_datasets(load_config(path))
    assert aime24.source == "/data/aime24.jsonl" and aime24.name == "aime24" and aime24.split == "train"
    assert amc23.source == "/data/amc23.jsonl" and amc23.name == "amc23" and amc23.prompt_field == "problem"
    assert math500 == "math500"  # not mapped: the hub copy
    assert BENCHMARKS["aime24"].source == "HuggingFaceH4/aime_2024"


def test_build_llm_passes_every_eval_engine_setting_to_vllm(monkeypatch):
    import sys
    from types import SimpleNamespace

    from eval.engine import EvalEngineSettings, build_llm

    calls = []
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=lambda **kwargs: calls.append(kwargs)))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # build_llm sets it: restored after the test
    settings = EvalEngineSettings(dtype="bfloat16", max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.5,
                                  kv_cache_gib=3, tensor_parallel_size=2, enforce_eager=True, state_dtype="float32")
    build_llm("ckpt", settings, seed=7)
    assert calls == [dict(model="ckpt", seed=7, dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                          gpu_memory_utilization=0.5, tensor_parallel_size=2, enforce_eager=True,
                          mamba_ssm_cache_dtype="float32")]
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"  # the CPU build reads the KV cache size from there
