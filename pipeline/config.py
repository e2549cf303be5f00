"""Run configuration: YAML files to frozen dataclasses, validated before any work starts.

A file may begin with `extends: other.yaml` (relative to the file): the other file is read first and this
file's keys are merged into it (mappings merge key by key; lists and scalars replace). `--set a.b=VALUE`
overrides are parsed with YAML scalar rules and merged the same way. Every error names where the bad value
came from and its dotted key: `configs/tiny.yaml: sft.learning_rate: expected float, got str 'abc'`.

The `sft` and `grpo` sections hold the pipeline's own keys (declared below) and TRL's: any other key there is
a field of `trl.SFTConfig` / `trl.GRPOConfig`, checked against that field's type (and choices) and passed
through to TRL as it is. TRL is the reference for those; a few it would take from the pipeline are refused.

`resolve(cfg)` gives the plain dict saved as a run's resolved config; `config_from_dict(resolve(cfg)) == cfg`.
"""
import dataclasses
import enum
import functools
import importlib.util
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

import yaml

from eval.engine import EngineSettings, EvalEngineSettings
from tasks import retrieval
from tasks.files import write_atomic
from tasks.sources import BENCHMARKS, DataSource, GeneratorSettings, describe
from tasks.sources import did_you_mean as _did_you_mean

Stage = Literal["init", "convert", "sft", "grpo", "eval"]
STAGES = typing.get_args(Stage)  # in the order they run


class ConfigError(ValueError):
    """A config that cannot run; the message names the file (or `--set`) and the dotted key."""


# ---------------------------------------------------------------------------------------------------- schema
# Defaults are a runnable middle ground; configs/*.yaml set what matters for each recipe.

@dataclass(frozen=True, kw_only=True)
class RuntimeEnvSettings:
    """Ray's runtime environment for every worker of the run (Ray's `runtime_env`): what a cluster's workers need
    that their image lacks, e.g. a reward module (`py_modules: [my_rewards]`) or this checkout (`working_dir: .`)."""

    working_dir: str | None = None  # a local directory, uploaded to every worker and made its working directory
    py_modules: list[str] | None = None  # local packages or modules (directories or .py files) importable on workers
    excludes: list[str] | None = None  # gitignore-style patterns left out of working_dir and py_modules
    env_vars: dict[str, str] | None = None  # environment variables of every worker
    pip: list[str] | None = None  # requirements installed into each worker's environment


@dataclass(frozen=True, kw_only=True)
class RaySettings:
    address: str | None = None  # None: start a local Ray instance; "auto" or "host:port" joins a cluster
    num_cpus: int | None = None  # for a local instance; None lets Ray detect
    num_gpus: int | None = None
    max_failures: int = 2  # restarts of a stage whose Ray worker died (Ray Train failure config / task retries)
    runtime_env: RuntimeEnvSettings | None = None


@dataclass(frozen=True, kw_only=True)
class TokenizerSettings:
    train: bool = False  # train a byte-level BPE on the SFT data (the embedded default)
    path: str | None = None  # None: the tokenizer of model.path / convert.source
    vocab_size: int = 512


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    init: Literal["scratch", "pretrained", "convert"] = "scratch"
    path: str | None = None  # checkpoint directory or hub id, for init: pretrained
    config: dict[str, Any] = field(default_factory=dict)  # sse_model.SSEConfig kwargs (or `preset`), for scratch
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    dtype: Literal["float32", "bfloat16"] = "float32"  # what the trainers compute in and the engines serve
    # With dtype bfloat16: keep float32 weights and optimizer state and compute under bf16 autocast (mixed
    # precision) instead of training the bf16 weights themselves. A bf16 weight of 0.02 moves in steps of 1.2e-4,
    # so updates the size of a GRPO learning rate of 1e-6 round away; checkpoints are then float32.
    fp32_master_weights: bool = False


@dataclass(frozen=True, kw_only=True)
class ConvertSettings:
    source: str | None = None  # pretrained Transformer (hub id or directory) to turn into SSE-H
    attention_every: int = 6  # keep one softmax-attention layer in every `attention_every`
    attention_layers: list[int] | None = None  # explicit layer indices instead of attention_every
    partitions: int = 4
    top_k: int = 1
    lora_rank: int = 64
    # Attention-output alignment (SILA; sse_model.convert.align_sse_layers): Adam steps per SSE layer fitting its
    # output to the replaced attention's on the source's hidden states. 0: off.
    align_steps: int = 0
    align_lr: float = 1e-3
    align_tokens: int = 8192  # calibration tokens the source samples for it


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    sft: DataSource = field(default_factory=DataSource)
    grpo: DataSource = field(default_factory=DataSource)
    # Names from BENCHMARKS, or full sources. Held-out problems reported by the eval stage.
    eval: list[DataSource | str] = field(default_factory=list)


LRScheduler = Literal["linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup"]
# Trackers a stage reports to beside the run's metrics.jsonl (TrainingArguments.report_to), and the package each needs.
Tracker = Literal["tensorboard", "wandb"]
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}

# TRL settings the pipeline sets itself, and from what; a config that sets one is refused (TRL would take the
# config's value or the pipeline's silently, and either way one of them would be ignored).
SET_BY_PIPELINE = {
    "output_dir": "the run directory",
    "seed": "the top-level seed",
    "data_seed": "the top-level seed",
    "bf16": "model.dtype",
    "use_cpu": "whether the stage's workers have a GPU",
    "save_strategy": "a checkpoint every save_steps",
    "save_only_model": "checkpoints keep optimizer, scheduler and RNG state, for exact resumes",
    "dataloader_num_workers": "0: the data position is part of the checkpoint, for exact resumes",
    "disable_tqdm": "the console draws the progress bar; the stage log gets one line per log",
    "resume_from_checkpoint": "the stage's last complete checkpoint",
    "per_device_train_batch_size": "from per_device_batch_size",
    "lr_scheduler_type": "from lr_scheduler",
    "warmup_steps": "from warmup_ratio",
    "fsdp": "trainer.sharding",
    "fsdp_config": "trainer.sharding",
}


@dataclass(frozen=True, kw_only=True)
class TokenWeightSettings:
    """SILA's token-weighted SFT loss (pipeline/token_weights.py): per-token weights from a reference Transformer's
    attention, blended in as the loss weight (1 - e^(-step/tau)) w + e^(-step/tau)."""

    reference: str | None = None  # an HF causal LM with the SFT model's tokenizer; None: convert.source
    threshold: float = 0.1  # attention probabilities at or below it do not count
    tau: float = 200.0  # optimizer steps; at step 0 the loss is plain next-token prediction


@dataclass(frozen=True, kw_only=True)
class SFTSettings:
    """The pipeline's own SFT keys. Any other key of the `sft` section is a field of `trl.SFTConfig`, checked
    against that field's type and passed through (`trl`); TRL's default holds for the fields not set here."""

    trl_class: ClassVar[str] = "SFTConfig"
    # Where the pipeline's default differs from TRL's.
    trl_defaults: ClassVar[dict] = {"learning_rate": 1e-5, "gradient_checkpointing": False, "save_steps": 100}
    set_by_pipeline: ClassVar[dict] = {**SET_BY_PIPELINE, "num_train_epochs": "from epochs",
                                       "completion_only_loss": "the loss is on the completion only"}
    trl_choices: ClassVar[dict] = {}

    epochs: float = 1.0
    lr_scheduler: LRScheduler = "cosine"
    warmup_ratio: float = 0.0  # fraction of steps; transformers 5 takes it as TrainingArguments.warmup_steps < 1
    per_device_batch_size: int = 8
    token_weights: TokenWeightSettings | None = None  # None: off
    report_to: list[Tracker] = field(default_factory=list)  # TensorBoard logs go to sft/runs/
    trl: dict[str, Any] = field(default_factory=lambda: dict(SFTSettings.trl_defaults))


@dataclass(frozen=True, kw_only=True)
class RewardSpec:
    name: str  # a registered reward, or "package.module:function"
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None  # seconds per batch in a killable worker (for rewards that may hang); None: in-process


@dataclass(frozen=True, kw_only=True)
class VLLMSettings(EngineSettings):
    """The GRPO rollout engine (TRL's colocated vLLM); the settings it shares with the eval engine are documented
    in eval/engine.py."""

    gpu_memory_utilization: float = 0.3  # the engine shares the GPU with the trainer
    enable_prefix_caching: bool = False
    # vLLM's sleep mode: between rollouts the engine drops its weights and its KV and SSE-state cache (level 2), so
    # the policy update has the GPU; it wakes for the next rollouts, takes the weights from the trainer and passes
    # the parity probe. GPU only (vLLM's CUDA memory pool); the CPU build keeps its memory.
    enable_sleep_mode: bool = False


@dataclass(frozen=True, kw_only=True)
class RewardFailureSettings:
    """When a reward that keeps failing stops the stage (rewards.registry.FailureLimit): failed (raised, timed out,
    returned no number) on more than `max_share` of a rollout batch's completions for `steps` batches in a row."""

    max_share: float = 0.5
    steps: int = 3


@dataclass(frozen=True, kw_only=True)
class GRPOSettings:
    """The pipeline's own GRPO keys. Any other key of the `grpo` section is a field of `trl.GRPOConfig`, checked
    against that field's type and passed through (`trl`); TRL's default holds for the fields not set here."""

    trl_class: ClassVar[str] = "GRPOConfig"
    # Where the pipeline's default differs from TRL's, and the settings the pipeline reads itself (the batch and
    # checkpoint rules in `_check`, the rollout engine's context length).
    trl_defaults: ClassVar[dict] = {
        "learning_rate": 1e-6, "gradient_checkpointing": False, "save_steps": 50, "logging_steps": 1,
        "max_completion_length": 1024, "num_generations": 8, "num_iterations": 1, "gradient_accumulation_steps": 1,
        "top_p": 1.0}
    set_by_pipeline: ClassVar[dict] = {
        **SET_BY_PIPELINE, "max_steps": "from steps", "reward_weights": "the weights in grpo.rewards",
        "use_vllm": "rollouts come from the colocated vLLM engine of grpo.vllm",
        **{key: "the rollout engine is set up from grpo.vllm" for key in (
            "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization",
            "vllm_max_model_length", "vllm_tensor_parallel_size", "vllm_server_base_url", "vllm_server_host",
            "vllm_server_port", "vllm_server_timeout", "vllm_group_port")}}
    # TRL types these as plain strings and checks the value only at the first loss computation, hours in.
    trl_choices: ClassVar[dict] = {
        "loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
        "scale_rewards": ("group", "batch", "none"),
        "importance_sampling_level": ("token", "sequence")}

    steps: int = 100
    lr_scheduler: LRScheduler = "constant"
    warmup_ratio: float = 0.0  # a fresh Adam's first updates are sign-sized on every weight: warm up
    # Counted in completions, as in TRL: per_device_batch_size * workers * gradient_accumulation_steps
    # completions per optimizer step, which must hold whole groups of num_generations.
    per_device_batch_size: int = 8
    max_prompt_length: int = 512
    long_prompts: Literal["skip", "error"] = "skip"  # prompts over max_prompt_length: skipped and counted, or refused
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec(name="math_accuracy")])
    reward_failure: RewardFailureSettings | None = field(default_factory=RewardFailureSettings)  # None: never stop
    report_to: list[Tracker] = field(default_factory=list)  # TensorBoard logs go to grpo/runs/
    eval_every: int | None = None  # run the eval stage's datasets every N steps
    parity_threshold: float = 0.1  # largest |logprob(vLLM) - logprob(trainer)| allowed after a weight push
    # The trainer's forwards select the partitions the rollout engine chose for each token (docs/pipeline.md,
    # "Partition replay and routing health"); route_flip_rate logs how often the trainer's own choice differs.
    partition_replay: bool = False
    route_flip_rate: bool = False
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    trl: dict[str, Any] = field(default_factory=lambda: dict(GRPOSettings.trl_defaults))


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """How the SFT and GRPO trainers hold their state and score tokens (docs/configs-and-data.md, "Sharded
    trainer state and log-probabilities")."""

    # "fsdp": float32 master weights, gradients and Adam state sharded over the stage's workers (FSDP2 through
    # accelerate); the weight push gathers one parameter at a time. "none": every worker holds all of it (DDP).
    sharding: Literal["none", "fsdp"] = "none"
    # TRL's fused LM head scores tokens in [tokens, vocab] tiles of the compute dtype instead of [T, V] float32
    # logits; the defaults are TRL's.
    logprob_chunk_tokens: int = 4096
    logprob_chunk_vocab: int = 32768


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    n: int = 32  # samples per problem (avg@n)
    temperature: float = 1.0
    top_p: float = 0.7
    max_tokens: int = 32768
    limit: int | None = None  # first N problems of each dataset
    # Benchmark names (data.eval entries) read from local data instead of the hub: {aime24: path/aime24.jsonl}, or
    # a full source ({amc23: {source: path, prompt_field: problem}}) where the columns differ from the hub copy's.
    benchmarks: dict[str, str | DataSource] = field(default_factory=dict)
    # Which models the eval stage scores: "last" (the newest model of the run), or stage names whose model to
    # compare (e.g. [init, sft, grpo]: untrained, after SFT, after GRPO).
    models: list[Literal["last", "init", "convert", "sft", "grpo"]] = field(default_factory=lambda: ["last"])
    # State diagnostics (eval/state.py): the singular-value entropy of each SSE partition's state after this many
    # problems of each dataset (prompt + first sample), in the report; 0 turns them off.
    state_problems: int = 8
    # The eval stage's engine (`sse-rl eval` takes the same settings as options); grpo.eval_every samples with the
    # rollout engine of grpo.vllm instead.
    vllm: EvalEngineSettings = field(default_factory=EvalEngineSettings)


@dataclass(frozen=True, kw_only=True)
class StageResources:
    # Ray Train workers of sft and grpo; eval's engines (one process each, in the stage's one Ray task); the other
    # stages run as one Ray task
    num_workers: int = 1
    num_cpus: float = 1.0  # per worker
    num_threads: int | None = None  # torch CPU threads per worker without a GPU; None: num_cpus - 1, at least 1
    num_gpus: float = 0.0  # per worker
    use_gpu: bool = False  # num_gpus GPUs per worker (1 when num_gpus is 0)


@dataclass(frozen=True, kw_only=True)
class ResourceSettings:
    init: StageResources = field(default_factory=StageResources)
    convert: StageResources = field(default_factory=StageResources)
    sft: StageResources = field(default_factory=StageResources)
    grpo: StageResources = field(default_factory=StageResources)
    eval: StageResources = field(default_factory=StageResources)


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str
    seed: int = 0
    output_dir: str = "runs"
    stages: list[Stage] = field(default_factory=lambda: ["init", "sft", "grpo", "eval"])
    ray: RaySettings = field(default_factory=RaySettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    convert: ConvertSettings = field(default_factory=ConvertSettings)
    data: DataSettings = field(default_factory=DataSettings)
    sft: SFTSettings = field(default_factory=SFTSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    resources: ResourceSettings = field(default_factory=ResourceSettings)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


def eval_datasets(cfg: Config) -> list[DataSource | str]:
    """`data.eval` with the benchmark names that `eval.benchmarks` maps to local data replaced by those sources."""
    def local(entry):
        given = cfg.eval.benchmarks.get(entry) if isinstance(entry, str) else None
        if given is None:
            return entry
        if isinstance(given, str):
            return dataclasses.replace(BENCHMARKS[entry], source=given)
        return dataclasses.replace(given, name=given.name or entry)

    return [local(entry) for entry in cfg.data.eval]


# ---------------------------------------------------------------------------------------------------- loading

def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config (following `extends`), apply `--set KEY=VALUE` overrides, validate."""
    origins: dict[str, str] = {}  # dotted key -> file (or "--set") that set it, for error messages
    raw = _read(Path(path), origins, chain=())
    for item in overrides:
        _apply_override(raw, item, origins)
    return config_from_dict(raw, source=str(path), origins=origins)


def config_from_dict(data: dict, source: str = "<dict>", origins: dict[str, str] | None = None) -> Config:
    origins = origins or {}
    try:
        if not isinstance(data, dict):
            raise _Invalid("", f"expected a mapping at the top level, got {describe(data)}")
        cfg = _convert(Config, data, "")
        _check(cfg)
    except _Invalid as e:
        # Name every place that set a key involved (a cross-key rule may span a file and --set).
        places = [_origin(k, origins, source) for k in (e.key, *e.related)]
        raise ConfigError(f"{' and '.join(dict.fromkeys(places))}: {e.key or '<top>'}: {e.message}") from None
    return cfg


def resolve(cfg: Config) -> dict:
    """The plain dict (YAML-safe) of every setting, defaults included; a section's TRL settings sit beside its own
    keys, as in the file."""
    return _plain(cfg)


def _plain(value):
    if dataclasses.is_dataclass(value):
        out = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "trl"}
        out.update(getattr(value, "trl", {}))
        return out
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def save_config(cfg: Config, path: str | Path) -> None:
    write_atomic(path, yaml.safe_dump(resolve(cfg), sort_keys=False))  # a resume reads it: never half-written


class _Invalid(Exception):
    def __init__(self, key: str, message: str, related: Sequence[str] = ()):
        self.key, self.message, self.related = key, message, related


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-5` as a float (YAML 1.2; PyYAML's 1.1 rules make it a string) and refuses
    duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)[eE][-+]?\d+$"),
    list("-+.0123456789"),
)


def _parse_yaml(text: str, where: str):
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark, context = getattr(e, "problem_mark", None), getattr(e, "context", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: invalid YAML{at}: {problem}" + (f" ({context})" if context else "")) from None


def _read(path: Path, origins: dict[str, str], chain: tuple[Path, ...]) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file" + (f" (extended by {chain[-1]})" if chain else ""))
    if path.resolve() in chain:
        raise ConfigError(f"{path}: extends itself through {' -> '.join(map(str, chain))}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    data = _parse_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {describe(data)}")
    parent = data.pop("extends", None)
    merged = {}
    if parent is not None:
        if not isinstance(parent, str):
            raise ConfigError(f"{path}: extends: expected str, got {describe(parent)}")
        merged = _read(path.parent / parent, origins, chain + (path.resolve(),))
    _merge(merged, data, str(path), origins, "")
    return merged


def _merge(base: dict, top: dict, where: str, origins: dict[str, str], prefix: str) -> None:
    for k, v in top.items():
        key = _join(prefix, k)
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v, where, origins, key)
        else:
            base[k] = v
            for old in [o for o in origins if o.startswith(key + ".") or o.startswith(key + "[")]:
                del origins[old]
            origins[key] = where


def _apply_override(raw: dict, item: str, origins: dict[str, str]) -> None:
    key, eq, text = item.partition("=")
    if not eq or not key:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set grpo.num_generations=8")
    *parents, last = key.strip().split(".")
    node = raw
    for depth, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set: {'.'.join(parents[:depth + 1])}: is not a mapping, cannot set {key}")
    _merge(node, {last: _parse_yaml(text, f"--set {key}")}, "--set", origins, ".".join(parents))


# ---------------------------------------------------------------------------------------------------- checks

def _convert(tp, value, key: str):
    """Check `value` against the type hint `tp`, building dataclasses; raise _Invalid naming the key."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Invalid(key, f"expected a mapping, got {describe(value)}")
        return _build(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(option, value, key)
            except _Invalid as e:
                errors.append(e)
        # An error inside a nested value (a mapping that almost fits) says more than "expected X or Y".
        deeper = [e for e in errors if e.key != key]
        raise deeper[0] if deeper else _Invalid(key, f"expected {_type_name(tp)}, got {describe(value)}")
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        hint = _did_you_mean(value, [str(a) for a in args]) if isinstance(value, str) else ""
        raise _Invalid(key, f"expected {_type_name(tp)}, got {describe(value)}{hint}")
    if origin is list:
        if not isinstance(value, list):
            raise _Invalid(key, f"expected {_type_name(tp)}, got {describe(value)}")
        return [_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Invalid(key, f"expected a mapping, got {describe(value)}")
        return {k: _convert(args[1], v, _join(key, k)) for k, v in value.items()}
    if tp in (dict, list):  # TRL's untyped containers
        if not isinstance(value, tp):
            raise _Invalid(key, f"expected {_type_name(tp)}, got {describe(value)}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):  # transformers' option enums: their values
        return _convert(Literal[tuple(m.value for m in tp)], value, key)
    # bool is an int subclass and YAML writes `yes`/`true` as bool: keep numbers and flags apart.
    checks = {bool: lambda: isinstance(value, bool),
              int: lambda: isinstance(value, int) and not isinstance(value, bool),
              float: lambda: isinstance(value, (int, float)) and not isinstance(value, bool),
              str: lambda: isinstance(value, str)}
    ok = checks[tp]() if tp in checks else isinstance(value, tp)  # another class: a YAML value never is one
    if not ok:
        raise _Invalid(key, f"expected {_type_name(tp)}, got {describe(value)}")
    return value


def _build(cls, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "trl"}  # `trl` is not a key of its own
    trl_class = getattr(cls, "trl_class", None)
    passed = {k: v for k, v in data.items() if k not in fields} if trl_class else {}
    for k in data:
        if k not in fields and not trl_class:
            raise _Invalid(_join(prefix, k), f"unknown key{_did_you_mean(str(k), list(fields), show_all=True)}")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _Invalid(key, "missing required key")
    if trl_class:
        kwargs["trl"] = {**cls.trl_defaults, **_trl_settings(cls, passed, prefix, list(fields))}
    return cls(**kwargs)


def _trl_settings(cls, data: dict, prefix: str, own_keys: list[str]) -> dict:
    """Check a section's keys that are not the pipeline's own against the TRL config class's fields."""
    fields = trl_fields(cls.trl_class)
    out = {}
    for k, value in data.items():
        key = _join(prefix, k)
        if k in cls.set_by_pipeline:
            raise _Invalid(key, f"set by the pipeline ({cls.set_by_pipeline[k]})")
        if k not in fields:
            close = _did_you_mean(str(k), own_keys + [f for f in fields if f not in cls.set_by_pipeline])
            raise _Invalid(key, f"unknown key{close}" if close else f"unknown key: neither a key of the pipeline "
                           f"({', '.join(own_keys)}) nor a field of trl.{cls.trl_class}")
        hint, choices = fields[k]
        choices = cls.trl_choices.get(k, choices)
        if choices:
            hint = Literal[tuple(choices)] | None if type(None) in typing.get_args(hint) else Literal[tuple(choices)]
        out[k] = _convert(hint, value, key)
    return out


@functools.cache
def trl_fields(name: str) -> dict[str, tuple[Any, tuple | None]]:
    """{field: (type hint, allowed values or None)} of `trl.<name>`, TRL's own declaration of its settings.
    Imported on first use: TRL brings torch and transformers (seconds), which the modules that import this one
    for its dataclasses (the data loaders, `sse-rl eval`) do not need."""
    import trl

    cls = getattr(trl, name)
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], tuple(f.metadata["choices"]) if f.metadata.get("choices") else None)
            for f in dataclasses.fields(cls) if f.init}


def _check(cfg: Config) -> None:
    """Rules across keys that types cannot express; each would otherwise fail hours into a run."""
    def require(ok: bool, key: str, message: str, related: Sequence[str] = ()):
        if not ok:
            raise _Invalid(key, message, related)

    stages = cfg.stages
    require(bool(stages), "stages", "must list at least one stage")
    require(len(set(stages)) == len(stages) and stages == sorted(stages, key=STAGES.index),
            "stages", f"must be in the order {', '.join(STAGES)} without repeats, got {stages}")
    require(not {"init", "convert"} <= set(stages), "stages", "use either init or convert, not both")
    require(not cfg.model.fp32_master_weights or cfg.model.dtype == "bfloat16", "model.fp32_master_weights",
            "needs model.dtype bfloat16 (with float32 the weights are float32 already)", ["model.dtype"])
    require(stages[0] in ("init", "convert"), "stages", f"must start with init or convert, which give the later "
            f"stages their model (init with model.init 'pretrained' starts from model.path), got {stages}")
    require(("convert" in stages) == (cfg.model.init == "convert"), "model.init",
            "must be 'convert' exactly when stages include convert", ["stages"])
    require(cfg.model.init != "convert" or cfg.convert.source is not None, "convert.source",
            "required when model.init is 'convert'", ["model.init"])
    require(cfg.model.init != "pretrained" or cfg.model.path is not None, "model.path",
            "required when model.init is 'pretrained'", ["model.init"])
    require(cfg.model.init != "scratch" or cfg.model.tokenizer.train or cfg.model.tokenizer.path is not None,
            "model.tokenizer.path", "required when model.init is 'scratch' and tokenizer.train is false",
            ["model.init", "model.tokenizer.train"])
    g, trl = cfg.grpo, cfg.grpo.trl
    generations = trl["num_generations"]
    require(generations is not None and generations >= 2, "grpo.num_generations",
            f"must be at least 2, got {generations}")
    batch = g.per_device_batch_size * cfg.resources.grpo.num_workers * trl["gradient_accumulation_steps"]
    require(batch % generations == 0, "grpo.per_device_batch_size",
            f"per_device_batch_size * resources.grpo.num_workers * gradient_accumulation_steps = {batch} "
            f"completions per step must be a multiple of num_generations={generations}",
            ["grpo.num_generations", "resources.grpo.num_workers", "grpo.gradient_accumulation_steps"])
    # TRL keeps the rollout batch it reuses in memory only: a resume must start where a new batch is generated.
    iterations, save_steps = trl["num_iterations"], trl["save_steps"]
    require(iterations >= 1 and save_steps % iterations == 0, "grpo.save_steps",
            f"must be a multiple of num_iterations={iterations} (a checkpoint between two updates on one "
            f"rollout batch could not resume exactly), got {save_steps}", ["grpo.num_iterations"])
    require(trl["max_completion_length"] is not None, "grpo.max_completion_length",
            "must be set: it sizes the rollout engine's context")
    sft_trl = cfg.sft.trl
    require(not sft_trl.get("padding_free") or sft_trl.get("packing") or sft_trl.get("max_length") is None,
            "sft.max_length", f"must be null with padding_free and no packing (TRL truncates nothing then), got "
            f"{sft_trl.get('max_length')}", ["sft.padding_free", "sft.packing"])
    for stage, settings in (("sft", cfg.sft), ("grpo", g)):
        ratio = settings.warmup_ratio
        require(0 <= ratio < 1, f"{stage}.warmup_ratio", f"must be in [0, 1), got {ratio}")
        require(not ratio or settings.lr_scheduler != "constant", f"{stage}.warmup_ratio",
                "the constant schedule ignores warmup: use lr_scheduler: constant_with_warmup",
                [f"{stage}.lr_scheduler"])
    _check_sila(cfg, require)
    for stage in ("sft", "grpo"):
        for i, tracker in enumerate(getattr(cfg, stage).report_to):
            require(any(importlib.util.find_spec(m) for m in TRACKER_PACKAGES[tracker]), f"{stage}.report_to[{i}]",
                    f"{tracker} is not installed here (pip install {TRACKER_PACKAGES[tracker][0]})")
    limit = g.reward_failure
    if limit is not None:
        require(0 < limit.max_share <= 1, "grpo.reward_failure.max_share", f"must be in (0, 1], got {limit.max_share}")
        require(limit.steps >= 1, "grpo.reward_failure.steps", f"must be at least 1, got {limit.steps}")
    for name in cfg.eval.benchmarks:
        require(name in BENCHMARKS, f"eval.benchmarks.{name}",
                f"not a benchmark name{_did_you_mean(name, list(BENCHMARKS), show_all=True)}")
    _check_trainer(cfg, require)
    require(0 < cfg.eval.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {cfg.eval.top_p}")
    require(0 < trl["top_p"] <= 1, "grpo.top_p", f"must be in (0, 1], got {trl['top_p']}")
    require(bool(cfg.eval.models), "eval.models", "must name at least one model: 'last' or stages before eval")
    _check_engines(cfg, require)
    for stage in STAGES:
        res = getattr(cfg.resources, stage)
        require(res.num_workers >= 1, f"resources.{stage}.num_workers", f"must be at least 1, got {res.num_workers}")
        require(res.num_workers == 1 or stage in ("sft", "grpo", "eval"), f"resources.{stage}.num_workers",
                f"the {stage} stage runs as one Ray task; only sft, grpo and eval spread over several workers, "
                f"got {res.num_workers}")
        require(not res.num_gpus or res.use_gpu, f"resources.{stage}.num_gpus",
                "GPUs go to a stage with use_gpu: true (then num_gpus per worker, 1 when 0)",
                [f"resources.{stage}.use_gpu"])
    if "eval" in stages:
        for i, model in enumerate(cfg.eval.models):
            require(model == "last" or model in stages[:stages.index("eval")], f"eval.models[{i}]",
                    f"{model!r} is not a stage that runs before eval in this config ({', '.join(stages)})",
                    ["stages"])
    for key, src in [("data.sft", cfg.data.sft), ("data.grpo", cfg.data.grpo),
                     *((f"data.eval[{i}]", e) for i, e in enumerate(cfg.data.eval) if isinstance(e, DataSource))]:
        _check_task(src.generator, f"{key}.generator", src.source)
        require(src.selection_field is None or src.candidates_field is not None, f"{key}.selection_field",
                "marks the entries of candidates_field: set candidates_field too", [f"{key}.candidates_field"])
        require(src.candidates_field is None or src.messages_field is None, f"{key}.candidates_field",
                "the completion comes from either candidates_field or messages_field, not both",
                [f"{key}.messages_field"])
        if src.generator.task == "mqar" and src.generator.options.get("format") == "zoology":
            # A code sequence has no prompt to generate from: SFT trains on it, eval scores it teacher-forced.
            require(key != "data.grpo", "data.grpo.generator.options.format", "zoology is for SFT and eval only "
                    "(GRPO generates answers to prompts); use format: prose")
            require(key == "data.sft" or cfg.eval.n == 1, "eval.n", f"{key} is Zoology-format MQAR, scored "
                    f"teacher-forced with one greedy prediction per query: n must be 1, got {cfg.eval.n}",
                    [f"{key}.generator.options.format"])
    for i, entry in enumerate(cfg.data.eval):
        if isinstance(entry, str):
            require(entry in BENCHMARKS, f"data.eval[{i}]",
                    f"unknown eval set {entry!r}{_did_you_mean(entry, list(BENCHMARKS), show_all=True)}; "
                    "name a benchmark or give a mapping with `source`")


def _check_engines(cfg: Config, require) -> None:
    """The vLLM engines of GRPO (grpo.vllm) and eval (eval.vllm)."""
    for key, v in (("grpo.vllm", cfg.grpo.vllm), ("eval.vllm", cfg.eval.vllm)):
        require(0 < v.gpu_memory_utilization <= 1, f"{key}.gpu_memory_utilization",
                f"must be in (0, 1], got {v.gpu_memory_utilization}")
    e = cfg.eval
    require(e.vllm.max_model_len is None or e.vllm.max_model_len > e.max_tokens, "eval.vllm.max_model_len",
            f"must exceed eval.max_tokens={e.max_tokens} (the context holds the prompt and the answer), got "
            f"{e.vllm.max_model_len}", ["eval.max_tokens"])


def _check_sila(cfg: Config, require) -> None:
    """SILA's tools (sft.token_weights, convert.align_*)."""
    c = cfg.convert
    require(c.align_steps >= 0, "convert.align_steps", f"must be at least 0 (0: no alignment), got {c.align_steps}")
    if c.align_steps:
        require(c.align_lr > 0, "convert.align_lr", f"must be positive, got {c.align_lr}")
        require(c.align_tokens > 0, "convert.align_tokens", f"must be positive, got {c.align_tokens}")
    w = cfg.sft.token_weights
    if w is None:
        return
    require(w.reference is not None or cfg.model.init == "convert", "sft.token_weights.reference",
            "required unless model.init is 'convert' (then convert.source is the reference)", ["model.init"])
    require(0 <= w.threshold < 1, "sft.token_weights.threshold", f"must be in [0, 1), got {w.threshold}")
    require(w.tau > 0, "sft.token_weights.tau", f"must be positive (steps), got {w.tau}")
    # Weights are computed per example; packing would put several examples in one sequence.
    require(not cfg.sft.trl.get("packing"), "sft.token_weights", "cannot be combined with packing (weights are "
            "computed per example); padding_free batches work", ["sft.packing"])
    loss = cfg.sft.trl.get("loss_type", "nll")
    require(loss == "nll", "sft.token_weights", f"weights the nll loss only, got loss_type {loss!r}",
            ["sft.loss_type"])


def _check_trainer(cfg: Config, require) -> None:
    """trainer.*: sharding needs workers to shard over."""
    t = cfg.trainer
    for name in ("logprob_chunk_tokens", "logprob_chunk_vocab"):
        require(getattr(t, name) >= 1, f"trainer.{name}", f"must be at least 1, got {getattr(t, name)}")
    if t.sharding == "none":
        return
    for stage in ("sft", "grpo"):
        workers = getattr(cfg.resources, stage).num_workers
        require(stage not in cfg.stages or workers >= 2, "trainer.sharding", f"{t.sharding} shards the trainer "
                f"state over the {stage} stage's workers: needs resources.{stage}.num_workers >= 2, got {workers}",
                [f"resources.{stage}.num_workers"])


def _check_task(g: GeneratorSettings, key: str, src_kind: str) -> None:
    """The generator's task and its options (tasks.retrieval checks a recall task's)."""
    if g.task == "arithmetic":
        if g.options:
            raise _Invalid(f"{key}.options", "the arithmetic task takes levels and in_head_probability, not options")
        return
    default = GeneratorSettings()
    if src_kind != "generator":
        raise _Invalid(f"{key}.task", f"a task needs source: generator, got source {src_kind!r}")
    for name in ("levels", "in_head_probability"):
        if getattr(g, name) != getattr(default, name):
            raise _Invalid(f"{key}.{name}", f"applies to the arithmetic task only, not {g.task}", [f"{key}.task"])
    try:
        retrieval.check_options(g.task, g.options)
    except retrieval.TaskOptionError as e:
        raise _Invalid(f"{key}.{e.key}", e.message) from None


# ---------------------------------------------------------------------------------------------------- helpers

def _join(prefix: str, key) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _origin(key: str, origins: dict[str, str], default: str) -> str:
    """Where `key` was set: by itself or an enclosing key, else by a key inside it (`--set a.b=1` on a missing
    `a` builds the mapping `a`), else the top file."""
    for k in _prefixes(key):
        if k in origins:
            return origins[k]
    return next((v for k, v in origins.items() if k.startswith((key + ".", key + "["))), default)


def _prefixes(key: str):
    """'a.b[0].c' -> 'a.b[0].c', 'a.b[0]', 'a.b', 'a'."""
    while key:
        yield key
        key = key[:max(key.rfind("."), key.rfind("["), 0)]


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if dataclasses.is_dataclass(tp) or origin is dict:
        return "mapping"
    return tp.__name__
