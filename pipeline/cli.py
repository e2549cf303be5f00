"""`sse-rl`: the one command line of the project.

    sse-rl run CONFIG [--set key=value ...]   run the stages a config lists (init/convert, sft, grpo, eval)
    sse-rl resume RUN_DIR [--set key=value]    continue a run from its last complete checkpoint
    sse-rl eval --model CKPT ...               avg@k evaluation through vLLM
    sse-rl convert --from SRC --to DST ...     turn a pretrained Transformer into SSE-H
"""
import argparse
import sys
from pathlib import Path

VERBOSE_HELP = "also print the libraries' output (Ray, vLLM, TRL, ...), which goes to RUN_DIR/logs/<stage>.log"


def run_main(argv) -> int:
    parser = argparse.ArgumentParser(prog="sse-rl run", description="Run the stages a config lists; running "
                                     "the same command again resumes the run.")
    parser.add_argument("config", help="YAML config (configs/tiny.yaml is the embedded CPU default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set grpo.num_generations=8 (repeatable)")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    args = parser.parse_args(argv)
    return _run("sse-rl run", args.config, args.overrides, None, args.verbose)


def resume_main(argv) -> int:
    parser = argparse.ArgumentParser(prog="sse-rl resume", description="Continue a run directory: finished "
                                     "stages are skipped, the unfinished one continues from its last checkpoint.")
    parser.add_argument("run_dir", help="runs/<name>")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="correct a key of a stage not finished yet, e.g. --set data.grpo.source=data/grpo.jsonl "
                        "(repeatable); the manifest records the change")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    args = parser.parse_args(argv)
    config = Path(args.run_dir) / "config.yaml"
    if not config.exists():
        print(f"sse-rl resume: {config} not found: not a run directory", file=sys.stderr)
        return 1
    return _run("sse-rl resume", config, args.overrides, Path(args.run_dir), args.verbose)


def _run(prog: str, config, overrides, run_dir, verbose: bool) -> int:
    """Validate the config and what it names (pipeline/preflight.py), then run; a resume (`run_dir` given) may
    change keys of stages not finished yet."""
    from pipeline.config import ConfigError, load_config
    from pipeline.console import Console
    from pipeline.orchestrator import RayUnreachable, StageFailed, config_changes, run_pipeline
    from pipeline.preflight import preflight
    from pipeline.rundir import RunDir, RunLocked

    try:
        cfg = load_config(config, overrides)
        existing = RunDir(run_dir or cfg.run_dir)
        config_changes(cfg, existing, amend=run_dir is not None)  # again under the run's lock, when it starts
        preflight(cfg, str(config), existing.finished())
        run_pipeline(cfg, run_dir, Console.of_stdout(verbose), amend=run_dir is not None)
    except (ConfigError, StageFailed, RunLocked, RayUnreachable) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    return 0


def _lazy(module: str, function: str):
    """Subcommands import their stack (vLLM, TRL, Ray) only when used, so `sse-rl --help` stays instant."""
    def run(argv):
        import importlib
        return getattr(importlib.import_module(module), function)(argv)
    return run


COMMANDS = {
    "run": ("run the stages a config lists", run_main),
    "resume": ("continue a run directory from its last complete checkpoint", resume_main),
    "eval": ("avg@k evaluation of a checkpoint through vLLM", _lazy("eval.cli", "eval_main")),
    "convert": ("convert a pretrained Transformer checkpoint into SSE-H", _lazy("sse_model.convert", "convert_main")),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="sse-rl", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("command", choices=list(COMMANDS),
                            help="; ".join(f"{k}: {v[0]}" for k, v in COMMANDS.items()))
        parser.parse_args(argv)
        return 2
    return COMMANDS[argv[0]][1](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
