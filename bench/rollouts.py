"""GRPO-style rollout throughput in vLLM: SSE-H against Qwen3 of the same width, depth and heads, same GPU, same
run, vLLM's default engine (engine-core process, torch.compile, CUDA graphs, chunked prefill, async scheduling).

    python -m bench.rollouts [--shape small|1b] [--lengths 1024 4096 16384] [--prompts 32] [--n 8]
                             [--repeats R] [--interleave] [--step-clock [--host-profile]]
                             [--out bench/runs] [--add EARLIER.json ...] [--baseline]

Shapes: `small` (12 layers of 1024, where the first GPU measurement was made; at ~0.2B parameters a decode step
is mostly vLLM's host-side work for both models) and `1b` (24 layers of 2048, 16 query and 8 KV heads of 128:
Qwen3-1.7B's width and heads at 24 layers, ~1.3B parameters, where the GPU's work dominates as in real rollouts).
Both models have random bf16 weights (speed does not depend on them); prompts are random 256-token ids, every
request generates exactly the asked number of tokens (ignore_eos) at temperature 1, n rollouts per prompt. Each
model runs in its own process (unless `--interleave`), so engine start (time to a ready `vllm.LLM`) is measured from
a cold process and memory is freed between models. Reported per model: start seconds, output tokens/s per
generation length, vLLM's own "maximum concurrency" at the longest length (how many such sequences its cache
holds), and cache bytes per sequence (SSE state + attention KV) from the config. `SSE-H` stores its states as
vLLM's default gives them to a bf16 model (int16 fixed point, sse_model/vllm/engine.py); `SSE-H-f32-states` and
`SSE-H-bf16-states` are the same SSE-H with float32 and bfloat16 states (vLLM's `mamba_ssm_cache_dtype`;
`--models SSE-H SSE-H-f32-states Qwen3`), and `SSE-H-v1-runner` the default SSE-H on vLLM's V1 model runner
(`VLLM_USE_V2_MODEL_RUNNER=0`; the plugin asks for V2 on a GPU). The report names each model's runner.
With `--engine '{"enable_logging_iteration_details": true}'` the report also says, per timed generation, how many
engine steps ran and how long the engine waited for their model outputs (`step_waits`): host-bound or stalled.
That logging is host work on every step, so it moves host-bound ratios: on one H200 the 1.5B at 1k gave 0.84x
logged and 0.71x without it (4757613:bench/results/sse_int16_states_20261128.md); take speed ratios from unlogged runs.

The report is written again after each model, under one name per run, so a run cut short (a device call's time
limit, a machine taken back) keeps the models that finished; `--add` joins them to a later run's.

`--repeats R` times every length R times in the same engine and reports the median run, with the slowest run's
tokens/s over the fastest's beside it: two 1k runs of the 1.5B on one H200 gave SSE-H 25.5k and 28.0k tokens/s
(4757613:bench/results/vllm_states_manager_gpu_20261128.md), so one 1k figure is worth about +-5 %.

`--interleave` runs all models in one process, each in its own engine on the shared GPU (`gpu_memory_utilization`
0.9 / models each, unless `--engine` sets it), and times them in turn: each of the R rounds times every model once
per length, the order reversed every other round, and the report adds each round's ratio to Qwen3. Without it the
models run one after the other, and at 1k, where both engines' decode steps wait on the host, the host's time per
step moves between generations (a 1.5B's steps took 6.9-9.7 ms on one H200 for the same 6.7 ms of kernels,
4757613:bench/results/vllm_1k_interleaved_20261129.md), so one model's runs can fall in a slow spell. Use it where every
model's cache holds all sequences in its share (1k: yes; 4k and longer: compare the "max concurrent sequences" row
with prompts x n).

`--step-clock` times every decode step of the timed runs in vLLM's worker (bench/step_clock.py: the host's
period, the GPU's span and idle time from CUDA events, kernel time over a profiled window of 32 steps, the garbage
collector's pauses) and adds a line per run to the report; `--host-profile` also writes a cProfile of the engine
core's thread per run to the worker's log. Both cost host time: take tokens/s from runs without them.

`--prompts-long P --long-from L` runs lengths >= L with P prompts instead (both models alike): at 16k a Qwen3 of
this size holds ~80 sequences in an 80 GB GPU, so 32 x 8 rollouts take it several minutes.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench import step_clock
from bench.baseline import REPO, RUNS, command, write_baseline
from bench.decode import floor_bytes

COMMON = dict(head_dim=128, vocab_size=32000, max_position_embeddings=40960, tie_word_embeddings=False)
SHAPES = {
    # the shape of the first measurement (docs/vllm-backend.md)
    "small": dict(COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=8,
                  num_key_value_heads=8),
    "1b": dict(COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=16,
               num_key_value_heads=8),
}
# SSE-H: an attention layer after every 5 SSE layers (default_layer_types), n4k1 with a shared partition, SSE heads
# as many as the query heads.
SSE = dict(sse_num_partitions=4, sse_top_k=1, sse_shared_partition=True, sse_lora_rank=64, attention_qk_norm=True)
PROMPT_TOKENS = 256
# Per-model vllm.LLM settings on top of --engine.
MODEL_ENGINE = {"SSE-H-f32-states": dict(mamba_ssm_cache_dtype="float32"),
                "SSE-H-bf16-states": dict(mamba_ssm_cache_dtype="bfloat16")}
# Per-model environment of the worker process: vLLM chooses its model runner from the environment only.
MODEL_ENV = {"SSE-H-v1-runner": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
MODELS = ["SSE-H", "SSE-H-f32-states", "SSE-H-bf16-states", "SSE-H-v1-runner", "Qwen3"]


def configs(shape: str = "small"):
    from transformers import Qwen3Config

    from sse_model import SSEConfig
    from sse_model.configuration_sse import default_layer_types
    dims = SHAPES[shape]
    sse_h = SSEConfig(**dims, **SSE, layer_types=default_layer_types(dims["num_hidden_layers"]))
    return {"SSE-H": sse_h, "SSE-H-f32-states": sse_h, "SSE-H-bf16-states": sse_h, "SSE-H-v1-runner": sse_h,
            "Qwen3": Qwen3Config(**dims, rope_parameters={"rope_type": "default", "rope_theta": 1e6})}


def cache_per_sequence(name, config) -> tuple[int, int]:
    """(SSE state bytes, bf16 KV bytes per token of context) of one sequence: the states of all partitions of all
    SSE layers in the engine's state dtype (constant; what the plugin sizes max_num_seqs by), the KV of every
    attention layer."""
    from types import SimpleNamespace

    from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER
    from sse_model.vllm.engine import state_bytes_per_sequence, state_dtype
    kinds = getattr(config, "layer_types", None) or [ATTENTION_LAYER] * config.num_hidden_layers
    engine = {**dict(mamba_ssm_cache_dtype="auto", mamba_cache_dtype="auto"), **MODEL_ENGINE.get(name, {})}
    dtype = state_dtype(SimpleNamespace(**engine), torch.bfloat16)  # the engines run bf16
    state = state_bytes_per_sequence(config, 1, dtype) if SSE_LAYER in kinds else 0
    return state, 2 * config.num_key_value_heads * config.head_dim * 2 * sum(kind != SSE_LAYER for kind in kinds)


def cache_bytes_per_sequence(name, config, tokens: int) -> int:
    """SSE states plus bf16 KV of a sequence of `tokens`."""
    state, kv_per_token = cache_per_sequence(name, config)
    return state + kv_per_token * tokens


def streamed_weights(config) -> int:
    """Parameters a decode step reads whole: all but the input embedding, of which only the batch's rows are read."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()


def decode_bytes_per_token(name, config, weights: int, length: int, sequences: int) -> float:
    """HBM bytes a decode step reads and writes per sequence, averaged over a generation of `length` tokens after
    the prompt, with `sequences` decoding at once: the bf16 `weights` (streamed_weights) once per step, shared by
    the batch, the K + shared touched partitions of the SSE states read and written, the attention layers' bf16 KV
    read at the context reached. Both models' decode steps are bandwidth-bound at these batches, so the ratio of
    two models' bytes bounds the ratio of their tokens/s (the report's "bandwidth bound" row)."""
    state, kv_per_token = cache_per_sequence(name, config)
    parts = floor_bytes(config, sequences, PROMPT_TOKENS + (length - 1) / 2, 2 * weights, state, kv_per_token)
    return sum(parts.values()) / sequences


def prompts_at(args, length: int) -> int:
    """Prompts a generation of `length` tokens runs with: `--prompts-long` from `--long-from` on."""
    return args.prompts_long if length >= args.long_from else args.prompts


class Engine:
    """One model's vllm.LLM and its generations: random 256-token prompts (a generator of its own, seeded alike
    for every model, so all models get the same prompts in the same order), n rollouts each, exactly `length` new
    tokens at temperature 1."""

    def __init__(self, name, path, args, **engine):
        from vllm import LLM

        self.name, self.args = name, args
        started = time.perf_counter()
        self.llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                       max_model_len=PROMPT_TOKENS + max(args.lengths), **engine)
        self.start_s = time.perf_counter() - started
        self.g = torch.Generator().manual_seed(0)
        self.timed = {}
        self.step_clock = getattr(args, "step_clock", False)
        if self.step_clock:
            import cloudpickle
            cloudpickle.register_pickle_by_value(step_clock)  # the engine-core process need not import it
            self.llm.collective_rpc(step_clock.install)

    def run(self, prompts, length) -> tuple[float, float]:
        """(output tokens/s, seconds) of one generation."""
        from vllm import SamplingParams

        batch = [{"prompt_token_ids": torch.randint(0, COMMON["vocab_size"], (PROMPT_TOKENS,),
                                                    generator=self.g).tolist()} for _ in range(prompts)]
        params = SamplingParams(n=self.args.n, temperature=1.0, max_tokens=length, min_tokens=length,
                                ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        out = self.llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for o in out for c in o.outputs)
        assert tokens == prompts * self.args.n * length, (tokens, prompts, self.args.n, length)
        return tokens / elapsed, elapsed

    def warm_up(self) -> None:
        """First prefill and sampling (kernel compilation and tuning), and a prefill-only batch, whose kernels
        would otherwise compile inside the timed probe. (At most max_model_len's new tokens: vLLM stops there.)"""
        self.run(self.args.prompts, min(64, max(self.args.lengths)))
        self.run(self.args.prompts, 1)

    def time_length(self, length) -> None:
        """One timed generation of `length` tokens, after a probe of its prefill."""
        prompts = prompts_at(self.args, length)
        # One new token on fresh prompts: the batch's prefill (vLLM reuses a prompt's cached blocks across the
        # n rollouts of a Transformer, not of a hybrid whose prompts are shorter than its state block).
        _, prefill_s = self.run(prompts, 1)
        if self.step_clock:
            self.llm.collective_rpc(step_clock.start, args=(length // 2, self.args.host_profile))
        print(f"TIMED {self.name} {length} begin", flush=True)  # brackets the engine's iteration log lines
        tps, elapsed = self.run(prompts, length)
        print(f"TIMED {self.name} {length} end", flush=True)
        decode_tps = prompts * self.args.n * (length - 1) / max(elapsed - prefill_s, 1e-9)
        timed = dict(tokens_per_s=tps, seconds=elapsed, prefill_s=prefill_s, decode_tokens_per_s=decode_tps)
        self.timed.setdefault(length, []).append(timed)
        print(f"[{self.name}] {prompts} x {self.args.n} x {length}: {tps:,.0f} tokens/s ({elapsed:.1f} s; prefill "
              f"{prefill_s:.2f} s, {decode_tps:,.0f} tokens/s after it)", flush=True)
        if self.step_clock:
            timed["step_clock"] = self.llm.collective_rpc(step_clock.take)[0]
            print(f"[{self.name}] {step_clock.describe(timed['step_clock'])}", flush=True)
            if host_profile := timed["step_clock"].pop("host_profile"):  # to the log, not the report
                print(f"[{self.name}] host profile of the engine core, {length} new tokens:\n{host_profile}",
                      flush=True)

    def result(self) -> str:
        """The line run_models reads: RESULT name {start, runner, the median run per length}."""
        speed = {length: dict(prompts=prompts_at(self.args, length), **median_run(runs))
                 for length, runs in self.timed.items()}
        runner = "V2" if self.llm.llm_engine.vllm_config.use_v2_model_runner else "V1"
        return f"RESULT {self.name} " + json.dumps(dict(start_s=self.start_s, model_runner=runner, speed=speed))


def worker(args) -> None:
    """The models of one worker process: start their engines, warm up, generate at each length; print a RESULT
    line per model. One model (the default), or several in turn (`--interleave`): every round times each model
    once per length, the order reversed every other round."""
    engines = []
    for name, path in zip(args.names, args.paths):
        engine = dict(json.loads(args.engine), **MODEL_ENGINE.get(name, {}))
        if args.interleave:  # the engines share the GPU's memory
            engine.setdefault("gpu_memory_utilization", round(0.9 / len(args.names), 3))
        engines.append(Engine(name, path, args, **engine))
    for engine in engines:
        engine.warm_up()
    for length in args.lengths:
        for r in range(args.repeats):
            for engine in engines if r % 2 == 0 else engines[::-1]:
                engine.time_length(length)
    for engine in engines:
        print(engine.result(), flush=True)


def median_run(timed: list[dict]) -> dict:
    """The run of median tokens/s (the slower middle one of an even count) stands for its length, with every
    run's tokens/s and seconds beside it (the spread; the engine-step counts cover all the runs)."""
    median = sorted(timed, key=lambda t: t["tokens_per_s"])[(len(timed) - 1) // 2]
    runs = dict(runs_tokens_per_s=[t["tokens_per_s"] for t in timed], runs_seconds=[t["seconds"] for t in timed])
    if any("step_clock" in t for t in timed):
        runs["runs_step_clock"] = [t.get("step_clock") for t in timed]
    return dict(median, **runs)


ITERATION = re.compile(r"iteration elapsed time: ([\d.]+) ms")


def step_waits(text: str, name: str) -> dict:
    """Per timed length of model `name`, from the engine's iteration log (engine argument
    `enable_logging_iteration_details`): how many steps it ran and how long the engine core waited for their model
    outputs. With async scheduling that wait is the time the GPU side was behind the host: near zero for a
    host-bound run; a few long waits mean stalls (e.g. kernels compiling mid-run). The worker brackets each timed
    generation with TIMED lines naming its model (interleaved engines take turns, so the lines between belong to
    that model's engine)."""
    waits, length = {}, None
    for line in text.splitlines():
        if line.startswith("TIMED "):
            _, model, n, edge = line.split()
            length = n if edge == "begin" and model == name else None
        elif length and (found := ITERATION.search(line)):
            waits.setdefault(length, []).append(float(found.group(1)))
    return {n: dict(steps=len(w), waited_s=sum(w) / 1e3, longest_ms=max(w)) for n, w in waits.items()}


def run_models(names, paths, args, log: Path) -> dict:
    """Runs `names` (checkpoints at `paths`) in one worker process, its output to `log`; returns each model's
    result, with vLLM's "maximum concurrency" and the engine-step waits when logged."""
    if args.interleave and (alone := [n for n in names if n in MODEL_ENV]):
        raise ValueError(f"{alone} need an environment of their own (MODEL_ENV): they cannot be interleaved")
    cmd = [sys.executable, "-m", "bench.rollouts", "--worker", "--names", *names, "--paths", *map(str, paths),
           "--engine", args.engine, "--n", str(args.n), "--prompts", str(args.prompts),
           "--prompts-long", str(args.prompts_long), "--long-from", str(args.long_from), "--repeats",
           str(args.repeats), "--lengths", *map(str, args.lengths)] + (["--interleave"] if args.interleave else []) \
        + (["--step-clock"] if args.step_clock else []) + (["--host-profile"] if args.host_profile else [])
    env = dict(os.environ)
    if args.step_clock:  # collective_rpc sends the clock's functions to the engine-core process pickled
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    for name in names:
        env.update(MODEL_ENV.get(name, {}))
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, text=True, env=env,
                              cwd=REPO)
    text = log.read_text()
    results = {}
    for line in text.splitlines():
        if line.startswith("RESULT "):
            _, name, found = line.split(" ", 2)
            results[name] = json.loads(found)
    if proc.returncode or set(results) != set(names):
        raise RuntimeError(f"{', '.join(names)} failed (exit {proc.returncode}); last lines of {log}:\n"
                           + "\n".join(text.splitlines()[-30:]))
    # vLLM logs how many sequences of max_model_len its cache holds, once per engine, in the order they started
    found = re.findall(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.,]+)x", text)
    for name, result in results.items():
        result["max_concurrency"] = float(found[names.index(name)][1].replace(",", "")) \
            if len(found) == len(names) else None
        if waits := step_waits(text, name):
            result["engine_steps"] = waits
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompts-long", type=int, default=32)
    p.add_argument("--long-from", type=int, default=1 << 30)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1,
                   help="time each length this many times in the same engine and report the median run")
    p.add_argument("--models", nargs="+", default=["SSE-H", "Qwen3"], choices=MODELS)
    p.add_argument("--engine", default="{}", help="extra vllm.LLM keyword arguments as JSON (default: none)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=RUNS, help="the raw run's folder")
    p.add_argument("--baseline", action="store_true",
                   help="overwrite bench/results/rollouts_<shape>_<k>k.json for every length both SSE-H and Qwen3 ran")
    p.add_argument("--add", type=Path, nargs="+", default=[],
                   help="JSON reports of earlier runs (same shape and lengths, e.g. on the same GPU when one device "
                        "call cannot hold every model): their models join this report's table")
    p.add_argument("--interleave", action="store_true",
                   help="all models in one process, their engines sharing the GPU, timed in turn")
    p.add_argument("--step-clock", action="store_true",
                   help="time every engine step of the timed runs and profile a window of them "
                        "(bench/step_clock.py); the report adds a line per run")
    p.add_argument("--host-profile", action="store_true",
                   help="with --step-clock: cProfile the engine core's thread in each timed run, the table to the "
                        "worker's log (slows the host: no tokens/s from such a run)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--names", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--paths", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.host_profile and not args.step_clock:
        p.error("--host-profile needs --step-clock")
    if args.worker:
        return worker(args)

    from transformers import AutoModelForCausalLM

    args.out.mkdir(parents=True, exist_ok=True)
    args.started = datetime.now(timezone.utc)  # names the run's one report, rewritten after each worker
    results, cfgs = {}, configs(args.shape)
    # one worker per model, or one for all of them
    workers = [args.models] if args.interleave else [[name] for name in args.models]
    with tempfile.TemporaryDirectory() as tmp:
        for names in workers:
            paths = [Path(tmp) / name for name in names]
            for name, path in zip(names, paths):
                torch.manual_seed(0)
                AutoModelForCausalLM.from_config(cfgs[name], dtype=torch.bfloat16).save_pretrained(path)
            log = args.out / f"rollouts_{args.shape}_{'interleaved' if args.interleave else names[0]}.log"
            try:
                results.update(run_models(names, paths, args, log))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"{', '.join(names)}: {e}", flush=True)
                results.update({name: dict(error=str(e)[-2000:]) for name in names})
            markdown = write_report(results, args)  # a run cut short keeps the models that finished
    print(markdown)
    if args.baseline:
        report = json.loads(report_stem(args, args.started).with_suffix(".json").read_text())
        for configuration, baseline in baselines(report).items():
            write_baseline(configuration, command=command("bench.rollouts", argv), **baseline)


def report_stem(args, now: datetime) -> Path:
    """The run's report path less its suffix: one name per run (`args.started`), rewritten after each worker."""
    return args.out / f"rollouts_{args.shape}_{getattr(args, 'started', now):%Y%m%d-%H%M}"


def baselines(report: dict) -> dict[str, dict]:
    """`write_baseline`'s arguments per configuration `rollouts_<shape>_<k>k`: every generation length that both
    SSE-H and Qwen3 ran in `report`, a row per model that ran it, the headline SSE-H / Qwen3 output tokens/s."""
    results, out = report["results"], {}
    for length in sorted({n for r in results.values() for n in r.get("speed", {})}, key=int):
        ran = [m for m in MODELS if length in results.get(m, {}).get("speed", {})]
        if not {"SSE-H", "Qwen3"} <= set(ran):
            continue
        speed = {m: results[m]["speed"][length] for m in ran}
        rows = [{"model": m, "rollouts": f"{speed[m]['prompts']} x {report['n']}",
                 "output tokens/s": round(speed[m]["tokens_per_s"]),
                 "tokens/s after the prefill": round(speed[m].get("decode_tokens_per_s") or 0) or None,
                 "engine start s": round(results[m]["start_s"], 1)} for m in ran]
        shape = report["shape"]
        out[f"rollouts_{shape['name']}_{int(length) // 1024}k"] = dict(
            device=report["device"], date=report["date"][:10],
            title=f"Rollouts in vLLM {report['vllm']}, shape {shape['name']} ({shape['num_hidden_layers']} layers of "
                  f"{shape['hidden_size']}), {report['prompt_tokens']}-token prompts, {length} new tokens each, "
                  f"bf16{', models interleaved in one process' if report.get('interleaved') else ''}",
            rows=rows, headline=dict(label=f"SSE-H / Qwen3 rollout tokens/s, {int(length) // 1024}k tokens",
                                     value=round(speed["SSE-H"]["tokens_per_s"] / speed["Qwen3"]["tokens_per_s"], 2)))
    return out


def write_report(results: dict, args) -> str:
    """The run's JSON and Markdown reports under `args.out` (with the models of `args.add` reports joined);
    returns the Markdown."""
    import transformers
    import vllm

    cfgs = configs(args.shape)
    args.out.mkdir(parents=True, exist_ok=True)
    added = {}
    for earlier in args.add:
        for name, result in json.loads(earlier.read_text())["results"].items():
            added.setdefault(name, dict(result, from_report=earlier.name))
    results = {**added, **results}
    now = datetime.now(timezone.utc)
    longest = PROMPT_TOKENS + max(args.lengths)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = dict(date=now.isoformat(timespec="seconds"), device=device,
                  vllm=vllm.__version__, torch=torch.__version__, transformers=transformers.__version__,
                  shape=dict(SHAPES[args.shape], name=args.shape), sse=SSE, prompt_tokens=PROMPT_TOKENS, n=args.n,
                  engine=json.loads(args.engine), interleaved=args.interleave,
                  cache_mib_per_sequence={name: cache_bytes_per_sequence(name, cfgs[name], longest) / 2**20
                                          for name in cfgs},
                  results=results)
    stem = report_stem(args, now)
    dims, sse_h = SHAPES[args.shape], cfgs["SSE-H"]
    attention_at = [i for i, kind in enumerate(sse_h.layer_types) if kind != "linear_attention"]
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Rollouts in vLLM {vllm.__version__}: SSE-H vs Qwen3, {report['device']}, {report['date']}", "",
             f"bf16, random weights, shape `{args.shape}`: {dims['num_hidden_layers']} layers x "
             f"{dims['hidden_size']}, {dims['num_attention_heads']} query / {dims['num_key_value_heads']} KV heads "
             f"of {dims['head_dim']}; SSE-H n{SSE['sse_num_partitions']}k{SSE['sse_top_k']} + shared, attention at "
             f"{', '.join(map(str, attention_at))}; {PROMPT_TOKENS}-token prompts x n = {args.n}, "
             f"temperature 1; engine: vLLM defaults{' + ' + args.engine if args.engine != '{}' else ''}.", ""]
    lines += [f"{name} from the earlier run {result['from_report']}." for name, result in results.items()
              if "from_report" in result] + [""]
    if args.interleave:
        lines += ["Interleaved (`--interleave`): the models' engines in one process, sharing the GPU's memory "
                  "(`gpu_memory_utilization` 0.9 / models unless set), each round timing every model once per length, "
                  "the order reversed every other round, so the host's variation between generations falls on "
                  "all alike; engine starts are one after another in that process.", ""]
    models = [m for m in MODELS if m in results and m != "Qwen3"] + ["Qwen3"]
    lines += ["vLLM model runner: " + ", ".join(f"{m} {results[m].get('model_runner', 'not recorded')}"
                                                for m in models if m in results) + ".", ""]
    lines += ["| measure | " + " | ".join(models) + " | " + " | ".join(f"{m} / Qwen3" for m in models[:-1]) + " |",
              "| --- |" + " ---: |" * (2 * len(models) - 1)]

    def row(label, get, fmt, inverse=False):
        """get(model name) -> number, or None where that model failed or did not run (its cell says which);
        `inverse`: the ratio column is Qwen3's value over the model's (bytes, where less is faster)."""
        vals = []
        for model in models:
            try:
                vals.append(get(model))
            except (KeyError, TypeError):
                vals.append(None)
        ratios = [f"{(vals[-1] / v if inverse else v / vals[-1]):.2f}" if v and vals[-1] else "" for v in vals[:-1]]
        missing = ["not run" if model not in results else "failed" if "error" in results[model] else "n/a"
                   for model in models]
        lines.append(f"| {label} | " + " | ".join(m if v is None else fmt.format(v) for v, m in zip(vals, missing))
                     + " | " + " | ".join(ratios) + " |")

    row("engine start, s", lambda m: results[m]["start_s"], "{:.0f}")
    weights = {m: streamed_weights(cfgs[m]) for m in models}
    for length in args.lengths:
        prompts = prompts_at(args, length)
        row(f"output tokens/s, {prompts} prompts x {args.n} x {length} tokens",
            lambda m, k=str(length): results[m]["speed"][k]["tokens_per_s"], "{:,.0f}")
        if args.repeats > 1:
            row(f"  slowest / fastest of {args.repeats} runs (the row above: their median)",
                lambda m, k=str(length): min(results[m]["speed"][k]["runs_tokens_per_s"])
                / max(results[m]["speed"][k]["runs_tokens_per_s"]), "{:.3f}")
        row("  of which prefill, s (a 1-token run)", lambda m, k=str(length): results[m]["speed"][k]["prefill_s"],
            "{:.2f}")
        row("  tokens/s after the prefill", lambda m, k=str(length): results[m]["speed"][k]["decode_tokens_per_s"],
            "{:,.0f}")
        # Sequences decoding at once: all of them, or as many as vLLM's cache holds (its figure is for the longest
        # length; at a shorter one a KV-bound cache holds proportionally more).
        def at_once(m, n=length, p=prompts):
            held = results[m].get("max_concurrency")
            return min(p * args.n, held * longest / (PROMPT_TOKENS + n)) if held else p * args.n
        row("  decode MB moved per token (its ratio: the bandwidth bound)",
            lambda m, n=length: decode_bytes_per_token(m, cfgs[m], weights[m], n, at_once(m, n)) / 1e6, "{:.1f}",
            inverse=True)
    row(f"max concurrent sequences of {longest} tokens (vLLM)", lambda m: results[m]["max_concurrency"], "{:.0f}")
    row(f"cache MiB per sequence at {longest} tokens", lambda m: report["cache_mib_per_sequence"][m], "{:.1f}")
    def timed_s(speed):
        runs = speed.get("runs_seconds", [speed["seconds"]])
        return f"{sum(runs):.1f} s" + (f" ({len(runs)} runs)" if len(runs) > 1 else "")
    steps = [f"- {m}, {n} new tokens: {w['steps']} engine steps; the engine waited {w['waited_s']:.1f} s for model "
             f"outputs (longest {w['longest_ms']:.0f} ms) of {timed_s(results[m]['speed'][n])}"
             for m in models for n, w in results.get(m, {}).get("engine_steps", {}).items()]
    lines += [""] + steps if steps else []
    clocks = [f"- {m}, {n} new tokens, run {i + 1}: {step_clock.describe(clock)}"
              for m in models for n, speed in results.get(m, {}).get("speed", {}).items()
              for i, clock in enumerate(speed.get("runs_step_clock", [])) if clock]
    lines += ["", "Step clock (`--step-clock`, bench/step_clock.py; runs in the order they ran):"] + clocks \
        if clocks else []
    if args.interleave:  # the rounds paired: each model's run against Qwen3's of the same round
        rounds = []
        for m in models[:-1]:
            for n in map(str, args.lengths):
                try:
                    paired = [a / b for a, b in zip(results[m]["speed"][n]["runs_tokens_per_s"],
                                                    results["Qwen3"]["speed"][n]["runs_tokens_per_s"])]
                except KeyError:  # a model failed or did not run
                    continue
                rounds.append(f"- {m} / Qwen3, {n} new tokens, round by round: "
                              f"{', '.join(f'{r:.2f}' for r in paired)} (median {statistics.median(paired):.2f})")
        lines += [""] + rounds if rounds else []
    markdown = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(markdown)
    return markdown


if __name__ == "__main__":
    main()
