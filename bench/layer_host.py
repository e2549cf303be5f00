"""Host time of the SSE training layer, against Qwen3's decoder layer: how long the CPU takes to queue one call.

    python bench/layer_host.py [--lengths 1024 8192] [--out bench/results] [--profile]
    python bench/layer_host.py --pieces --lengths 8192     # the host's time per piece of a layer's forward

A training step whose host queues kernels more slowly than the GPU runs them is bound by the host (with gradient
checkpointing every layer's forward is queued twice). Each row times a loop of calls without synchronising, so
the host's time per call is what is measured while it stays ahead of the GPU ("host us"); "wall us" adds the wait
for the GPU at the end. Shapes as bench/train_step.py (width 2048, 16 heads of 128, SSE n4k1 + shared), bf16;
Qwen3's RMSNorms run the project's kernel, as train_step's Qwen3-fused-norm, the fair baseline (since 2026-11-29;
earlier results had transformers' eager norm). Writes bench/results/layer_host_<date>.json with the device and
date. `--profile` also writes, per length, where the host's time goes in one checkpointed forward + backward of
each decoder layer (torch.profiler's CPU side: self time per op, kernel launches counted) to
layer_host_<date>_profile.txt. `--pieces` instead times each piece of the two decoder layers' forward (and their
forward + backward) with the GPU held by a sleep kernel, so that only the host's time is measured (`held_us`), to
layer_host_pieces_<date>.json.
"""
import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kernels import checkpoint_replay  # noqa: E402
from train_step import SHAPE, fuse_norms  # noqa: E402


def per_call_us(fn, calls: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return round(host / calls * 1e6, 1), round(wall / calls * 1e6, 1)


def fwd_bwd(fn, *inputs, checkpointing=None):
    """One forward + backward of fn(*inputs).sum(); `checkpointing`: torch.utils.checkpoint's keyword arguments
    (e.g. `CHECKPOINT`), or None for a plain call."""
    out = fn(*inputs) if checkpointing is None else checkpoint(fn, *inputs, **checkpointing)
    out.sum().backward()


CHECKPOINT = dict(use_reentrant=False)  # as bench/train_step.py's gradient checkpointing
# ... of an SSE layer, which SSEModel checkpoints with the operator's replay (kernels/checkpoint_replay.py)
SSE_CHECKPOINT = dict(CHECKPOINT, context_fn=checkpoint_replay.contexts)


def layers(T: int, device: str = "cuda", shape: dict = SHAPE, sse_impl: str = "auto"):
    """(SSE decoder layer, its call, Qwen3 decoder layer, its call, their input) of bench/train_step.py's models,
    bf16 (`shape`: another width for bench/layer_ops.py's count on the CPU)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    from sse_model import SSEConfig
    from sse_model.configuration_sse import SSE_LAYER
    from sse_model.modeling_sse import SSEDecoderLayer
    sse = SSEDecoderLayer(SSEConfig(**shape, sse_num_partitions=4, sse_top_k=1, sse_shared_partition=True,
                                    sse_lora_rank=64, layer_types=[SSE_LAYER] * 6, sse_impl=sse_impl), 0)
    qwen_config = Qwen3Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    qwen_config._attn_implementation = "sdpa"
    qwen = Qwen3DecoderLayer(qwen_config, 0)
    fuse_norms(qwen)  # as train_step's Qwen3-fused-norm
    x = torch.randn(1, T, shape["hidden_size"], device=device, dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(T, device=device)[None]
    rope = Qwen3RotaryEmbedding(qwen_config).to(device)(x, position_ids)
    return (sse.to(device, torch.bfloat16), lambda h: sse(h)[0],
            qwen.to(device, torch.bfloat16), lambda h: qwen(h, position_embeddings=rope, attention_mask=None,
                                                            position_ids=position_ids), x)


def measure(T: int, calls: int, built) -> dict:
    from kernels import sse_attention
    from kernels.triton.indexed_chunk import index_tables
    H, C, N = SHAPE["num_attention_heads"], SHAPE["head_dim"], 4
    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v, g, q_shared, k_shared = (leaf(1, T, H, C) for _ in range(6))
    router = leaf(1, T, N)
    op = dict(top_k=1, q_shared=q_shared, k_shared_logits=k_shared, decay_normalizer=16.0)
    bounds = torch.tensor([0, T], device="cuda")
    _, sse_fn, _, qwen_fn, x = built

    rows = {"routing and chunk index (index_tables)": lambda: index_tables(router[0].detach(), bounds, 1, True, 64),
            "SSE operator forward": lambda: sse_attention(q, k, v, g, router, **op),
            "SSE operator forward + backward": lambda: sse_attention(q, k, v, g, router, **op)[0].sum().backward()}
    for checkpointed in (False, True):
        rows[f"SSE decoder layer forward + backward, checkpointing {'on' if checkpointed else 'off'}"] = \
            lambda c=checkpointed: fwd_bwd(sse_fn, x, checkpointing=SSE_CHECKPOINT if c else None)
        rows[f"Qwen3 decoder layer forward + backward, checkpointing {'on' if checkpointed else 'off'}"] = \
            lambda c=checkpointed: fwd_bwd(qwen_fn, x, checkpointing=CHECKPOINT if c else None)
    return {name: dict(zip(("host_us", "wall_us"), per_call_us(fn, calls))) for name, fn in rows.items()}


def held_us(fn, calls: int = 4, repeats: int = 7) -> float:
    """Host us per call of `fn` while a sleep kernel holds the GPU: the median of `repeats` loops of `calls` calls.
    Few calls a loop, so that their launches stay within CUDA's launch queue: a full queue makes the host wait on
    the GPU, and that wait is not host time (20 calls of a whole decoder layer fill it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(100_000_000)  # tens of ms, longer than the loop takes the host
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(times), 1)


def pieces(T: int, built) -> dict:
    """Host us per call of each piece of the two decoder layers' forward with gradients on (as a training step's),
    and of their forward + backward (`held_us`)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    import kernels
    sse, sse_fn, qwen, qwen_fn, x = built
    mixer = sse.linear_attn
    h = sse.input_layernorm(x)
    inputs, gate = mixer.project(h, None, [])
    o, _ = kernels.sse_attention(**inputs, **mixer.ops)
    rope = Qwen3RotaryEmbedding(qwen.self_attn.config).to("cuda")(x, torch.arange(T, device="cuda")[None])
    rows = {"input RMSNorm": (lambda: sse.input_layernorm(x), lambda: qwen.input_layernorm(x)),
            "token mixer": (lambda: mixer(h), lambda: qwen.self_attn(h, position_embeddings=rope, attention_mask=None)),
            "  projections (SSELayer.project)": (lambda: mixer.project(h, None, []), None),
            "  operator (kernels.sse_attention)": (lambda: kernels.sse_attention(**inputs, **mixer.ops), None),
            "  norm-gate + W_o (SSELayer.output)": (lambda: mixer.output(o, gate), None),
            "MLP": (lambda: sse.mlp(h), lambda: qwen.mlp(h)),
            "decoder layer, forward": (lambda: sse_fn(x), lambda: qwen_fn(x)),
            "decoder layer, forward + backward": (lambda: fwd_bwd(sse_fn, x), lambda: fwd_bwd(qwen_fn, x))}
    return {name: [None if fn is None else held_us(fn) for fn in fns] for name, fns in rows.items()}


def host_profile(T: int, built, calls: int = 20) -> str:
    """torch.profiler's CPU-side table of `calls` checkpointed forward + backward passes of each decoder layer
    (`built`: what `layers(T)` returns)."""
    from torch.profiler import ProfilerActivity, profile
    _, sse_fn, _, qwen_fn, x = built
    text = []
    for name, fn, checkpointing in (("SSE", sse_fn, SSE_CHECKPOINT), ("Qwen3", qwen_fn, CHECKPOINT)):
        def step(fn=fn, checkpointing=checkpointing):
            fwd_bwd(fn, x, checkpointing=checkpointing)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                step()
        events = prof.key_averages()
        launches = sum(e.count for e in events if "LaunchKernel" in e.key) / calls
        text.append(f"## {name} decoder layer, T = {T}, checkpointed forward + backward: "
                    f"{launches:.0f} kernel launches per call\n")
        text.append(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    return "\n".join(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--profile", action="store_true", help="also write where the host's time goes")
    p.add_argument("--pieces", action="store_true", help="the host's time per piece of a layer instead (`pieces`)")
    args = p.parse_args(argv)
    built = {T: layers(T) for T in args.lengths}
    if args.pieces:
        now = datetime.now(timezone.utc)
        results = {T: pieces(T, built[T]) for T in args.lengths}
        print(f"Host us per call with the GPU held, {torch.cuda.get_device_name()}, {now:%Y-%m-%d %H:%M} UTC "
              "(SSE decoder layer / Qwen3 decoder layer with the fused RMSNorm; forward with gradients on)")
        for T, rows in results.items():
            print(f"\n| T = {T} | SSE | Qwen3 |\n| --- | ---: | ---: |")
            for name, cells in rows.items():
                print(f"| {name} | " + " | ".join("" if c is None else f"{c:.0f}" for c in cells) + " |")
        args.out.mkdir(parents=True, exist_ok=True)
        report = dict(date=now.isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
                      torch=torch.__version__, shape=SHAPE, columns=["SSE", "Qwen3"], results=results)
        (args.out / f"layer_host_pieces_{now:%Y%m%d-%H%M}.json").write_text(json.dumps(report, indent=1))
        return
    results = {T: measure(T, args.calls, built[T]) for T in args.lengths}
    now = datetime.now(timezone.utc)
    print(f"Host time per call, {torch.cuda.get_device_name()}, {now:%Y-%m-%d %H:%M} UTC (host us / wall us)")
    print("| call | " + " | ".join(f"T = {T}" for T in args.lengths) + " |")
    print("| --- |" + " ---: |" * len(args.lengths))
    for name in results[args.lengths[0]]:
        cells = [f"{results[T][name]['host_us']:.0f} / {results[T][name]['wall_us']:.0f}" for T in args.lengths]
        print(f"| {name} | " + " | ".join(cells) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(date=now.isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, shape=SHAPE, results=results)
    (args.out / f"layer_host_{now:%Y%m%d-%H%M}.json").write_text(json.dumps(report, indent=1))
    if args.profile:
        (args.out / f"layer_host_{now:%Y%m%d-%H%M}_profile.txt").write_text(
            "\n\n".join(host_profile(T, built[T]) for T in args.lengths))


if __name__ == "__main__":
    main()
