"""What `sse-rl run` and `sse-rl resume` check before the first stage starts, beyond the config's own rules
(pipeline/config.py): every stage's data opened (its first rows read and converted, so a missing file or column
shows), every reward resolved (a registered name or `module:function`, its options bound against the function's
signature), the starting checkpoint and the model's context against GRPO's, and whether the tokenizer's chat
template lets SFT train on whole assistant turns. Each of these would otherwise fail when its stage starts, maybe
after hours of SFT. Errors name the config file, the dotted key and, for a near miss, what was probably meant.
"""
from collections.abc import Mapping

from pipeline.config import Config, ConfigError, eval_datasets
from pipeline.orchestrator import MODEL_STAGES
from tasks.loaders import DataError, benchmark_source, is_code_sequence, preview
from tasks.prompts import sft_template_problem


def preflight(cfg: Config, source: str, done: Mapping[str, str | None] | None = None) -> None:
    """Raise ConfigError for the first problem found; `done`: {stage: output} of the stages the run directory has
    finished already (a resume), which are not checked again."""
    done = done or {}
    todo = [stage for stage in cfg.stages if stage not in done]

    def fail(key: str, message: str):
        raise ConfigError(f"{source}: {key}: {message}")

    if "grpo" in todo:
        _check_rewards(cfg, fail)
    for key, src, kind in _sources(cfg, todo):
        try:
            preview(src, kind)
        except DataError as e:
            fail(key, str(e))
    if "init" in todo and cfg.model.init == "pretrained":
        _check_checkpoint(cfg, fail)
    if "sft" in todo and not is_code_sequence(cfg.data.sft):
        _check_sft_template(cfg, done, fail)


def _sources(cfg: Config, todo: list[str]):
    """(dotted key, DataSource, "sft" or "rl") of the data the stages in `todo` read."""
    if "sft" in todo or "init" in todo and cfg.model.init == "scratch" and cfg.model.tokenizer.train:
        yield "data.sft", cfg.data.sft, "sft"  # init trains its tokenizer on the SFT data
    if "grpo" in todo:
        yield "data.grpo", cfg.data.grpo, "rl"
    if "eval" in todo or "grpo" in todo and cfg.grpo.eval_every:
        for i, (given, src) in enumerate(zip(cfg.data.eval, eval_datasets(cfg))):
            mapped = isinstance(given, str) and given in cfg.eval.benchmarks
            yield f"eval.benchmarks.{given}" if mapped else f"data.eval[{i}]", benchmark_source(src), "rl"


def _check_rewards(cfg: Config, fail) -> None:
    import rewards

    for i, spec in enumerate(cfg.grpo.rewards):
        try:
            rewards.get_reward(spec.name)
        except (KeyError, ImportError, AttributeError) as e:
            fail(f"grpo.rewards[{i}].name", e.args[0] if isinstance(e, KeyError) else str(e))
        try:
            rewards.build_reward(spec.name, spec.kwargs, timeout=spec.timeout)
        except (ValueError, TypeError) as e:
            fail(f"grpo.rewards[{i}].kwargs", str(e))
    try:
        rewards.build_rewards(cfg.grpo.rewards)
    except ValueError as e:
        fail("grpo.rewards", str(e))


def _check_checkpoint(cfg: Config, fail) -> None:
    from pipeline.stages.init import CheckpointError, check_rollout_length, check_sse_checkpoint

    try:
        check_rollout_length(cfg, check_sse_checkpoint(cfg.model.path))
    except CheckpointError as e:
        fail("model.path", str(e))
    except ValueError as e:
        fail("grpo.max_completion_length", str(e))


def _check_sft_template(cfg: Config, done: Mapping[str, str | None], fail) -> None:
    """The tokenizer SFT will use: the output of the last finished model stage, else what init or convert takes."""
    m = cfg.model
    finished = [done[s] for s in MODEL_STAGES if done.get(s)]
    if finished:
        key, path = "model", finished[-1]
    elif m.init == "scratch":
        if m.tokenizer.train:  # trained here with the project's template (tasks/tokenizer.py)
            return
        key, path = "model.tokenizer.path", m.tokenizer.path
    elif m.init == "pretrained":
        key, path = "model.path", m.path
    else:
        key, path = "convert.source", cfg.convert.source
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        fail(key, f"cannot load the tokenizer of {path}: {e}")
    problem = sft_template_problem(tokenizer)
    if problem:
        fail(key, f"the chat template of {path} {problem}. SFT trains on the whole assistant turn, reasoning "
                  "included: give the tokenizer a template that keeps it (`chat_template` in its "
                  "tokenizer_config.json; tasks/tokenizer.py's CHAT_TEMPLATE is one)")
