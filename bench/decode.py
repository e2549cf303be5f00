"""The paper_2b decode step in vLLM against its HBM byte floor: SSE-H (sse_model PRESETS["paper_2b"]) and Qwen3 of
the same shape (hidden size, layers, heads, MLP, vocabulary), random bf16 weights, at 8, 32 and 128 sequences and
4k / 16k / 32k tokens of context.

    python -m bench.decode [--sequences 8 32 128] [--contexts 4096 16384 32768] [--steps 48] [--models SSE-H Qwen3]
                           [--engine JSON] [--out bench/runs] [--baseline]

The floor of a step (`floor_bytes`) is the bytes it must move through HBM: the weights read once (all but the input
embedding, of which only the batch's rows are read), each SSE layer's states of the partitions a token touches
(K routed + the shared one) read and written in the engine's state dtype (int16 fixed point for a bf16 model:
sse_model/vllm/engine.py), and the attention layers' bf16 KV of the context read; over the device's copy bandwidth,
measured once per run with a large device-to-device copy (bytes read + written). The table prints the measured step
beside it and their ratio.

Method (the fastest sound one: one prefill per model and context serves every batch size). Each model runs in a
process of its own (memory freed between models) with one engine (vLLM defaults, prefix caching off), bench/
step_clock.py in its worker. Per context, the largest batch size whose sequences fit the engine's cache
(`sequences_that_fit`, from the worker's cache layout) gets that many random prompts of the context's length,
added to the engine directly (`LLMEngine.add_request`, ignore_eos) and stepped until every prompt is prefilled;
then `--steps` engine steps run with all of them decoding, the requests beyond the next batch size are aborted,
`--steps` more run, and so on down to the smallest. The step clock labels every engine step with its requests, so
a step's time is the median period between consecutive decode-only steps with exactly that many requests (the
first `SKIP` of each run dropped: the transition after an abort); the context of a batch size is the prompt plus
the mean tokens its sequences had generated halfway through its steps. A batch size whose sequences do not fit
(Qwen3's KV at 32 x 16k is 85 GB) is reported as such, with the most that fit.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import step_clock
from bench.baseline import REPO, command, now, raw_path, write_baseline

MODELS = ["SSE-H", "Qwen3"]
SKIP = 3          # decode steps dropped at the start of each batch size's run
HEADROOM = 2048   # new tokens the engine's context allows past the longest prompt: decode during the prefill + steps


def configs() -> dict:
    """SSE-H of the paper_2b preset and Qwen3 with the same hidden size, layers, heads, MLP and vocabulary."""
    from transformers import Qwen3Config

    from sse_model import SSEConfig
    sse_h = SSEConfig.from_preset("paper_2b")
    same = {k: getattr(sse_h, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "head_dim",
                                           "max_position_embeddings", "tie_word_embeddings")}
    return {"SSE-H": sse_h, "Qwen3": Qwen3Config(**same, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 1e6})}


def floor_bytes(config, sequences: int, context: float, weight_bytes: int, state_bytes: int,
                kv_bytes_per_token: int) -> dict:
    """HBM bytes of one decode step of `sequences` at `context` tokens: `weight_bytes` (the streamed weights, read
    once for the batch), the touched SSE states (`state_bytes`: all partitions of all SSE layers of one sequence;
    the K routed + shared partitions a token touches are read and written), the attention KV (the `context` tokens'
    read, the new token's written)."""
    touched = 0.0
    if state_bytes:
        touched = state_bytes * (config.sse_top_k + config.sse_shared_partition) \
            / config.num_sse_partitions_with_shared
    return dict(weights=weight_bytes, states=2 * touched * sequences,
                kv=kv_bytes_per_token * (context + 1) * sequences)


def sequences_that_fit(layout: dict | None, tokens: int) -> int | None:
    """Requests of `tokens` tokens the engine's cache holds at once: vLLM allocates every request blocks of each
    cache group from one pool of `num_blocks`, an attention group one per `block_size` tokens, a state group one.
    None where the layout is unknown."""
    if not layout:
        return None
    per_request = sum(1 if state else math.ceil(tokens / block) for block, state in layout["groups"])
    return layout["num_blocks"] // per_request


def cache_layout(worker) -> dict | None:
    """(On the worker) The cache's blocks and its groups as [block_size, holds states?], from the model runner's
    `kv_cache_config` (vLLM's V1 and V2 runners keep it), or None."""
    config = getattr(worker.model_runner, "kv_cache_config", None)
    if config is None:
        return None
    return dict(num_blocks=config.num_blocks,
                groups=[[g.kv_cache_spec.block_size, "Mamba" in type(g.kv_cache_spec).__name__]
                        for g in config.kv_cache_groups])


def stages(sizes: list[int], fit: int | None) -> tuple[list[int], list[int]]:
    """(batch sizes run, largest first; those that do not fit)."""
    run = sorted((s for s in sizes if fit is None or s <= fit), reverse=True)
    return run, sorted(set(sizes) - set(run))


def step_ms(rows: list[tuple], batch: int) -> dict | None:
    """Median host period (ms) between consecutive decode-only steps of exactly `batch` requests, and their GPU
    span, from `step_clock.take_steps` rows, the first SKIP of each run of such steps dropped."""
    periods, spans, run = [], [], 0
    for a, b in zip(rows, rows[1:]):
        if a[3] and a[4] == batch and b[3] and b[4] == batch:
            run += 1
            if run > SKIP:
                periods.append((b[0] - a[0]) * 1e3)
                if a[1] is not None and a[2] is not None:
                    spans.append(a[2] - a[1])
        else:
            run = 0
    if not periods:
        return None
    return dict(ms=statistics.median(periods), gpu_span_ms=statistics.median(spans) if spans else None,
                steps=len(periods))


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Device copy bandwidth in bytes/s (read + written) of a `gib` GiB device-to-device copy, median of `repeats`,
    on random data."""
    src = torch.randn(int(gib * 2**30) // 4, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:  # warm-up
            times.append(start.elapsed_time(end) / 1e3)
    assert torch.equal(dst, src)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / statistics.median(times)


def drive(llm, batches: list[int], context: int, steps: int, vocab: int, g: torch.Generator) -> dict:
    """One context's run (the module's docstring): {batch: mean context over its steps}."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(temperature=1.0, max_tokens=llm.llm_engine.vllm_config.model_config.max_model_len
                            - context, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA)
    generated = {}
    for i in range(batches[0]):
        engine.add_request(f"r{i}", {"prompt_token_ids": torch.randint(0, vocab, (context,), generator=g).tolist()},
                           params)
        generated[f"r{i}"] = 0

    def step():
        for out in engine.step():
            if out.request_id in generated:  # not one aborted with outputs in flight
                generated[out.request_id] += len(out.outputs[0].token_ids)

    while min(generated.values()) == 0:  # prefill
        step()
    contexts = {}
    for batch, smaller in zip(batches, batches[1:] + [0]):
        for s in range(steps):
            step()
            if s == steps // 2:
                contexts[batch] = context + statistics.mean(generated.values())
        drop = list(generated)[smaller:]
        engine.abort_request(drop)
        for r in drop:
            del generated[r]
    while engine.has_unfinished_requests():
        engine.step()
    return contexts


def worker(args) -> None:
    """One model's engine: warm up, then every context; prints a RESULT line."""
    import cloudpickle
    from vllm import LLM, SamplingParams

    cloudpickle.register_pickle_by_value(step_clock)  # the engine-core process need not import them
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = time.perf_counter()
    llm = LLM(model=args.path, skip_tokenizer_init=True, dtype="bfloat16", seed=0, enable_prefix_caching=False,
              max_model_len=max(args.contexts) + HEADROOM, max_num_seqs=max(args.sequences),
              **json.loads(args.engine))
    start_s = time.perf_counter() - started
    vocab = llm.llm_engine.vllm_config.model_config.hf_config.vocab_size
    layout = llm.collective_rpc(cache_layout)[0]
    llm.collective_rpc(step_clock.install)
    g = torch.Generator().manual_seed(0)
    # kernels compiled and tuned outside the timed steps: a prefill and decode steps at every batch size
    for batch in sorted(args.sequences, reverse=True):
        llm.generate([{"prompt_token_ids": torch.randint(0, vocab, (512,), generator=g).tolist()}] * batch,
                     SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False)
    runs = {}
    for context in args.contexts:
        fit = sequences_that_fit(layout, context + HEADROOM)
        batches, unfit = stages(args.sequences, fit)
        found = dict(fit=fit, does_not_fit=unfit, batches={})
        if batches:
            llm.collective_rpc(step_clock.start, args=(None,))
            t = time.perf_counter()
            contexts = drive(llm, batches, context, args.steps, vocab, g)
            found["seconds"] = time.perf_counter() - t
            rows = llm.collective_rpc(step_clock.take_steps)[0]
            for batch in batches:
                found["batches"][batch] = dict(step_ms(rows, batch) or {}, context=contexts[batch])
        runs[context] = found
        print(f"[{args.name}] {context}: {json.dumps(found)}", flush=True)
    print("RESULT " + json.dumps(dict(start_s=start_s, layout=layout, runs=runs)), flush=True)


def run_model(name: str, config, args, log: Path) -> dict:
    """`name` in a worker process of its own (output to `log`); its RESULT."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
        cmd = [sys.executable, "-m", "bench.decode", "--worker", "--name", name, "--path", tmp, "--engine",
               args.engine, "--steps", str(args.steps), "--sequences", *map(str, args.sequences), "--contexts",
               *map(str, args.contexts)]
        env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # collective_rpc sends functions pickled
        with open(log, "w") as f:
            try:
                returncode = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout,
                                            text=True, env=env, cwd=REPO).returncode
            except subprocess.TimeoutExpired:
                returncode = None
    text = log.read_text()
    found = [line[len("RESULT "):] for line in text.splitlines() if line.startswith("RESULT ")]
    if returncode == 0 and found:
        return json.loads(found[-1])
    # The contexts the worker finished before it failed or ran out of time still count.
    prefix = f"[{name}] "
    runs = {line[len(prefix):].split(":", 1)[0]: json.loads(line.split(": ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix) and ": {" in line}
    why = f"timed out after {args.timeout:.0f} s" if returncode is None else f"exit {returncode}"
    if not runs:
        raise RuntimeError(f"{name} failed ({why}); last lines of {log}:\n" + "\n".join(text.splitlines()[-30:]))
    print(f"{name}: {why}; kept the contexts it finished: {', '.join(runs)}", flush=True)
    return dict(runs=runs, incomplete=why)


def table_rows(results: dict, cfgs: dict, bandwidth: float | None) -> list[dict]:
    """A row per model, context and batch size: the measured step, its floor (bytes over `bandwidth`) and parts."""
    from bench.rollouts import cache_per_sequence, streamed_weights

    rows = []
    for name, result in results.items():
        config = cfgs[name]
        weight_bytes = 2 * streamed_weights(config)  # bf16
        state, kv = cache_per_sequence(name, config)
        for context, run in result.get("runs", {}).items():
            for batch in sorted({*map(int, run["batches"]), *run["does_not_fit"]}):
                got = run["batches"].get(str(batch)) or run["batches"].get(batch)
                row = {"model": name, "sequences": batch, "context": int(context), "step ms": None,
                       "floor ms": None, "step / floor": None, "weights MB": None, "states MB": None,
                       "KV MB": None, "note": ""}
                if got is None:
                    row["note"] = f"does not fit (at most {run['fit']} at once)"
                else:
                    parts = floor_bytes(config, batch, got["context"], weight_bytes, state, kv)
                    row.update({"weights MB": parts["weights"] / 1e6, "states MB": parts["states"] / 1e6,
                                "KV MB": parts["kv"] / 1e6, "step ms": got.get("ms")})
                    if bandwidth:
                        row["floor ms"] = sum(parts.values()) / bandwidth * 1e3
                    if row["step ms"] and row["floor ms"]:
                        row["step / floor"] = row["step ms"] / row["floor ms"]
                    if not got.get("ms"):
                        row["note"] = "no steady decode steps"
                rows.append(row)
    return rows


def markdown(rows: list[dict], bandwidth: float | None, device: str) -> str:
    def fmt(v):
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
    bw = f"{bandwidth / 1e9:,.0f} GB/s" if bandwidth else "not measured"
    lines = [f"Decode step of paper_2b in vLLM, {device}; copy bandwidth {bw} (read + written)", "",
             "| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(fmt(v) for v in r.values()) + " |" for r in rows]) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--steps", type=int, default=48, help="engine steps timed per batch size")
    p.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    p.add_argument("--engine", default="{}", help="extra vllm.LLM keyword arguments as JSON")
    p.add_argument("--timeout", type=float, default=600, help="seconds per model")
    p.add_argument("--baseline", action="store_true", help="overwrite bench/results/decode_paper_2b.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    started, cfgs = now(), configs()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    bandwidth = copy_bandwidth() if torch.cuda.is_available() else None
    results = {}
    for name in args.models:
        try:
            results[name] = run_model(name, cfgs[name], args, raw_path(f"decode_{name}", "log", started))
        except RuntimeError as e:
            print(f"{name}: {e}", flush=True)
            results[name] = dict(error=str(e)[-2000:])
    rows = table_rows(results, cfgs, bandwidth)
    report = dict(date=started.isoformat(timespec="seconds"), device=device, bandwidth_bytes_per_s=bandwidth,
                  steps=args.steps, engine=json.loads(args.engine), results=results, rows=rows)
    raw_path("decode", "json", started).write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(rows, bandwidth, device) if rows else "no model ran\n"
    raw_path("decode", "md", started).write_text(text)
    print(text)
    if args.baseline and rows:
        write_baseline("decode_paper_2b", device=device, command=command("bench.decode", argv), rows=rows,
                       title=f"paper_2b decode step in vLLM against its HBM byte floor (copy bandwidth "
                             f"{bandwidth / 1e9:,.0f} GB/s), bf16, random weights",
                       headline=headline(rows))


def headline(rows: list[dict]) -> dict | None:
    """SSE-H's step / floor at 32 sequences and the longest context measured (the issue's target: 1.5)."""
    found = [r for r in rows if r["model"] == "SSE-H" and r["sequences"] == 32 and r["step / floor"]]
    if not found:
        return None
    row = max(found, key=lambda r: r["context"])
    return dict(label=f"SSE-H decode step / byte floor, 32 sequences at {row['context'] // 1024}k",
                value=round(row["step / floor"], 2))


if __name__ == "__main__":
    main()
