"""Whole-model training step (forward + backward, loss over the vocabulary): SSE-H against the same model with
every layer attention and against transformers' Qwen3 of the same shape, bf16, one GPU, one run.

    python -m bench.train_step [--lengths 4096 16384 32768] [--out bench/runs] [--baseline]
    python -m bench.train_step --profile --lengths 8192     # where the time goes: GPU kernels of one step
    python -m bench.train_step --lengths 8192 --steps 10 --models SSE-H      # one model (an A/B of two trees)
    python -m bench.train_step --lengths 8192 --rounds 5      # every model timed 5 times in turn (`rounds`)
    python -m bench.train_step --lengths 8192 --rounds 3 --alone      # ... each time in a process of its own
    python -m bench.train_step --lengths 8192 --steps 20 --interleave      # the models' steps in turn
    python -m bench.train_step --split --lengths 8192     # GPU work against the host's: GPU-bound step, timeline
    python -m bench.train_step --split --checkpointing --lengths 8192     # ... of the checkpointed step
    python -m bench.train_step --compile --interleave --models SSE-H Qwen3     # every model under torch.compile

6 layers of width 2048 (16 heads of 128, MLP 5632, vocabulary 32k); SSE-H has 5 SSE layers (n4k1 + shared) and
one attention layer (`--models SSE-H-param-matched`: SSE-H with MLP 4928, no more parameters than Qwen3's). Rows
of T tokens, batch 1: "unpacked" is one sequence, "packed" is 8 sequences of T / 8
(position ids restarting, as TRL's padding-free collator makes them). Gradient checkpointing off and on.
Attention runs through transformers' `sdpa` in all three models (SSE-H's attention layer attends per sequence in
packed rows; Qwen3 gets a document mask), and Qwen3 also through `flex_attention` (a block mask: the packed path
where flash-attn is not installed). `Qwen3-fused-norm` is Qwen3 (sdpa) with SSE-H's RMSNorm kernel
(`kernels.rms_norm`) in place of transformers' eager Qwen3RMSNorm, so that SSE-H is also measured against a
Transformer that differs from it only in its layers' token mixing; `Qwen3-flex-fused-norm` is the same with flex
attention, the fair baseline on packed rows. `free-mixing-bound` and `-flex` (`--models`) are these two with the
token mixing of their first five layers free: the bound on any hybrid of SSE-H's layout (`free_mixing`). Reported:
tokens/s (median of timed steps after one warm-up), peak memory, and SSE-H (and the bound) against the fastest
Qwen3 run.
"""
import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.baseline import REPO, RUNS, command, write_baseline

SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=6,
             num_attention_heads=16, num_key_value_heads=16, head_dim=128, max_position_embeddings=65536,
             tie_word_embeddings=False)


def models():
    from sse_model import SSEConfig, SSEForCausalLM
    from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER
    sse = dict(sse_num_partitions=4, sse_top_k=1, sse_shared_partition=True, sse_lora_rank=64,
               attention_qk_norm=True, sse_balance_loss_coef=0.01)
    return {
        "SSE-H": lambda: SSEForCausalLM(SSEConfig(**SHAPE, **sse, layer_types=[SSE_LAYER] * 5 + [ATTENTION_LAYER])),
        # SSE-H with Qwen3's parameter count or fewer (437.4M against 439.4M; same-shape SSE-H has 463.4M): the SSE
        # layers' output gate, low-rank and router weights paid for with a narrower MLP. Not in the default set.
        "SSE-H-param-matched": lambda: SSEForCausalLM(SSEConfig(**{**SHAPE, "intermediate_size": 4928}, **sse,
                                                                layer_types=[SSE_LAYER] * 5 + [ATTENTION_LAYER])),
        "all-attention": lambda: SSEForCausalLM(SSEConfig(**SHAPE, **sse, layer_types=[ATTENTION_LAYER] * 6)),
        "Qwen3": lambda: qwen3("sdpa"),
        # Packed rows under sdpa get transformers' T x T document mask; flex attention skips the masked blocks.
        # flash_attention_2 (varlen) would be the fastest packed path, but the GPU node has no flash-attn.
        "Qwen3-flex": lambda: qwen3("flex_attention"),
        "Qwen3-fused-norm": lambda: qwen3("sdpa", fused_norm=True),
        # the packed rows' baseline with the same RMSNorm kernel as SSE-H (flex attention skips masked blocks)
        "Qwen3-flex-fused-norm": lambda: qwen3("flex_attention", fused_norm=True),
        # not models to train: the bound on what any token mixer in SSE-H's place could gain (`free_mixing`), with
        # either attention for the last layer (sdpa is the faster on unpacked rows, flex on packed ones)
        "free-mixing-bound": lambda: free_mixing(qwen3("sdpa", fused_norm=True), layers=range(5)),
        "free-mixing-bound-flex": lambda: free_mixing(qwen3("flex_attention", fused_norm=True), layers=range(5)),
    }


def qwen3(attention: str, fused_norm: bool = False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = Qwen3ForCausalLM._from_config(config, attn_implementation=attention)
    if fused_norm:
        fuse_norms(model)
    return model


def fuse_norms(module):
    """Every Qwen3RMSNorm in `module` runs kernels.rms_norm: it computes the same float ops as SSERMSNorm, which
    that kernel fuses."""
    import kernels
    for norm in [m for m in module.modules() if type(m).__name__ == "Qwen3RMSNorm"]:
        norm.forward = lambda x, norm=norm: kernels.rms_norm(x, norm.weight, eps=norm.variance_epsilon)


class FreeMixer(torch.autograd.Function):
    """A token mixer of no cost: returns the values and gives the queries and keys zero gradients, so that the
    projections before it take their full backward as they do before a real mixer."""

    @staticmethod
    def forward(ctx, query, key, value):
        ctx.shapes = query.shape, key.shape
        return value.transpose(1, 2)  # [B, T, heads, head_dim], as attention returns it

    @staticmethod
    def backward(ctx, grad):
        (q_shape, k_shape), options = ctx.shapes, dict(dtype=grad.dtype, device=grad.device)
        return torch.zeros(q_shape, **options), torch.zeros(k_shape, **options), grad.transpose(1, 2)


def free_mixing(model, layers):
    """`model` (a Qwen3) whose attention in `layers` is a `FreeMixer`: those layers mix no tokens and cost only
    their projections, norms and rotary embedding. With SSE-H's layout (five such layers, then attention) it is
    the fastest step any hybrid of this shape could take with Qwen3's projections and a token mixer of no cost;
    SSE-H's own layers have more projections (output gate, low rank, router), so it bounds SSE-H from above."""
    from transformers import AttentionInterface

    def free(module, query, key, value, attention_mask, **kwargs):
        assert module.num_key_value_groups == 1, "FreeMixer returns one head per key-value head"
        return FreeMixer.apply(query, key, value), None

    AttentionInterface.register("free_mixing", free)
    for i in layers:
        attention = model.model.layers[i].self_attn
        attention.config = copy.copy(attention.config)
        attention.config._attn_implementation = "free_mixing"
    return model


def compiled(build):
    """`build` whose model runs under torch.compile (inductor's defaults), as TRL's `torch_compile` runs it; its
    first step compiles it. SSE-H's SSE layers run eagerly inside it (`SSELayer.forward`)."""
    def build_compiled():
        model = build()
        model.compile()
        return model
    return build_compiled


def on_gpu(build):
    """The model built straight on the GPU (initialising 0.45B parameters on the host takes seconds), in bf16."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        return build().to(torch.bfloat16).train()


def prepared(build, T: int, packed: bool, checkpointing: bool) -> tuple:
    """(model on the GPU, its step's keyword arguments): one row of T random tokens, 8 sequences when packed."""
    model = on_gpu(build)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, SHAPE["vocab_size"], (1, T), device="cuda")
    kwargs = dict(input_ids=ids, labels=ids, use_cache=False)
    if packed:
        kwargs["position_ids"] = (torch.arange(T, device="cuda") % (T // 8))[None]
    return model, kwargs


def timed_step(model, kwargs: dict) -> tuple[float, float]:
    """(seconds, host seconds) of one forward + backward from a synchronised GPU: the host's time to queue it is
    close to the step's where the host bounds the step (or a full launch queue held the host back)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    model(**kwargs).loss.backward()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return done - t, queued - t


def measure(build, T: int, packed: bool, checkpointing: bool, steps: int) -> dict:
    model, kwargs = prepared(build, T, packed, checkpointing)
    torch.cuda.reset_peak_memory_stats()
    timed_step(model, kwargs)  # the first step compiles and tunes kernels
    times, host = zip(*(timed_step(model, kwargs) for _ in range(steps)))
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model
    torch.cuda.empty_cache()
    return dict(tokens_per_s=T / statistics.median(times), peak_gib=peak,
                step_ms=[round(x * 1e3, 2) for x in times], host_ms=[round(x * 1e3, 2) for x in host])


def measure_alone(name: str, T: int, packed: bool, checkpointing: bool, steps: int) -> dict:
    """`measure` of model `name` in a Python process of its own, as a training run has one model: nothing of the
    other models' runs (their allocator pools, compiled kernels, imports) is in the process. Raises
    torch.OutOfMemoryError where that process ran out of GPU memory."""
    flags = ["--packed"] * packed + ["--checkpointing"] * checkpointing
    done = subprocess.run([sys.executable, "-m", "bench.train_step", "--alone", name, "--lengths", str(T), "--steps",
                           str(steps), *flags], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"{name} at T = {T} failed in its own process:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.splitlines()[-1])
    if result is None:
        raise torch.OutOfMemoryError(f"{name} at T = {T}, in its own process")
    return result


def rounds(builds, T: int, packed: bool, checkpointing: bool, steps: int, count: int, alone: bool = False) -> dict:
    """Each model `measure`d `count` times in turn (with `alone`, each time in a process of its own:
    `measure_alone`), the order reversed every other round, so that the host's speed, which moves by tens of
    percent over minutes on the GPU node (docs/kernels.md), falls on every model alike. Per model: tokens/s the
    median of its rounds (each the median of its steps), peak memory the largest, and its rounds; `paired`: SSE-H
    over the fastest Qwen3 of the same round, round by round."""
    names = list(builds)
    runs = {name: [] for name in names}
    for i in range(count):
        for name in names if i % 2 == 0 else names[::-1]:
            try:
                runs[name].append(measure_alone(name, T, packed, checkpointing, steps) if alone
                                  else measure(builds[name], T, packed, checkpointing, steps))
            except torch.OutOfMemoryError:
                runs[name].append(None)
                torch.cuda.empty_cache()
    out = {}
    for name, results in runs.items():
        done = [r for r in results if r is not None]
        out[name] = None if len(done) < count else dict(
            tokens_per_s=statistics.median(r["tokens_per_s"] for r in done),
            peak_gib=max(r["peak_gib"] for r in done), rounds=[round(r["tokens_per_s"]) for r in done],
            step_ms=[ms for r in done for ms in r["step_ms"]], host_ms=[ms for r in done for ms in r["host_ms"]])
    return paired(out)


def paired(out: dict) -> dict:
    """`out` with "paired": SSE-H's tokens/s over the fastest Qwen3's, round by round (where both have rounds), and
    "bound": the same for the faster `free_mixing` bound, where one ran."""
    def over_qwen(names):
        qwen = [name for name, result in out.items() if name.startswith("Qwen3") and result]
        if qwen and all(out.get(name) for name in names):
            return [round(max(out[name]["rounds"][i] for name in names) / max(out[q]["rounds"][i] for q in qwen), 3)
                    for i in range(len(out[names[0]]["rounds"]))]
    bounds = [name for name in out if name.startswith("free-mixing-bound")]
    for key, names in (("paired", ["SSE-H"]), ("bound", bounds)):
        if names and (ratios := over_qwen(names)):
            out[key] = ratios
    return out


def interleaved(builds, T: int, packed: bool, checkpointing: bool, steps: int) -> dict:
    """Every model on the GPU at once and their steps alternating, one step each in turn (the order reversed every
    other turn), so that a change of the host's speed, which `rounds` spreads over seconds, falls within a turn
    (~0.2 s at 8k) on every model alike. As `rounds`, with each turn a round of one step; no peak memory (the
    models share the GPU's), and an out-of-memory ends the row with no figures."""
    names = list(builds)
    try:
        models = {name: prepared(builds[name], T, packed, checkpointing) for name in names}
        for model, kwargs in models.values():
            timed_step(model, kwargs)  # compiles and tunes kernels
        times = {name: [] for name in names}
        for i in range(steps):
            for name in names if i % 2 == 0 else names[::-1]:
                times[name].append(timed_step(*models[name]))
    except torch.OutOfMemoryError:
        return {name: None for name in names}
    finally:
        models = None
        torch.cuda.empty_cache()
    out = {}
    for name, timings in times.items():
        step_s, host_s = zip(*timings)
        out[name] = dict(tokens_per_s=T / statistics.median(step_s), peak_gib=None,
                         rounds=[round(T / t) for t in step_s], step_ms=[round(t * 1e3, 2) for t in step_s],
                         host_ms=[round(t * 1e3, 2) for t in host_s])
    return paired(out)


def profile(builds, T: int, top: int = 25) -> list[str]:
    """GPU time per kernel of one unpacked step (after a warm-up step) of each model but all-attention, and per torch
    op with its input shapes (which op of the model launched the kernels): a markdown section."""
    from torch.profiler import ProfilerActivity
    lines = [f"## T = {T}, unpacked, no checkpointing", ""]
    for name in [name for name in builds if name != "all-attention"]:
        model = on_gpu(builds[name])
        ids = torch.randint(0, SHAPE["vocab_size"], (1, T), device="cuda")
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        # as `measure` does: otherwise the profiled backward adds into every parameter's gradient (an add kernel
        # per parameter tensor, which the timed steps do not run)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                    record_shapes=True) as prof:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.device_time_total > 0]
        kernels.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in kernels) / 1e3
        lines += [f"### {name}: {total:.1f} ms of GPU kernels", "", "| kernel | calls | ms | share |",
                  "| --- | ---: | ---: | ---: |"]
        for e in kernels[:top]:
            ms = e.device_time_total / 1e3
            lines.append(f"| `{e.key[:120]}` | {e.count} | {ms:.2f} | {ms / total:.1%} |")
        ops = [e for e in prof.key_averages(group_by_input_shape=True)
               if e.device_type.name == "CPU" and e.self_device_time_total > 0]
        ops.sort(key=lambda e: -e.self_device_time_total)
        lines += ["", f"{name}, by torch op (GPU time of the kernels each op launched itself):", "",
                  "| op | input shapes | calls | ms |", "| --- | --- | ---: | ---: |"]
        for e in ops[:top]:
            shapes = str([list(s) for s in e.input_shapes if s])[:100]
            lines.append(f"| `{e.key}` | `{shapes}` | {e.count} | {e.self_device_time_total / 1e3:.2f} |")
        lines.append("")
        del model
        torch.cuda.empty_cache()
    return lines


def gpu_bound(model, kwargs: dict, steps: int) -> tuple[list, list]:
    """(GPU ms, host ms) of forward and backward per step, with the GPU held by a sleep kernel while the host queues
    the step, so that its kernels then run back to back (CUDA events)."""
    gpu, host = [], []
    for _ in range(steps):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # ~0.2 s, longer than the host takes to queue a step
        events[0].record()
        t0 = time.perf_counter()
        loss = model(**kwargs).loss
        events[1].record()
        t1 = time.perf_counter()
        loss.backward()
        events[2].record()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        gpu.append((events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])))
        host.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3))
        model.zero_grad(set_to_none=True)
    return gpu, host


def timeline(model, kwargs: dict) -> list[tuple[float, float]]:
    """(host ms, GPU ms) from the start of one plain step at each decoder layer's start, the loss and the end of the
    backward: where the two are equal the GPU was waiting for the host."""
    marks = []

    def mark(*_):
        marks.append((time.perf_counter(), torch.cuda.Event(enable_timing=True)))
        marks[-1][1].record()
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    hooks = [layer.register_forward_pre_hook(mark) for layer in layers]
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    loss = model(**kwargs).loss
    mark()
    loss.backward()
    mark()
    torch.cuda.synchronize()
    for hook in hooks:
        hook.remove()
    model.zero_grad(set_to_none=True)
    return [((t - t0) * 1e3, start.elapsed_time(e)) for t, e in marks]


def split(builds, T: int, steps: int, checkpointing: bool = False) -> list[str]:
    """Whether a model's unpacked step waits on the host or on the GPU, without a profiler (whose own host cost
    hides it): the step as `measure` times it, the GPU-bound step (`gpu_bound`), the difference (the GPU's idle
    time in a step), the host's time to queue forward and backward, and a `timeline` of one step. A forward that
    waits for the device (transformers' Qwen3 does once, before its first layer, on the 2026-11-28 H100 runs) has
    the sleep in its host time. With `checkpointing` the backward's time includes the layers' second forward."""
    lines = [f"## T = {T}, unpacked, checkpointing {'on' if checkpointing else 'off'}", "",
             "| model | step ms | GPU-bound ms (fwd + bwd) | idle ms | host queues fwd / bwd ms |",
             "| --- | ---: | ---: | ---: | ---: |"]
    timelines = []
    for name, build in builds.items():
        wall = statistics.median(measure(build, T, False, checkpointing, steps)["step_ms"])
        model, kwargs = prepared(build, T, False, checkpointing)
        model(**kwargs).loss.backward()  # compiles and tunes kernels
        model.zero_grad(set_to_none=True)
        gpu, host = gpu_bound(model, kwargs, steps)
        fwd, bwd = (statistics.median(x) for x in zip(*gpu))
        host_fwd, host_bwd = (statistics.median(x) for x in zip(*host))
        lines.append(f"| {name} | {wall:.2f} | {fwd + bwd:.2f} ({fwd:.2f} + {bwd:.2f}) | {wall - fwd - bwd:.2f} | "
                     f"{host_fwd:.2f} / {host_bwd:.2f} |")
        timelines.append(f"- {name}: " + ", ".join(f"{h:.2f} / {g:.2f}" for h, g in timeline(model, kwargs)))
        del model
        torch.cuda.empty_cache()
    return lines + ["", "Timeline of one step, host / GPU ms from its start at each decoder layer's start, the loss "
                    "and the end of the backward:", ""] + timelines + [""]


def baselines(report: dict) -> dict[str, dict]:
    """`write_baseline`'s arguments per length, `train_step[_compiled]_<k>k`: a row per layout (packed rows,
    checkpointing), each model's tokens/s and SSE-H over the fastest Qwen3 (the median of the rounds' ratios); the
    headline that ratio on one unpacked sequence without checkpointing."""
    out = {}
    for T in sorted({r["T"] for r in report["rows"]}):
        rows = []
        for r in (r for r in report["rows"] if r["T"] == T):
            models = {k: v for k, v in r.items() if k not in ("T", "packed", "checkpointing", "paired", "bound")}
            rows.append({"packed rows": "yes" if r["packed"] else "no",
                         "checkpointing": "on" if r["checkpointing"] else "off",
                         **{f"{m} tokens/s": v and round(v["tokens_per_s"]) for m, v in models.items()},
                         "SSE-H / fastest Qwen3": r.get("paired") and round(statistics.median(r["paired"]), 2)})
        plain = next(r for r in rows if r["packed rows"] == "no" and r["checkpointing"] == "off")
        out[f"train_step_{'compiled_' * report['compiled']}{T // 1024}k"] = dict(
            device=report["device"], date=report["date"][:10],
            title=f"Training step (forward + backward), {report['shape']['num_hidden_layers']} layers of "
                  f"{report['shape']['hidden_size']}, {T} tokens a row, bf16"
                  + ", every model under torch.compile" * report["compiled"],
            rows=rows, headline=dict(label=f"SSE-H / fastest Qwen3 training tokens/s, {T // 1024}k tokens",
                                     value=plain["SSE-H / fastest Qwen3"]))
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="time every model this many times in turn (`rounds`)")
    p.add_argument("--interleave", action="store_true",
                   help="every model on the GPU at once, their --steps steps alternating (`interleaved`; no peak "
                        "memory)")
    p.add_argument("--models", nargs="+", choices=list(models()),
                   default=["SSE-H", "all-attention", "Qwen3", "Qwen3-flex", "Qwen3-fused-norm",
                            "Qwen3-flex-fused-norm"],
                   help="an A/B of two trees may time SSE-H alone")
    p.add_argument("--out", type=Path, default=RUNS, help="the raw run's folder")
    p.add_argument("--baseline", action="store_true",
                   help="overwrite bench/results/train_step_<k>k.json for every length of the table")
    p.add_argument("--profile", action="store_true", help="GPU time per kernel instead of the table")
    p.add_argument("--split", action="store_true", help="GPU-bound step, idle and host time instead of the table")
    p.add_argument("--alone", nargs="?", const=True, default=False, metavar="MODEL",
                   help="every timing in a process of its own (`measure_alone`); with a model: that process, which "
                        "prints the one timing of --lengths, --packed, --checkpointing as a JSON line")
    p.add_argument("--checkpointing", action="store_true",
                   help="with --split: the checkpointed step (the table times checkpointing off and on anyway)")
    p.add_argument("--compile", action="store_true", help="every model under torch.compile (`compiled`)")
    p.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.interleave and (args.alone or args.rounds > 1):
        p.error("--interleave times steps in turn; it takes neither --alone nor --rounds")
    if args.compile and args.alone:
        p.error("--compile runs in this process; it takes no --alone")
    if args.compile:
        # every model, length and layout is a new compiled model of the same code: dynamo's default of 8 recompiles
        # would leave the later ones eager
        torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 4096
    if isinstance(args.alone, str):
        try:
            result = measure(models()[args.alone], args.lengths[0], args.packed, args.checkpointing, args.steps)
        except torch.OutOfMemoryError:
            result = None
        print(json.dumps(result))
        return
    builds = {name: compiled(build) if args.compile else build for name, build in models().items()
              if name in args.models}
    if args.profile or args.split:
        now = datetime.now(timezone.utc)
        what = "profile" if args.profile else "split"
        lines = [f"# Training step {what}, {torch.cuda.get_device_name()}, {now.isoformat(timespec='seconds')}, "
                 f"torch {torch.__version__}, bf16", ""]
        for T in args.lengths:
            lines += profile(builds, T) if args.profile else split(builds, T, args.steps, args.checkpointing)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"train_step_{what}_{now:%Y%m%d-%H%M}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    rows = []
    for T in args.lengths:
        for packed in (False, True):
            for checkpointing in (False, True):
                row = dict(T=T, packed=packed, checkpointing=checkpointing)
                row.update(interleaved(builds, T, packed, checkpointing, args.steps) if args.interleave else
                           rounds(builds, T, packed, checkpointing, args.steps, args.rounds, args.alone))
                rows.append(row)
                print(json.dumps(row), flush=True)
    now = datetime.now(timezone.utc)
    report = dict(date=now.isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, compiled=args.compile, shape=SHAPE, rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"train_step_{'compiled_' * args.compile}{now:%Y%m%d-%H%M}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    names = list(builds)

    def cell(r):
        if r is None:
            return "OOM"
        return f"{r['tokens_per_s'] / 1e3:.1f}k" + ("" if r["peak_gib"] is None else f" ({r['peak_gib']:.1f})")
    def spread(ratios):
        if not ratios:
            return ""
        median = f"{statistics.median(ratios):.2f}"
        return median + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")
    timing = (f"the median of {args.steps} steps, the models' steps in turn (all on the GPU at once)" if args.interleave
              else f"the median of {args.rounds} round(s) of {args.steps} steps, the models timed in turn"
                   f"{', each timing in a process of its own' if args.alone else ''}")
    bound = any("bound" in r for r in rows)
    lines = [f"# Training step, {report['device']}, {report['date']}, torch {torch.__version__}, bf16"
             f"{', every model under torch.compile' * args.compile}", "",
             f"tokens/s{'' if args.interleave else ' (peak GiB)'}, {timing}; SSE-H / fastest Qwen3: the median of "
             "the rounds' ratios (their range)"
             + ("; bound / fastest Qwen3: the same for the faster free-mixing bound" if bound else "")
             + "; SSE-H host / step: the host's time to queue SSE-H's step over the step's time (near 1: the host, "
             "not the GPU, set the pace; docs/kernels.md)",
             "", "| T | packed | grad ckpt | " + " | ".join(names) + " | SSE-H / fastest Qwen3 | "
             + "bound / fastest Qwen3 | " * bound + "SSE-H host / step |",
             "| --- | --- | --- | " + " | ".join("---:" for _ in names) + " | ---: |" + " ---: |" * bound + " ---: |"]
    for r in rows:
        sse = r.get("SSE-H")
        host = f"{statistics.median(sse['host_ms']) / statistics.median(sse['step_ms']):.2f}" if sse else ""
        lines.append(f"| {r['T']} | {'yes' if r['packed'] else 'no'} | {'on' if r['checkpointing'] else 'off'} | "
                     + " | ".join(cell(r[n]) for n in names) + f" | {spread(r.get('paired'))} | "
                     + f"{spread(r.get('bound'))} | " * bound + f"{host} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.baseline:
        for configuration, baseline in baselines(report).items():
            write_baseline(configuration, command=command("bench.train_step", argv), **baseline)


if __name__ == "__main__":
    main()
