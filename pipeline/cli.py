"""`sse-rl`: the one command line of the project.

    sse-rl run CONFIG [--set key=value ...]   run the stages a config lists (init/convert, sft, grpo, eval)
    sse-rl resume RUN_DIR                      continue a run from its last complete checkpoint
    sse-rl eval --model CKPT ...               avg@k evaluation through vLLM
    sse-rl convert --from SRC --to DST ...     turn a pretrained Transformer into SSE-H
"""
import argparse
import sys


def _not_yet(name: str):
    def run(argv):
        sys.exit(f"sse-rl {name}: not yet available in this version")
    return run


def _lazy(module: str, function: str):
    """Subcommands import their stack (vLLM, TRL, Ray) only when used, so `sse-rl --help` stays instant."""
    def run(argv):
        import importlib
        return getattr(importlib.import_module(module), function)(argv)
    return run


COMMANDS = {
    "run": ("run the stages a config lists", _not_yet("run")),
    "resume": ("continue a run directory from its last complete checkpoint", _not_yet("resume")),
    "eval": ("avg@k evaluation of a checkpoint through vLLM", _not_yet("eval")),
    "convert": ("convert a pretrained Transformer checkpoint into SSE-H", _not_yet("convert")),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="sse-rl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[0]}" for k, v in COMMANDS.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the command (see sse-rl COMMAND --help)")
    ns = parser.parse_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    return COMMANDS[ns.command][1](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
