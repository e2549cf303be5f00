"""`sse-rl eval`: avg@k evaluation of a checkpoint through vLLM (see eval/runner.py and docs/rewards-and-eval.md)."""
import argparse
import dataclasses
import logging
import sys
import typing

from eval.engine import EngineDtype, EvalEngineSettings, StateDtype
from eval.runner import evaluate, markdown_report
from eval.workers import EngineProcesses, EngineSpec, engines_for


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sse-rl eval", description="Sample n answers per problem with vLLM, grade "
                                "them, and write per-sample JSONL, metrics.json and results.md into --out.")
    p.add_argument("--model", required=True, help="checkpoint directory (or Hugging Face model id)")
    p.add_argument("--datasets", default="aime24,aime25,math500",
                   help="comma-separated benchmark names (aime24, aime25, math500, amc23; recall sets such as "
                   "mqar_test, niah_word_4k, s_niah_uuid_8k: docs/retrieval.md) or .jsonl/.parquet paths")
    p.add_argument("--out", required=True, help="output directory; rerunning into it resumes")
    p.add_argument("--n", type=int, default=32, help="samples per problem")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=32768, help="generation limit per sample")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; -1 for unseeded sampling")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N problems of each dataset")
    p.add_argument("--batch-problems", type=int, default=64, help="problems per generate call (and per save)")
    p.add_argument("--grading-timeout", type=float, default=5.0, help="seconds per answer check")
    p.add_argument("--engines", type=int, default=None,
                   help="engines sharing the work, one process each on its own --tensor-parallel-size GPUs "
                   "(default: as many as the visible GPUs hold; 1 without GPUs)")
    # The engine options are eval.vllm's settings (eval/engine.py), with their defaults.
    default = EvalEngineSettings()
    engine = p.add_argument_group("vLLM engine")
    engine.add_argument("--dtype", choices=typing.get_args(EngineDtype), default=default.dtype,
                        help="auto: the checkpoint's")
    engine.add_argument("--max-model-len", type=int, default=default.max_model_len,
                        help="context length (default: the model's max_position_embeddings)")
    engine.add_argument("--max-num-seqs", type=int, default=default.max_num_seqs,
                        help="sequences decoded together (default: vLLM's)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=default.gpu_memory_utilization,
                        help="on the CPU build: a fraction of RAM, unless --kv-cache-gib is given")
    engine.add_argument("--kv-cache-gib", type=int, default=default.kv_cache_gib,
                        help="KV cache size in GiB on the CPU build (VLLM_CPU_KVCACHE_SPACE)")
    engine.add_argument("--tensor-parallel-size", type=int, default=default.tensor_parallel_size)
    engine.add_argument("--enforce-eager", action="store_true", default=default.enforce_eager,
                        help="no compilation or CUDA graphs (starts faster)")
    engine.add_argument("--state-dtype", choices=typing.get_args(StateDtype), default=default.state_dtype,
                        help="SSE state storage (vLLM's mamba_ssm_cache_dtype): auto is int16 fixed point for a "
                             "16-bit engine, float32 otherwise; bfloat16 drifts over long generations")
    return p


def engine_settings(args: argparse.Namespace) -> EvalEngineSettings:
    """The engine options, as the eval stage's `eval.vllm` section."""
    return EvalEngineSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EvalEngineSettings)})


def eval_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.n < 1 or args.max_tokens < 1 or args.batch_problems < 1 or (args.engines or 1) < 1:
        _parser().error("--n, --max-tokens, --batch-problems and --engines must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    seed = None if args.seed < 0 else args.seed
    spec = EngineSpec(args.model, engine_settings(args), seed=seed or 0)
    engines, per = engines_for(args.tensor_parallel_size, args.engines)
    results = evaluate(spec.build, [d.strip() for d in args.datasets.split(",") if d.strip()], args.out, n=args.n,
                       temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=seed,
                       limit=args.limit, batch_problems=args.batch_problems, grading_timeout=args.grading_timeout,
                       model_name=args.model, engines=engines, launch=EngineProcesses(spec, per))
    print(markdown_report(results))
    return 0


if __name__ == "__main__":  # vLLM's spawned workers re-import the main module: keep the engine behind this guard
    sys.exit(eval_main())
