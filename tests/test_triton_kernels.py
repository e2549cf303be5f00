"""The SSE Triton kernels on CPU, under TRITON_INTERPRET=1, against the float64 reference.

Triton decides at decoration time whether a kernel is interpreted, so each check runs in a fresh Python process
with TRITON_INTERPRET=1 set before anything imports triton; whatever other tests imported cannot interfere.
The checks are the `check_*` functions below, run as `python tests/test_triton_kernels.py NAME SEED`. Every run
draws a fresh seed, printed on failure so it can be replayed.
The chunk paths run with the torch GLA core (`gla=chunk_gla_torch`): flash-linear-attention cannot run on CPU,
and what is ours (routing, gather/scatter with weights, softmax keys, row-sparse masking, backward) is checked.
"""
import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _run(check: str, interpret: bool = True):
    seed = random.randrange(2**31)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, __file__, check, str(seed)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"check_{check} failed with seed {seed}:\n{done.stdout}\n{done.stderr[-6000:]}"


def test_import_needs_no_triton_or_fla():
    _run("import_hygiene", interpret=False)


def test_routing_counting_sort():
    _run("routing")


def test_chunk_varlen_forward_backward():
    _run("chunk_varlen")


def test_chunk_mask_forward_backward():
    _run("chunk_mask")


def test_decode():
    _run("decode")


# ---------------------------------------------------------------------------------------------------------------
# Checks, run in the subprocess.

def _rel(x, ref):
    import torch
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite values"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_import_hygiene():
    import torch

    import kernels
    from kernels.dispatch import pick_implementation
    assert "triton" not in sys.modules and "fla" not in sys.modules, "import kernels pulled in triton or fla"
    assert not pick_implementation(torch.device("cpu"), 1 << 20).startswith("triton")
    assert {"triton_varlen", "triton_mask"} <= set(kernels.IMPLEMENTATIONS)


def check_routing():
    import torch

    from kernels.triton.routing import route_varlen
    cases = [  # N, K, shared, segment lengths (empty, length-1, blocks of 256 tokens crossed)
        (4, 1, True, [1, 0, 6, 300, 213]),
        (8, 2, True, [3, 1, 2, 0]),     # short segments: most (segment, partition) groups are empty
        (5, 5, True, [7, 9]),           # K = N
        (1, 1, False, [1, 4]),          # N = 1 without shared partition: GLA
        (3, 2, False, [512]),           # exactly two token blocks
    ]
    for N, K, shared, lens in cases:
        bounds = torch.tensor([0] + lens).cumsum(0)
        L, S, P, J = int(bounds[-1]), len(lens), N + shared, K + shared
        logits = torch.randn(L, N, dtype=random.choice([torch.float32, torch.bfloat16]))
        idx, pos, cu = route_varlen(logits, bounds, K, shared)
        assert torch.equal(logits.gather(1, idx.long()), logits.topk(K, 1).values), (N, K, "top-K")
        # Reference: a stable argsort of (segment, partition) over rows in (token, selection) order.
        part = torch.cat([idx.long(), torch.full((L, int(shared)), N)], 1)
        seg = torch.repeat_interleave(torch.arange(S), torch.tensor(lens))
        group = (seg[:, None] * P + part).reshape(-1)
        want_pos = torch.empty(L * J, dtype=torch.long)
        want_pos[torch.argsort(group, stable=True)] = torch.arange(L * J)
        want_cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(group, minlength=S * P).cumsum(0)])
        assert torch.equal(pos.long().reshape(-1), want_pos), (N, K, lens, "positions")
        assert torch.equal(cu, want_cu), (N, K, lens, "cu_seqlens")


def _inputs(B, T, H, c, dv, N, shared, segments, dtype):
    import torch
    x = lambda *s: torch.randn(*s).to(dtype).requires_grad_()  # noqa: E731

    def key_logits():  # distinct in every dtype, so the row-sparse top-r is the same set for kernel and reference
        return (torch.rand(B, T, H, c).argsort(-1) * (4 / c) - 2).to(dtype).requires_grad_()

    q, k_logits, v = x(B, T, H, c), key_logits(), x(B, T, H, dv)
    log_decay = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, c) * 2) / 16).to(dtype).requires_grad_()
    # Router logits stay float32: ties among bf16 logits would make top-K ambiguous between kernel and reference.
    return dict(q=q, k_logits=k_logits, v=v, log_decay=log_decay, router_logits=torch.randn(B, T, N).requires_grad_(),
                q_shared=x(B, T, H, c) if shared else None, k_shared_logits=key_logits() if shared else None,
                initial_state=torch.randn(segments, H, N + shared, c, dv).requires_grad_())


def _check_chunk(impl):
    import torch

    from kernels.gla import chunk_gla_torch
    from kernels.sse import sse_reference
    cases = [  # B, T, N, K, shared, row_topk, cu_seqlens (B = 1), initial state, dtype
        (1, 13, 4, 1, True, None, [0, 1, 1, 7, 13], True, torch.float32),   # empty and length-1 segments
        (2, 9, 8, 2, True, 5, None, True, torch.float32),                   # row-sparse, empty partitions
        (1, 6, 3, 3, False, None, None, False, torch.float32),              # K = N, no shared partition
        (1, 5, 1, 1, False, None, [0, 2, 5], True, torch.float32),          # N = 1: plain GLA
        (1, 7, 4, 2, True, 3, [0, 4, 7], True, torch.bfloat16),             # bf16 activations
    ]
    H, c, dv = 2, 16, 8
    for B, T, N, K, shared, row_topk, cu, with_state, dtype in cases:
        cu = None if cu is None else torch.tensor(cu)
        ins = _inputs(B, T, H, c, dv, N, shared, B if cu is None else cu.numel() - 1, dtype)
        if not with_state:
            ins["initial_state"] = None
        kw = dict(top_k=K, row_topk=row_topk, output_final_state=True, cu_seqlens=cu)
        o, final = impl(**ins, **kw, gla=chunk_gla_torch)
        ref_o, ref_final = sse_reference(**{n: None if x is None else x.double() for n, x in ins.items()}, **kw)
        do, dfinal = torch.randn_like(o, dtype=torch.float64), torch.randn_like(final, dtype=torch.float64)
        leaves = {n: x for n, x in ins.items() if x is not None}
        grads = torch.autograd.grad((o.double() * do).sum() + (final.double() * dfinal).sum(), list(leaves.values()))
        ref_grads = torch.autograd.grad((ref_o.double() * do).sum() + (ref_final * dfinal).sum(),
                                        list(leaves.values()))
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        errors = {"o": _rel(o, ref_o), "final": _rel(final, ref_final)}
        errors |= {f"d_{n}": _rel(g, r) for n, g, r in zip(leaves, grads, ref_grads)}
        print(B, T, N, K, shared, row_topk, dtype, {n: f"{e:.1e}" for n, e in errors.items()})
        assert max(errors.values()) < tol, errors


def check_chunk_varlen():
    from kernels.triton import sse_triton_varlen
    _check_chunk(sse_triton_varlen)


def check_chunk_mask():
    from kernels.triton import sse_triton_mask
    _check_chunk(sse_triton_mask)


def check_decode():
    import torch

    from kernels import sse_decode
    from kernels.sse import sse_reference
    H, c = 2, 16
    cases = [  # dv, N, K, shared, row_topk, dtype, state cache laid out partition-major (strided view)
        (8, 4, 1, True, None, torch.float32, False),
        (40, 8, 2, True, 5, torch.bfloat16, True),   # d_v over one column block and not a power of two
        (8, 3, 3, False, None, torch.float16, False),  # K = N, no shared partition
        (8, 1, 1, False, 4, torch.float32, True),      # N = 1
    ]
    for dv, N, K, shared, row_topk, dtype, strided in cases:
        P, num_slots = N + shared, 7
        slots = torch.tensor([3, -1, 0, 6, -1])
        ins = _inputs(len(slots), 1, H, c, dv, N, shared, num_slots, dtype)
        state = ins.pop("initial_state").detach()
        step = {n: None if x is None else x.detach()[:, 0] for n, x in ins.items()}
        cache = state.clone()
        if strided:
            cache = torch.empty(num_slots, P, H, c, dv).transpose(1, 2).copy_(state)
        o = sse_decode(cache, slots, **step, top_k=K, row_topk=row_topk, impl="triton")
        live = slots >= 0
        ref_o, ref_state = sse_reference(**{n: None if x is None else x.detach()[live] for n, x in ins.items()},
                                         top_k=K, row_topk=row_topk, initial_state=state[slots[live]],
                                         output_final_state=True)
        errors = {"o": _rel(o[live], ref_o[:, 0]), "state": _rel(cache[slots[live]], ref_state)}
        print(dv, N, K, shared, row_topk, dtype, strided, {n: f"{e:.1e}" for n, e in errors.items()})
        assert o.dtype == dtype and bool((o[~live] == 0).all()), "skipped rows must give zeros"
        assert max(errors.values()) < (1e-5 if dtype == torch.float32 else 1e-2), errors
        # Only the selected partitions and the shared one of the live slots change; the rest is not touched.
        selected = torch.zeros(len(slots), P, dtype=torch.bool)
        selected[:, :N].scatter_(1, step["router_logits"].float().topk(K, 1).indices, True)
        selected[:, N:] = True
        touched = torch.zeros(num_slots, P, dtype=torch.bool)
        touched[slots[live]] = selected[live]
        assert torch.equal(cache.transpose(1, 2)[~touched], state.transpose(1, 2)[~touched]), "untouched state moved"
    # Ties in the row-sparse top-r (common in bf16) keep exactly r rows, the lowest indices.
    cache = torch.zeros(1, 1, 2, 8, 4)
    ones, zeros = torch.ones(1, 1, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    sse_decode(cache, torch.tensor([0]), ones, zeros, torch.ones(1, 1, 4), zeros, torch.zeros(1, 1), top_k=1,
               q_shared=ones, k_shared_logits=zeros, row_topk=3, impl="triton")
    written = cache[0, 0].abs().sum(-1) > 0
    assert written[:, :3].all() and not written[:, 3:].any(), written


if __name__ == "__main__":
    name, seed = sys.argv[1], int(sys.argv[2])
    import torch
    torch.manual_seed(seed)
    random.seed(seed)
    globals()["check_" + name]()
