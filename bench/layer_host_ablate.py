"""Where the SSE decoder layer's extra host time goes, against Qwen3's decoder layer (bench/layer_host.py's shapes).

    python bench/layer_host_ablate.py [T]          # T = 1024 by default; prints the tables

Part 1 (ran on an H100 on 2026-11-27, bench/results/layer_host_ablate_20261127-0220.txt): host time per call of each
layer without and with grad and with activation checkpointing, then the SSE layer with its two Triton-backed
autograd Functions (the SSE operator, the norm-gate step) swapped for torch stand-ins, Triton's launch cost, and
cProfile of one checkpointed step of each layer. Part 2 (both parts ran on an H100 on 2026-11-27 03:49,
bench/results/layer_host_ablate_20261127-0349.txt): whether checkpointing itself costs the extra, i.e. the
norm-gate Function alone under checkpoint variants (no RNG preservation, no determinism check, reentrant), Triton
launches from autograd's backward thread, and host synchronisations during a checkpointed step of each layer
(`torch.cuda.set_sync_debug_mode`). kernels/NOTES.md has both runs' tables.
"""
import cProfile
import io
import pstats
import sys
import warnings
from pathlib import Path

import torch
import triton

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import kernels  # noqa: E402
from kernels.norm_gate import norm_gate_torch  # noqa: E402
from kernels.triton.indexed_chunk import index_tables  # noqa: E402
from kernels.triton.norm_gate import _fwd_kernel  # noqa: E402
from layer_host import CHECKPOINT, fwd_bwd, layers, per_call_us  # noqa: E402

T = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
calls = 50
sse, sse_fn, qwen, qwen_fn, x = layers(T)


def step(fn, ck):
    fwd_bwd(fn, x, checkpointing=CHECKPOINT if ck else None)


def fwd(fn):
    with torch.no_grad():
        fn(x)


rows = {}
for name, fn in (("SSE", sse_fn), ("Qwen3", qwen_fn)):
    rows[f"{name} fwd no_grad"] = lambda fn=fn: fwd(fn)
    rows[f"{name} fwd grad (no bwd)"] = lambda fn=fn: fn(x)
    rows[f"{name} fwd+bwd"] = lambda fn=fn: step(fn, False)
    rows[f"{name} ckpt fwd+bwd"] = lambda fn=fn: step(fn, True)
res = {k: per_call_us(f, calls) for k, f in rows.items()}

real_attn, real_ng = kernels.sse_attention, kernels.norm_gate


def stand_in(q, k_logits, v, log_decay, router_logits, **kw):
    return v * torch.sigmoid(q + k_logits + log_decay + kw["q_shared"] + kw["k_shared_logits"]), None


ablations = {
    "SSE op -> torch stand-in (5 elementwise)": dict(sse_attention=stand_in),
    "norm_gate -> torch twin": dict(norm_gate=lambda o, w, g, *, eps: norm_gate_torch(o, w, g, eps)),
    "both": dict(sse_attention=stand_in, norm_gate=lambda o, w, g, *, eps: norm_gate_torch(o, w, g, eps)),
}
for label, patch in ablations.items():
    for k, v in patch.items():
        setattr(kernels, k, v)
    res[f"SSE ckpt fwd+bwd, {label}"] = per_call_us(lambda: step(sse_fn, True), calls)
    res[f"SSE fwd+bwd, {label}"] = per_call_us(lambda: step(sse_fn, False), calls)
    kernels.sse_attention, kernels.norm_gate = real_attn, real_ng

# Triton launch cost alone: the norm-gate forward kernel, and a torch elementwise op for scale.
o = torch.randn(T * 16, 128, device="cuda", dtype=torch.bfloat16)
w = torch.ones(128, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(o)
rstd = torch.empty(T * 16, device="cuda")
grid = (triton.cdiv(T * 16, 16),)


def launch_norm_gate():
    _fwd_kernel[grid](o, w, o, y, rstd, T * 16, 128, 1e-6, True, 16, 128)  # the gated kernel


res["triton launch (norm_gate fwd, 11 args)"] = per_call_us(launch_norm_gate, 500)
res["torch.mul launch"] = per_call_us(lambda: torch.mul(o, o), 500)
res["torch.empty"] = per_call_us(lambda: torch.empty(T, 16, 128, device="cuda", dtype=torch.bfloat16), 500)

router = torch.randn(T, 4, device="cuda", dtype=torch.bfloat16)
bounds = torch.tensor([0, T], device="cuda")
res["index_tables (3 launches)"] = per_call_us(lambda: index_tables(router, bounds, 1, True, 64), 200)

print(f"{torch.cuda.get_device_name()} T={T}  host us / wall us")
for k, (h, w_) in res.items():
    print(f"{k:60s} {h:9.1f} {w_:9.1f}")

for name, fn in (("SSE", sse_fn), ("Qwen3", qwen_fn)):
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(20):
        step(fn, True)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print(f"==== cProfile {name} ckpt=True, 20 calls, by tottime")
    print(s.getvalue()[:6000])


# ---- Part 2: is it checkpointing? ----
o4, g4 = (torch.randn(1, T, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
w4 = torch.ones(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
norm_gates = {"triton": lambda o, g: kernels.norm_gate(o, w4, g, eps=1e-6),
              "torch": lambda o, g: norm_gate_torch(o, w4, g, 1e-6)}
modes = {"plain": None, "ckpt": CHECKPOINT,
         "ckpt no-rng": dict(use_reentrant=False, preserve_rng_state=False),
         "ckpt no-check": dict(use_reentrant=False, determinism_check="none"),
         "ckpt reentrant": dict(use_reentrant=True)}


res = {}
for name, fn in norm_gates.items():
    for mode, kwargs in modes.items():
        res[f"norm_gate {name} {mode}"] = per_call_us(
            lambda fn=fn, kwargs=kwargs: fwd_bwd(fn, o4, g4, checkpointing=kwargs), 200)
for name, fn in (("SSE", sse_fn), ("Qwen3", qwen_fn)):
    res[f"{name} layer ckpt no-rng fwd+bwd"] = per_call_us(
        lambda fn=fn: fwd_bwd(fn, x, checkpointing=dict(CHECKPOINT, preserve_rng_state=False)), calls)



def ten_launches():
    for _ in range(10):
        launch_norm_gate()


class LaunchInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ten_launches()
        return a * 1

    @staticmethod
    def backward(ctx, d):
        return d


class LaunchInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 1

    @staticmethod
    def backward(ctx, d):
        ten_launches()
        return d


a = torch.randn(8, device="cuda", requires_grad=True)
res["10 launches, main thread"] = per_call_us(ten_launches, 200)
res["10 launches in a Function's forward (+ x*1 fwd/bwd)"] = per_call_us(
    lambda: LaunchInForward.apply(a).sum().backward(), 200)
res["10 launches in a Function's backward (+ x*1 fwd/bwd)"] = per_call_us(
    lambda: LaunchInBackward.apply(a).sum().backward(), 200)
res["10 launches in a Function's forward, checkpointed"] = per_call_us(
    lambda: fwd_bwd(LaunchInForward.apply, a, checkpointing=CHECKPOINT), 200)
print("\n==== Part 2: host us / wall us")
for k, (h, w_) in res.items():
    print(f"{k:60s} {h:9.1f} {w_:9.1f}")

for name, fn in (("SSE", sse_fn), ("Qwen3", qwen_fn)):
    for ck in (False, True):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(fn, ck)
        torch.cuda.set_sync_debug_mode(0)
        print(f"{name} layer step, checkpointing {ck}: {len(caught)} synchronising calls",
              sorted({str(c.message)[:100] for c in caught}))
