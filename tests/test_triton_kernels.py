"""The SSE Triton kernels against float64 references, one module for every device (the layout of
flash-linear-attention's tests/ops/test_gla.py: each test is parametrised over the device).

- "cpu": tiny shapes, the kernels interpreted (TRITON_INTERPRET=1) in a separate pytest process (marker
  `triton_interpret`, see tests/conftest.py): Triton decides when a kernel is decorated whether it is interpreted,
  so the variable is set before anything imports the kernels, and whatever other tests imported cannot interfere.
  The chunk paths run with the torch GLA core (`gla=chunk_gla_torch`): flash-linear-attention cannot run on CPU,
  and what is ours (routing, gather/scatter with weights, softmax keys, row-sparse masking, backward) is checked.
- "cuda": the real shapes (H = 16, c = d_v = 128, varlen batches up to 1000 tokens, one 32k-token sequence),
  float32 and bfloat16 activations, fla's `chunk_gla` as the GLA core. Marked `gpu`, so deselected by default:
  `pytest -m gpu tests/test_triton_kernels.py` on a machine with CUDA and fla. Each autotuned kernel runs with one
  config (fixture `one_triton_config`).
Router logits stay float32 everywhere: ties among bf16 logits would make top-K ambiguous between kernel and
reference. Errors are ||x - ref|| / ||ref|| (conftest.rel_err: NaN or inf never passes). Every test draws a fresh
seed, printed with a failure; SSE_TEST_SEED=<seed> replays it.
"""
import contextlib
import functools
import gc
import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err, runs_here

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

F32, BF16, F16, INT16 = torch.float32, torch.bfloat16, torch.float16, torch.int16
# Per device: heads, key dim c, value dim d_v; the segment lengths of the varlen batch (T = 1, empty, short, long);
# the length of the one sequence checked against the torch chunked path; the activation dtypes of those two checks.
SHAPES = {
    "cpu": dict(H=2, c=16, dv=8, lengths=[1, 0, 5, 9], long_T=40, dtypes=[F32]),
    "cuda": dict(H=16, c=128, dv=128, lengths=[1, 0, 37, 64, 300, 1000], long_T=32768, dtypes=[F32, BF16]),
}
# Bounds on the chunk paths' relative errors: fla computes float32 dots in tf32, hence the looser cuda bounds.
CHUNK_TOL = {"cpu": {F32: 1e-4, BF16: 2e-2}, "cuda": {F32: 1e-2, BF16: 3e-2}}
IMPLS = ["triton_varlen", "triton_mask", "triton_indexed"]


@pytest.fixture(params=[pytest.param("cpu", marks=pytest.mark.triton_interpret),
                        pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda":
        request.getfixturevalue("one_triton_config")
    return request.param


@pytest.fixture(autouse=True)
def seed(request):
    if not runs_here(request.node):
        return  # the case runs in a separate process, which draws its own seed
    seed = int(os.environ.get("SSE_TEST_SEED") or random.randrange(2**31))
    print(f"seed {seed} (replay: SSE_TEST_SEED={seed})")
    torch.manual_seed(seed)
    random.seed(seed)


def chunk_impl(name, device):
    """`sse_triton_varlen` or `sse_triton_mask` (on cpu with the torch GLA core), or `sse_triton_indexed` (on cpu
    with chunks of 8 rows, so the tiny shapes still cross chunks)."""
    if name == "triton_indexed":
        from kernels.triton.indexed_chunk import sse_triton_indexed
        return functools.partial(sse_triton_indexed, chunk_size=8) if device == "cpu" else sse_triton_indexed
    from kernels.triton import chunk
    impl = getattr(chunk, f"sse_{name}")
    if device == "cpu":
        from kernels.gla import chunk_gla_torch
        return functools.partial(impl, gla=chunk_gla_torch)
    return impl


def test_import_needs_no_triton_or_fla():
    code = """
import sys
import torch
import kernels
from kernels.dispatch import pick_implementation
assert "triton" not in sys.modules and "fla" not in sys.modules, "import kernels pulled in triton or fla"
assert not pick_implementation(torch.device("cpu")).startswith("triton")
assert {"triton_varlen", "triton_mask", "triton_indexed"} <= set(kernels.IMPLEMENTATIONS)
"""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def test_launch_settings_are_the_devices_entry_or_the_default(monkeypatch):
    """kernels/triton/configs.py: a GPU takes the entry its normalised name is or begins up to a "_" (the longest
    such), any other GPU and the CPU the default; the shipped entries give every kernel the default's settings."""
    from kernels.triton import configs
    assert configs.device_key("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    for entry in configs.CONFIGS.values():
        assert {k: set(v) for k, v in entry.items()} == {k: set(v) for k, v in configs.CONFIGS["default"].items()}
    h100, pcie, default = ({"decode": dict(tile_bytes=n * 4096, num_warps=n)} for n in (1, 2, 3))
    monkeypatch.setattr(configs, "CONFIGS", {"default": default, "nvidia_h100": h100, "nvidia_h100_pcie": pcie})
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "NVIDIA H1000", "NVIDIA H100"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[device.index])
    monkeypatch.setattr(configs, "_entry_of", functools.cache(configs._entry_of.__wrapped__))  # names read afresh
    got = [configs.launch_settings("decode", torch.device("cuda", i)) for i in range(len(names))]
    assert got == [h100["decode"], pcie["decode"], default["decode"], default["decode"], h100["decode"]]
    assert configs.launch_settings("decode", torch.device("cpu")) is default["decode"]
    from kernels.triton.decode import default_launch  # the decode kernel's launch comes from the table
    assert default_launch(128, 128, torch.bfloat16, torch.device("cuda", 1)) == (32, 2)  # 8 KiB of [128, 32] bf16


@pytest.mark.parametrize("variable, value", [
    pytest.param("TRITON_INTERPRET", "1", marks=pytest.mark.triton_interpret),
    pytest.param("TRITON_F32_DEFAULT", "ieee", marks=pytest.mark.exact_f32_dots)])
def test_marked_tests_run_in_a_process_with_their_environment(variable, value):
    """tests/conftest.py runs each such marker's tests in a pytest process of their own with its variable set (here,
    whatever the device)."""
    assert os.environ.get(variable) == value


@pytest.mark.parametrize("N, K, shared, lengths", [  # segment lengths: empty, length-1, blocks of 256 tokens crossed
    (4, 1, True, [1, 0, 6, 300, 213]),
    (8, 2, True, [3, 1, 2, 0]),     # short segments: most (segment, partition) groups are empty
    (5, 5, True, [7, 9]),           # K = N
    (1, 1, False, [1, 4]),          # N = 1 without shared partition: GLA
    (3, 2, False, [512]),           # exactly two token blocks
    (4, 1, True, [16500, 0, 400]),  # more token blocks than the kernels sum in one step (HIST_BLOCKS = 64)
], ids=["n4k1", "n8k2-short-segments", "k=n", "n1-gla", "two-blocks", "many-blocks"])
def test_routing_counting_sort(device, N, K, shared, lengths):
    from kernels.triton.routing import route_varlen
    bounds = torch.tensor([0] + lengths, device=device).cumsum(0)
    L, S, P, J = int(bounds[-1]), len(lengths), N + shared, K + shared
    logits = torch.randn(L, N, device=device, dtype=random.choice([F32, BF16]))
    idx, pos, cu, part, row_token, *_ = route_varlen(logits, bounds, K, shared)
    assert torch.equal(logits.gather(1, idx.long()), logits.topk(K, 1).values), "top-K"
    # Reference: a stable argsort of (segment, partition) over rows in (token, selection) order.
    want_part = torch.cat([idx.long(), torch.full((L, int(shared)), N, device=device)], 1)
    assert torch.equal(part.long(), want_part), "partitions"
    seg = torch.repeat_interleave(torch.arange(S, device=device), torch.tensor(lengths, device=device))
    group = (seg[:, None] * P + want_part).reshape(-1)
    want_pos = torch.empty(L * J, dtype=torch.long, device=device)
    want_pos[torch.argsort(group, stable=True)] = torch.arange(L * J, device=device)
    want_cu = torch.cat([torch.zeros(1, dtype=torch.long, device=device),
                         torch.bincount(group, minlength=S * P).cumsum(0)])
    assert torch.equal(pos.long().reshape(-1), want_pos), "positions"
    assert torch.equal(cu, want_cu), "cu_seqlens"
    want_row_token = torch.empty(L * J, dtype=torch.long, device=device)
    want_row_token[want_pos] = torch.arange(L, device=device).repeat_interleave(J)
    assert torch.equal(row_token.long(), want_row_token), "row -> token"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, BF16])
def test_carve_gives_aligned_disjoint_parts(dtype):
    """The routing tables come from one allocation: every part has its length, starts 16-byte aligned (Triton
    specialises on it) and owns its elements (writing one part leaves the others as they were)."""
    from kernels.triton.common import carve
    sizes = [random.randrange(0, 40) for _ in range(6)] + [0, 1, 3]
    parts = carve(sizes, dtype, torch.device("cpu"))
    assert [p.numel() for p in parts] == sizes and all(p.dtype == dtype and p.is_contiguous() for p in parts)
    assert all(p.data_ptr() % 16 == 0 for p in parts), [p.data_ptr() % 16 for p in parts]
    for i, p in enumerate(parts):
        p.fill_(i)
    assert all(bool((p == i).all()) for i, p in enumerate(parts))


def test_routing_nan_logits_pick_real_partitions(device):
    """Router logits gone NaN route to real partitions: a NaN counts as the largest score (torch.topk's order), and
    a row of NaNs takes the lowest indices; the rows and groups stay consistent (no partition past N)."""
    from kernels.triton.routing import route_varlen
    N, K = 3, 2
    logits = torch.randn(6, N, device=device)
    logits[1, 2] = logits[4, 0] = float("nan")
    logits[3] = float("nan")
    idx, pos, cu, part, row_token, *_ = route_varlen(logits, torch.tensor([0, 6], device=device), K, True)
    assert torch.equal(idx[3].long(), torch.arange(K, device=device)), idx
    rows = [0, 1, 2, 4, 5]
    assert torch.equal(idx[rows].long(), logits[rows].topk(K, 1).indices), idx
    assert int(cu[-1]) == 6 * (K + 1) and bool((cu.diff() >= 0).all()), cu
    assert torch.equal(torch.sort(row_token.long()).values, torch.arange(6, device=device).repeat_interleave(K + 1))


@pytest.mark.parametrize("lengths", [[0], [5, 0, 70, 1], None],  # None: 60 random segments, 300 groups
                         ids=["empty", "short", "more-groups-and-slots-than-a-program-takes"])
def test_chunk_index(device, lengths):
    from kernels.triton.indexed_chunk import index_tables
    N, K, chunk = 4, 1, 16
    lengths = lengths or [random.randrange(0, 150) for _ in range(60)]
    bounds = torch.tensor([0] + lengths, device=device).cumsum(0)
    L = int(bounds[-1])
    row_token, cu, chunk_first, chunk_group, *_ = index_tables(torch.randn(L, N, device=device), bounds, K, True,
                                                               chunk)
    chunks = (cu.diff() + chunk - 1) // chunk
    want_first = torch.cat([chunks.new_zeros(1), chunks.cumsum(0)])
    slots = torch.arange(chunk_group.numel(), device=device)
    assert chunk_group.numel() == -(-L * (K + 1) // chunk) + len(lengths) * (N + 1)
    assert torch.equal(chunk_first, want_first), "first chunk of each group"
    assert torch.equal(chunk_group.long(), torch.searchsorted(want_first[1:], slots, right=True)), "group of each slot"


# ---------------------------------------------------------------------------------------------------------------
# Training paths: forward and every gradient.

def random_inputs(B, T, H, c, dv, N, shared, segments, dtype, device):
    """Leaves in `dtype` (router logits and the initial state float32). Key logits are distinct in every dtype, so
    the row-sparse top-r is the same set for kernel and reference."""
    def leaf(*shape):
        return torch.randn(*shape, device=device).to(dtype).requires_grad_()

    def key_logits():
        return (torch.rand(B, T, H, c, device=device).argsort(-1) * (4 / c) - 2).to(dtype).requires_grad_()

    log_decay = torch.nn.functional.logsigmoid(torch.randn(B, T, H, c, device=device) * 2) / 16
    return dict(q=leaf(B, T, H, c), k_logits=key_logits(), v=leaf(B, T, H, dv),
                log_decay=log_decay.to(dtype).requires_grad_(),
                router_logits=torch.randn(B, T, N, device=device).requires_grad_(),
                q_shared=leaf(B, T, H, c) if shared else None, k_shared_logits=key_logits() if shared else None,
                initial_state=torch.randn(segments, H, N + shared, c, dv, device=device).requires_grad_())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B, T, N, K, shared, row_topk, cu_seqlens, with_state, dtype, replayed", [
    (1, 13, 4, 1, True, None, [0, 1, 1, 7, 13], True, F32, False),  # empty and length-1 segments
    (2, 9, 8, 2, True, 5, None, True, F32, False),                   # row-sparse, empty partitions
    (1, 6, 3, 3, False, None, None, False, F32, False),              # K = N, no shared partition
    (1, 5, 1, 1, False, None, [0, 2, 5], True, F32, False),          # N = 1: plain GLA
    (1, 7, 4, 2, True, 3, [0, 4, 7], True, BF16, False),             # bf16 activations
    (2, 11, 6, 2, True, None, None, True, F32, True),                # replayed routes, not the router's top-K
], ids=["empty-and-length-1-segments", "row-sparse-batch-2", "k=n-no-shared", "n1-gla", "bf16", "replayed-routes"])
def test_chunk_small_cases(device, impl, B, T, N, K, shared, row_topk, cu_seqlens, with_state, dtype, replayed):
    from kernels.sse import sse_reference
    if device == "cpu" and impl == "triton_indexed" and dtype == BF16:
        pytest.skip("Triton's interpreter gets bfloat16 tl.dot wrong (triton 3.9: errors ~1e10); cuda checks it")
    H, c, dv = (SHAPES[device][n] for n in ("H", "c", "dv"))
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    ins = random_inputs(B, T, H, c, dv, N, shared, B if cu is None else cu.numel() - 1, dtype, device)
    if not with_state:
        ins["initial_state"] = None
    kw = dict(top_k=K, row_topk=row_topk, output_final_state=True, cu_seqlens=cu)
    if replayed:  # a random K-subset per token: the kernels must route by it and weigh by the router's softmax
        kw["route_index"] = torch.rand(B, T, N, device=device).argsort(-1)[..., :K]
    o, final = chunk_impl(impl, device)(**ins, **kw)
    ref_o, ref_final = sse_reference(**{n: None if x is None else x.double() for n, x in ins.items()}, **kw)
    do, dfinal = torch.randn_like(o, dtype=torch.float64), torch.randn_like(final, dtype=torch.float64)
    leaves = {n: x for n, x in ins.items() if x is not None}
    grads = torch.autograd.grad((o.double() * do).sum() + (final.double() * dfinal).sum(), list(leaves.values()))
    ref_grads = torch.autograd.grad((ref_o.double() * do).sum() + (ref_final * dfinal).sum(), list(leaves.values()))
    errors = {"o": rel_err(o, ref_o), "final": rel_err(final, ref_final)}
    errors |= {f"d_{n}": rel_err(g, r) for n, g, r in zip(leaves, grads, ref_grads)}
    print({n: f"{e:.1e}" for n, e in errors.items()})
    assert max(errors.values()) < CHUNK_TOL[device][dtype], errors


@pytest.mark.parametrize("B, cu_seqlens, decay_logits", [(2, None, False), (1, [0, 1, 9, 9, 14], True)],
                         ids=["batch-2", "varlen-decay-logits"])
def test_indexed_chunk_reads_column_blocks(device, B, cu_seqlens, decay_logits):
    """q, k_logits and v as column blocks of one wider tensor (as the SSE layer's one projection GEMM makes them,
    tokens further apart than their values) are read in place and give what their contiguous copies give: the
    same output and gradients, against the float64 reference (with the decay logits read by the kernels too)."""
    from kernels.sse import log_decay_from_logits, sse_reference
    H, c, dv = (SHAPES[device][n] for n in ("H", "c", "dv"))
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    T, N = 14, 3
    ins = random_inputs(B, T, H, c, dv, N, True, B if cu is None else cu.numel() - 1, F32, device)
    # one wide leaf [B, T, 2 H c + H dv + 5] whose blocks are q, k_logits and v (5 columns of padding after them)
    wide = torch.cat([ins[n].detach().reshape(B, T, -1) for n in ("q", "k_logits", "v")]
                     + [torch.randn(B, T, 5, device=device)], -1).requires_grad_()
    q, k, v, _ = wide.split([H * c, H * c, H * dv, 5], -1)
    blocks = dict(ins, q=q.view(B, T, H, c), k_logits=k.view(B, T, H, c), v=v.view(B, T, H, dv))
    kw = dict(top_k=2, output_final_state=True, cu_seqlens=cu)
    o, final = chunk_impl("triton_indexed", device)(**blocks, **kw, decay_normalizer=16.0 if decay_logits else None)
    ref_in = {n: None if x is None else x.detach().double() for n, x in ins.items()}
    ref_leaves = [ref_in[n].requires_grad_() for n in ("q", "k_logits", "v")]
    if decay_logits:
        ref_in["log_decay"] = log_decay_from_logits(ref_in["log_decay"], 16.0)
    ref_o, ref_final = sse_reference(**ref_in, **kw)
    do = torch.randn_like(o)
    (d_wide,) = torch.autograd.grad((o * do).sum(), [wide])
    ref_grads = torch.autograd.grad((ref_o * do.double()).sum(), ref_leaves)
    got_grads = d_wide.split([H * c, H * c, H * dv, 5], -1)
    errors = {"o": rel_err(o, ref_o), "final": rel_err(final, ref_final)}
    errors |= {f"d_{n}": rel_err(g.reshape(r.shape), r) for n, g, r in zip(("q", "k", "v"), got_grads, ref_grads)}
    print({n: f"{e:.1e}" for n, e in errors.items()})
    assert max(errors.values()) < CHUNK_TOL[device][F32], errors


def test_token_rows_reads_in_place_or_copies():
    """`token_rows`: tokens at one stride with each token's values contiguous are taken as they are (contiguous
    tensors, column blocks, single tokens); any other layout is copied to contiguous."""
    from kernels.triton.common import token_rows
    wide = torch.randn(2, 5, 3 * 4 + 7)
    block = wide[..., 4:16].view(2, 5, 3, 4)
    cases = {"contiguous": (torch.randn(2, 5, 3, 4), True, 12), "column block": (block, True, 19),
             "one token": (block[:1, 2:3], True, 12), "permuted": (torch.randn(5, 2, 3, 4).transpose(0, 1), False, 12),
             "heads apart": (torch.randn(2, 5, 4, 3).transpose(2, 3), False, 12),
             "broadcast tokens": (torch.randn(1, 1, 3, 4).expand(2, 5, 3, 4), False, 12)}
    for name, (x, in_place, stride) in cases.items():
        got, s = token_rows(x)
        assert torch.equal(got, x) and (got.data_ptr() == x.data_ptr()) == in_place and s == stride, name
        tokens = x.shape[0] * x.shape[1]
        rows = got.as_strided((tokens, 12), (s, 1))  # what a kernel reads: token i's 12 values at i * s
        assert torch.equal(rows, x.reshape(tokens, 12)), name


def assert_strongly_decaying_matches_reference(ins, cu, device):
    """The indexed path's output and gradients against the float64 reference on float32 inputs with strong decays
    in part (top-1 routing); the log-decay gradient to its own bound (the next test says why)."""
    from kernels.sse import sse_reference
    _, T, H, c = ins["q"].shape
    kw = dict(top_k=1, cu_seqlens=cu)
    cot = cotangents_for(T, H, ins["router_logits"].shape[-1], c, ins["v"].shape[-1], cu.numel() - 1, device)
    got = forward_backward(chunk_impl("triton_indexed", device), ins, cot, **kw)
    ref = forward_backward(sse_reference, {n: x.detach().double().requires_grad_() for n, x in ins.items()}, cot,
                           **kw)
    errors = {n: rel_err(got[n], ref[n]) for n in ref}
    print({n: f"{e:.1e}" for n, e in errors.items()})
    assert errors.pop("d_log_decay") < 1e-2, "d_log_decay"
    assert max(errors.values()) < CHUNK_TOL[device][F32], errors


def test_indexed_chunk_pairwise_scores_for_strong_decays(device):
    """Decays of ~e^-12 per token overflow the factorised scores' e^-b within a chunk, so those chunks take the
    pairwise form; head 0 keeps mild decays, so one call runs both forms. The log-decay gradient of a strongly
    decaying sequence is a small difference of large terms (q dq - k dk): float32 loses ~1e-3 of it (the torch
    chunked path in float32 as much), hence its own bound."""
    H, c, dv, lengths = (SHAPES[device][n] for n in ("H", "c", "dv", "lengths"))
    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    T, N = int(cu[-1]), 4
    ins = random_inputs(1, T, H, c, dv, N, True, len(lengths), F32, device)
    strong = torch.nn.functional.logsigmoid(torch.randn(1, T, H, c, device=device) * 2 - 12)
    strong[:, :, 0] = ins["log_decay"][:, :, 0].detach()
    ins["log_decay"] = strong.requires_grad_()
    assert_strongly_decaying_matches_reference(ins, cu, device)


@pytest.mark.parametrize("key_blocks", [2.0, 1.5], ids=["two-key-blocks", "second-block-part-masked"])
def test_indexed_chunk_splits_dq_dk_dg_by_key_columns(device, key_blocks, monkeypatch):
    """`_dq_dk_dg_kernel` runs a program per block of key columns (the device's "dq_dk_dg" BLOCK_C,
    kernels/triton/configs.py); each rebuilds its columns' rows and decides on its own whether its scores take the
    pairwise form. Keys of two blocks, or one and a half (the second block's last columns masked), against the
    float64 reference, on a varlen batch whose head 1 decays strongly in its first half of key columns only (so one
    program of a chunk takes the pairwise form and the other the factorised one) and the other heads mildly."""
    from kernels.triton.configs import launch_settings
    launch = launch_settings("indexed_chunk", torch.device(device))
    block = 16 if device == "cpu" else launch["dq_dk_dg"]["BLOCK_C"]
    monkeypatch.setitem(launch, "dq_dk_dg", {**launch["dq_dk_dg"], "BLOCK_C": block})
    H, dv, lengths = (SHAPES[device][n] for n in ("H", "dv", "lengths"))
    c = int(block * key_blocks)
    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    T, N = int(cu[-1]), 4
    ins = random_inputs(1, T, H, c, dv, N, True, len(lengths), F32, device)
    log_decay = ins["log_decay"].detach().clone()
    log_decay[:, :, 1, :block // 2] = torch.nn.functional.logsigmoid(torch.randn(1, T, block // 2, device=device) - 12)
    ins["log_decay"] = log_decay.requires_grad_()
    assert_strongly_decaying_matches_reference(ins, cu, device)


@pytest.mark.parametrize("kept", [True, False], ids=["states-kept", "states-recomputed"])
def test_indexed_chunk_backward_keeps_or_recomputes_states(device, kept, monkeypatch):
    """The backward takes the forward's per-chunk states, keys and log-decays when they fit `KEPT_BYTES` and makes
    them again otherwise (one `_row_sources` and one `_chained` call more): both against the float64 reference, on a
    varlen batch with initial states."""
    from kernels.sse import sse_reference
    from kernels.triton import indexed_chunk
    monkeypatch.setattr(indexed_chunk, "KEPT_BYTES", 2**62 if kept else 0)
    chained = []
    real_chained = indexed_chunk._chained
    monkeypatch.setattr(indexed_chunk, "_chained", lambda *a, **k: chained.append(k["query"]) or real_chained(*a, **k))
    real_sources = indexed_chunk._row_sources
    monkeypatch.setattr(indexed_chunk, "_row_sources", lambda *a: chained.append("sources") or real_sources(*a))
    H, c, dv, lengths = (SHAPES[device][n] for n in ("H", "c", "dv", "lengths"))
    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    T, N = int(cu[-1]), 4
    failures = []
    for dtype in SHAPES[device]["dtypes"]:
        inputs = exact_in_bf16_inputs(T, H, c, dv, N, len(lengths), device)
        kw = dict(top_k=1, cu_seqlens=cu)
        cot = cotangents_for(T, H, N, c, dv, len(lengths), device)
        chained.clear()
        got = forward_backward(chunk_impl("triton_indexed", device), as_leaves(inputs, dtype), cot, **kw)
        want = ["sources", False, True] if kept else ["sources", False, "sources", False, True]
        assert chained == want, chained
        ref = forward_backward(sse_reference, as_leaves(inputs, torch.float64), cot, **kw)
        errors = {n: rel_err(got[n], ref[n]) for n in ref}
        line = f"{str(dtype)[6:]}: " + " ".join(f"{n}={e:.1e}" for n, e in errors.items())
        print(line)
        if max(errors.values()) >= CHUNK_TOL[device][dtype]:
            failures.append(line)
    assert not failures, "\n".join(failures)


def test_indexed_chunk_saves_each_allocation_once(device):
    """The operator saves each allocation once (`kernels.saved_views`): the routing tables (views of two), the keys
    and log-decays (views of one) and column blocks of one input tensor each cost a saved variable, and under
    gradient checkpointing Python hooks, otherwise. The gradients through those saves: the tests above."""
    H, c, dv = (SHAPES[device][n] for n in ("H", "c", "dv"))
    T, N = 20, 4
    ins = random_inputs(1, T, H, c, dv, N, True, 1, F32, device)
    qkv = torch.randn(1, T, H, 2 * c + dv, device=device, requires_grad=True)  # q, k, v as column blocks of one
    ins["q"], ins["k_logits"], ins["v"] = qkv.split([c, c, dv], -1)
    packed = []

    def pack(t):
        packed.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = chunk_impl("triton_indexed", device)(**ins, top_k=1)
    storages = [t.untyped_storage().data_ptr() for t in packed]
    assert len(storages) == len(set(storages)), [tuple(t.shape) for t in packed]
    o.sum().backward()  # through the views rebuilt on qkv
    assert torch.isfinite(qkv.grad).all() and qkv.grad.abs().sum() > 0


@pytest.mark.parametrize("replayed", [True, False], ids=["replayed", "above-the-bound"])
def test_checkpoint_recomputation_replays_the_indexed_operator(device, replayed, monkeypatch):
    """Under checkpoint with a `kernels.CheckpointReplay`'s contexts, the replay passed to the operator, the
    recomputation takes the first forward's routing tables and output and runs no operator forward; the backward
    makes the states (one more forward `_chained`). Output and gradients equal the plain call's bit for bit, on a
    varlen batch with initial states, also in a second backward of the same graph. Above the bound (KEPT_BYTES) both
    forwards compute, as without the replay."""
    from torch.utils.checkpoint import checkpoint

    from kernels import CheckpointReplay, checkpoint_replay
    from kernels.triton import indexed_chunk
    if not replayed:
        monkeypatch.setattr(checkpoint_replay, "KEPT_BYTES", -1)
    calls = []
    for name in ("index_tables", "_forward", "_chained"):
        real = getattr(indexed_chunk, name)
        monkeypatch.setattr(indexed_chunk, name, lambda *a, name=name, real=real, **k: calls.append(
            (name, k["query"]) if name == "_chained" else name) or real(*a, **k))
    H, c, dv, lengths = (SHAPES[device][n] for n in ("H", "c", "dv", "lengths"))
    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    T, N = int(cu[-1]), 4
    ins = random_inputs(1, T, H, c, dv, N, True, len(lengths), F32, device)
    names = list(ins)
    op = chunk_impl("triton_indexed", device)

    def layer(*xs, replay=None):
        return op(**dict(zip(names, xs)), top_k=1, cu_seqlens=cu, replay=replay)[0] * 1.5

    def step(checkpointed):
        leaves = [t.detach().clone().requires_grad_() for t in ins.values()]
        calls.clear()
        replay = CheckpointReplay()
        o = (checkpoint(functools.partial(layer, replay=replay), *leaves, use_reentrant=False,
                        context_fn=replay.contexts) if checkpointed else layer(*leaves))
        loss = o.pow(2).sum()
        loss.backward(retain_graph=True)
        first = [t.grad.clone() for t in leaves]
        forward_calls = list(calls)
        for t in leaves:
            t.grad = None
        loss.backward()
        assert all(torch.equal(a, t.grad) for a, t in zip(first, leaves)), "second backward"
        return o.detach(), first, forward_calls
    o, grads, plain_calls = step(checkpointed=False)
    o_ck, grads_ck, ck_calls = step(checkpointed=True)
    assert plain_calls == ["index_tables", "_forward", ("_chained", False), ("_chained", True)]
    backward = [("_chained", False), ("_chained", True)] if replayed else \
        ["index_tables", "_forward", ("_chained", False), ("_chained", True)]
    assert ck_calls == ["index_tables", "_forward", ("_chained", False)] + backward, ck_calls
    assert torch.equal(o_ck, o)
    assert all(torch.equal(a, b) for a, b in zip(grads_ck, grads)), [rel_err(a, b) for a, b in zip(grads_ck, grads)]


@pytest.mark.parametrize("row_topk", [None, 4], ids=["dense", "row-sparse"])
def test_indexed_chunk_takes_decay_logits(device, row_topk):
    """With `decay_normalizer` the indexed path takes decay logits x and applies log a = logsigmoid(x) / 16 in its
    kernels (forward, and the backward through it): against the float64 reference given log a, on a varlen batch
    whose x spans strong decays (-30), tiny ones (+30) and pad tokens (+inf: log a = 0 and no gradient)."""
    from kernels import sse_attention
    from kernels.sse import log_decay_from_logits, sse_reference
    H, c, dv, lengths = (SHAPES[device][n] for n in ("H", "c", "dv", "lengths"))
    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    T, N = int(cu[-1]), 4
    failures = []
    for dtype in SHAPES[device]["dtypes"]:
        ins = random_inputs(1, T, H, c, dv, N, True, len(lengths), dtype, device)
        x = torch.randn(1, T, H, c, device=device) * 4
        x[:, :, :, 0] = torch.linspace(-30, 30, T, device=device)[:, None]
        x[:, T // 3] = float("inf")
        ins["log_decay"] = x.to(dtype).requires_grad_()
        kw = dict(top_k=1, cu_seqlens=cu, row_topk=row_topk)
        cot = cotangents_for(T, H, N, c, dv, len(lengths), device)
        got = forward_backward(functools.partial(sse_attention, impl="triton_indexed", decay_normalizer=16.0), ins,
                               cot, **kw)
        leaves = {n: x.detach().double().requires_grad_() for n, x in ins.items()}

        def reference(log_decay, **rest):
            return sse_reference(log_decay=log_decay_from_logits(log_decay, 16.0), **rest)
        ref = forward_backward(reference, leaves, cot, **kw)
        errors = {n: rel_err(got[n], ref[n]) for n in ref}
        line = f"{str(dtype)[6:]}: " + " ".join(f"{n}={e:.1e}" for n, e in errors.items())
        print(line)
        if max(errors.values()) >= CHUNK_TOL[device][dtype]:
            failures.append(line)
        assert torch.equal(got["d_log_decay"][:, T // 3], torch.zeros_like(got["d_log_decay"][:, T // 3]))
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.usefixtures("one_triton_config")
def test_indexed_path_compiles_once_for_all_counts():
    """vLLM's prefill steps and packed training batches call the indexed path and the norm gate with token,
    segment and chunk counts that change from call to call. Triton specialises an integer argument on being 1 or
    a multiple of 16 unless told not to, and each new variant compiles for seconds in the middle of a rollout
    (seen in vLLM rollouts: dev/LOG.md). After one call, forward and
    backward with other counts (one segment, lengths 1, 16 and 64, many segments) must compile nothing."""
    import triton

    from kernels import norm_gate, sse_attention
    from kernels.triton import expand, indexed_chunk, routing
    from kernels.triton import norm_gate as norm_gate_kernels
    jitted = {f"{m.__name__}.{n}": f for m in (indexed_chunk, routing, expand, norm_gate_kernels)
              for n, f in vars(m).items() if isinstance(f, triton.runtime.JITFunction)}

    def variants():
        return {n: sum(len(cache[0]) for cache in f.device_caches.values()) for n, f in jitted.items()}

    H, c, dv, N = 16, 128, 128, 4

    def call(lengths):
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
        T = int(cu[-1])
        ins = as_leaves(exact_in_bf16_inputs(T, H, c, dv, N, len(lengths), "cuda"), BF16)
        o, final = sse_attention(**ins, top_k=1, cu_seqlens=cu, output_final_state=True, decay_normalizer=16.0,
                                 impl="triton_indexed")
        y = norm_gate(o, torch.ones(dv, device="cuda", requires_grad=True), o, eps=1e-6)
        (y.float().sum() + final.sum()).backward()

    call([5, 40])
    before = variants()
    for lengths in ([1], [16], [64], [1, 1, 1], [17, 64, 300, 2], [33] * 16, [1000]):
        call(lengths)
    after = variants()
    assert after == before, {n: (before[n], after[n]) for n in before if after[n] != before[n]}


def exact_in_bf16_inputs(T, H, c, dv, N, segments, device):
    """float32 inputs [1, T, ...] whose activations are exact in bf16, so one float64 reference serves every dtype.
    Key logits are distinct within each head (a permutation of a grid), so the row-sparse top-r has no ties."""
    def bf16_exact(*shape):
        return torch.randn(*shape, device=device).bfloat16().float()

    def key_logits():
        return torch.rand(1, T, H, c, device=device).argsort(-1).float() * (4 / c) - 2

    log_decay = (torch.nn.functional.logsigmoid(torch.randn(1, T, H, c, device=device) * 2) / 16).bfloat16()
    return dict(q=bf16_exact(1, T, H, c), k_logits=key_logits(), v=bf16_exact(1, T, H, dv),
                log_decay=log_decay.float(), router_logits=torch.randn(1, T, N, device=device),
                q_shared=bf16_exact(1, T, H, c), k_shared_logits=key_logits(),
                initial_state=torch.randn(segments, H, N + 1, c, dv, device=device))


def as_leaves(inputs, dtype):
    """The activations in `dtype` (router logits and states stay float32) as fresh leaves."""
    keep = ("router_logits", "initial_state")
    return {n: (x if n in keep else x.to(dtype)).detach().clone().requires_grad_() for n, x in inputs.items()}


def forward_backward(fn, ins, cotangents, **kw):
    """Outputs and gradients of sum(o * do) + sum(final * dfinal) w.r.t. every input."""
    o, final = fn(**ins, **kw, output_final_state=True)
    do, dfinal = cotangents
    loss = (o.double() * do).sum() + (final.double() * dfinal).sum()
    grads = torch.autograd.grad(loss, list(ins.values()))
    return {"o": o.detach(), "final": final.detach()} | {f"d_{n}": g for n, g in zip(ins, grads)}


def cotangents_for(T, H, N, c, dv, segments, device):
    return (torch.randn(1, T, H, dv, device=device, dtype=torch.float64),
            torch.randn(segments, H, N + 1, c, dv, device=device, dtype=torch.float64))


def check_against(ref, against, device, inputs, cotangents, **kw):
    """Both Triton paths in every dtype of the device against `ref`; all errors printed, then asserted."""
    failures = []
    for dtype in SHAPES[device]["dtypes"]:
        for impl in IMPLS:
            got = forward_backward(chunk_impl(impl, device), as_leaves(inputs, dtype), cotangents, **kw)
            errors = {n: rel_err(got[n], ref[n]) for n in ref}
            ok = max(errors.values()) < CHUNK_TOL[device][dtype]
            line = f"{impl} {str(dtype)[6:]} vs {against}: " + " ".join(f"{n}={e:.1e}" for n, e in errors.items())
            print(("ok   " if ok else "FAIL ") + line)
            if not ok:
                failures.append(line)
            del got
    assert not failures, "\n".join(failures)


# (N, K, row-sparse with r = c / 4), with shared partition
CONFIGS = {"n4k1": (4, 1, False), "n8k2": (8, 2, False), "n4k1-rowsparse": (4, 1, True)}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_chunk_varlen_batch_vs_reference(device, config):
    """A varlen batch of T = 1, empty, short and (on cuda) ~1k-token segments with initial states, against the
    float64 token loop."""
    from kernels.sse import sse_reference
    N, K, row_sparse = CONFIGS[config]
    shape = SHAPES[device]
    H, c, dv, lengths = shape["H"], shape["c"], shape["dv"], shape["lengths"]
    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    T = int(cu[-1])
    inputs = exact_in_bf16_inputs(T, H, c, dv, N, len(lengths), device)
    kw = dict(top_k=K, cu_seqlens=cu, row_topk=c // 4 if row_sparse else None)
    cot = cotangents_for(T, H, N, c, dv, len(lengths), device)
    ref = forward_backward(sse_reference, as_leaves(inputs, torch.float64), cot, **kw)
    check_against(ref, "reference f64", device, inputs, cot, **kw)


def torch_f64_by_heads(ins, cotangents, head_group, **kw):
    """chunk_torch_varlen in float64, a few heads at a time to bound memory (heads only meet in the router)."""
    from kernels.sse import sse_chunk_varlen
    H = ins["q"].shape[2]
    leaves = {n: x.detach().double().requires_grad_() for n, x in ins.items()}
    outs = {"o": [], "final": []}
    for h in range(0, H, head_group):
        part = {n: x[:, :, h:h + head_group] if x.dim() == 4 and n != "router_logits" else x
                for n, x in leaves.items()}
        part["initial_state"] = leaves["initial_state"][:, h:h + head_group]
        o, final = sse_chunk_varlen(**part, **kw, output_final_state=True)
        do, dfinal = cotangents[0][:, :, h:h + head_group], cotangents[1][:, h:h + head_group]
        ((o * do).sum() + (final * dfinal).sum()).backward()
        outs["o"].append(o.detach())
        outs["final"].append(final.detach())
    return {"o": torch.cat(outs["o"], 2), "final": torch.cat(outs["final"], 1)} | {
        f"d_{n}": x.grad for n, x in leaves.items()}


@pytest.mark.parametrize("config", ["n4k1", "n8k2"])
def test_chunk_long_sequence_vs_torch_path(device, config):
    """One long sequence (32k tokens on cuda) against the torch chunked path `chunk_torch_varlen` in float64 (the
    token loop is too slow there); that path is itself tested against the reference in tests/test_sse_operator.py."""
    N, K, _ = CONFIGS[config]
    shape = SHAPES[device]
    H, c, dv, T = shape["H"], shape["c"], shape["dv"], shape["long_T"]
    inputs = exact_in_bf16_inputs(T, H, c, dv, N, 1, device)
    kw = dict(top_k=K, cu_seqlens=torch.tensor([0, T], device=device), row_topk=None)
    cot = cotangents_for(T, H, N, c, dv, 1, device)
    ref = torch_f64_by_heads(inputs, cot, head_group=4 if device == "cuda" else 1, **kw)
    check_against(ref, "chunk_torch_varlen f64", device, inputs, cot, **kw)


# ---------------------------------------------------------------------------------------------------------------
# Decode: the fused in-place step.

@pytest.mark.parametrize("dv, N, K, shared, row_topk, dtype, strided", [  # strided: cache laid out partition-major
    (8, 4, 1, True, None, F32, False),
    (40, 8, 2, True, 5, BF16, True),     # d_v over one column block and not a power of two
    (8, 3, 3, False, None, F16, False),  # K = N, no shared partition
    (8, 1, 1, False, 4, F32, True),      # N = 1
], ids=["f32", "dv40-bf16-strided", "k=n-no-shared-f16", "n1-strided"])
def test_decode_small_cases(device, dv, N, K, shared, row_topk, dtype, strided):
    from kernels import sse_decode
    from kernels.sse import sse_reference
    H, c = SHAPES[device]["H"], SHAPES[device]["c"]
    P, num_slots = N + shared, 7
    slots = torch.tensor([3, -1, 0, 6, -1], device=device)
    ins = random_inputs(len(slots), 1, H, c, dv, N, shared, num_slots, dtype, device)
    state = ins.pop("initial_state").detach()
    step = {n: None if x is None else x.detach()[:, 0] for n, x in ins.items()}
    cache = state.clone()
    if strided:
        cache = torch.empty(num_slots, P, H, c, dv, device=device).transpose(1, 2).copy_(state)
    o = sse_decode(cache, slots, **step, top_k=K, row_topk=row_topk, impl="triton")
    live = slots >= 0
    ref_o, ref_state = sse_reference(**{n: None if x is None else x.detach()[live] for n, x in ins.items()},
                                     top_k=K, row_topk=row_topk, initial_state=state[slots[live]],
                                     output_final_state=True)
    errors = {"o": rel_err(o[live], ref_o[:, 0]), "state": rel_err(cache[slots[live]], ref_state)}
    print({n: f"{e:.1e}" for n, e in errors.items()})
    assert o.dtype == dtype and bool((o[~live] == 0).all()), "skipped rows must give zeros"
    assert max(errors.values()) < (1e-5 if dtype == F32 else 1e-2), errors
    # Only the selected partitions and the shared one of the live slots change; the rest is not touched.
    selected = torch.zeros(len(slots), P, dtype=torch.bool, device=device)
    selected[:, :N].scatter_(1, step["router_logits"].float().topk(K, 1).indices, True)
    selected[:, N:] = True
    touched = torch.zeros(num_slots, P, dtype=torch.bool, device=device)
    touched[slots[live]] = selected[live]
    assert torch.equal(cache.transpose(1, 2)[~touched], state.transpose(1, 2)[~touched]), "untouched state moved"


@pytest.mark.parametrize("row_topk", [None, 16], ids=["dense", "r16"])
@pytest.mark.parametrize("dtype, state_dtype", [(F32, F32), (BF16, F32), (F16, F32), (F32, BF16), (F32, INT16),
                                                (BF16, INT16)],
                         ids=["f32", "bf16", "f16", "bf16-state", "int16-state", "bf16-int16-state"])
@pytest.mark.parametrize("N, K", [(4, 1), (8, 2)], ids=["n4k1", "n8k2"])
def test_decode_vs_reference(device, N, K, dtype, state_dtype, row_topk):
    """A batch of 8 with two skipped rows (slot -1) on a cache of 32 slots, at the device's shapes. A bfloat16 or
    int16 cache (vLLM's mamba_ssm_cache_dtype, or its default for a 16-bit model) holds states exact in its format
    (the int16 one partition-major, as vLLM lays it out) and gets float32 inputs (bf16 ties among key logits could
    pick other rows under row_topk), so the only new error is the one rounding of each updated state, which the
    torch twin makes too."""
    from kernels import states_from_cache, states_to_cache
    from kernels.sse import sse_decode_torch, sse_reference
    from kernels.triton import sse_decode_triton
    H, c, dv = (SHAPES[device][n] for n in ("H", "c", "dv"))
    slots = torch.tensor([5, -1, 0, 17, 9, -1, 31, 2], device=device)
    inputs = exact_in_bf16_inputs(len(slots), H, c, dv, N, 1, device)
    step = {n: x[0].to(F32 if n == "router_logits" else dtype) for n, x in inputs.items() if n != "initial_state"}
    states = torch.randn(32, H, N + 1, c, dv, device=device)
    cache = partition_major_cache(states, state_dtype) if state_dtype == INT16 else states_to_cache(states, state_dtype)
    before = cache.clone()
    state = states_from_cache(before)
    o = sse_decode_triton(cache, slots, **step, top_k=K, row_topk=row_topk)
    live = slots >= 0
    ref_o, ref_state = sse_reference(**{n: v[live][:, None] for n, v in step.items()}, top_k=K, row_topk=row_topk,
                                     initial_state=state[slots[live]], output_final_state=True)
    untouched = torch.ones(32, dtype=torch.bool, device=device)
    untouched[slots[live]] = False
    errors = {"o": rel_err(o[live], ref_o[:, 0]), "state": rel_err(states_from_cache(cache[slots[live]]), ref_state)}
    print({n: f"{e:.1e}" for n, e in errors.items()})
    tolerance = {F32: 1e-5, BF16: 3e-2, F16: 1e-2}[dtype] if state_dtype == F32 else 1e-2
    if (dtype, state_dtype) == (F32, INT16):
        tolerance = 1e-4
    assert max(errors.values()) < tolerance, errors
    if state_dtype != F32:
        # Kernel and twin round the same float32 update: a bfloat16 ulp or two int16 steps apart at most, plus
        # float32 slack (GPU exp and fused multiply-adds differ in the last float32 bits; an update that nearly
        # cancels keeps that error).
        twin = before.clone()
        twin_o = sse_decode_torch(twin, slots, **step, top_k=K, row_topk=row_topk)
        def bf16_ulp(x):
            return 2**-7 * x
        # per value in bfloat16, per column in int16 (two steps of the column's largest value)
        rounding = bf16_ulp if state_dtype == BF16 else (lambda x: 2 * x.amax(-2, keepdim=True) / 32767)
        for ours, theirs, ulp in ((states_from_cache(cache), states_from_cache(twin), rounding),
                                  (o.float(), twin_o.float(), bf16_ulp)):
            bound = ulp(torch.maximum(ours.abs(), theirs.abs())) + 1e-5
            assert bool(((ours - theirs).abs() <= bound).all()), float(((ours - theirs).abs() - bound).max())
        assert cache.dtype == state_dtype
    assert bool((o[~live] == 0).all()), "skipped rows must give zeros"
    assert torch.equal(cache[untouched], before[untouched]), "slots outside the batch changed"


@pytest.mark.parametrize("state_dtype", [F32, INT16], ids=["f32-state", "int16-state"])
def test_decode_launches_agree_with_the_twin(device, state_dtype):
    """Every launch override (state columns per program x warps) updates the same states: d_v = 40 over blocks of
    8 / 16 / 32 columns (the last block partial), against the torch twin on the same cache. The default launches
    cover a state with one block of columns at the CPU's shapes; a GPU's d_v = 128 runs two or more."""
    from kernels import states_from_cache, states_to_cache
    from kernels.sse import sse_decode_torch
    from kernels.triton import sse_decode_triton
    H, c, dv, N, K = SHAPES[device]["H"], SHAPES[device]["c"], 40, 4, 1
    slots = torch.tensor([5, -1, 0, 3], device=device)
    step = {n: x[0] for n, x in exact_in_bf16_inputs(len(slots), H, c, dv, N, 1, device).items()
            if n != "initial_state"}
    states = torch.randn(8, H, N + 1, c, dv, device=device)
    before = partition_major_cache(states, INT16) if state_dtype == INT16 else states_to_cache(states, state_dtype)
    twin = before.clone()
    twin_o = sse_decode_torch(twin, slots, **step, top_k=K)
    theirs = states_from_cache(twin)
    for block_v, warps in ((8, 1), (16, 2), (32, 4)):
        cache = before.clone()
        o = sse_decode_triton(cache, slots, **step, top_k=K, block_v=block_v, num_warps=warps)
        ours = states_from_cache(cache)
        # float32: the same arithmetic; int16: two steps of the column's largest value (see test_decode_vs_reference)
        bound = 1e-5 if state_dtype == F32 else 2 * torch.maximum(ours.abs(), theirs.abs()).amax(-2, True) / 32767
        assert bool(((ours - theirs).abs() <= bound + 1e-5).all()), (block_v, warps)
        assert rel_err(o, twin_o) < 1e-5, (block_v, warps, rel_err(o, twin_o))


def test_int16_decode_rounds_each_value_to_the_nearest_step(device):
    """The int16 kernel stores round(S / s) for the updated float32 S and its new column scale s: within half a step
    (plus float32 slack from fused multiply-adds), where truncating would be up to a whole step off."""
    from kernels import states_from_cache
    from kernels.sse import sse_decode_torch
    from kernels.sse.decode import SCALE_ROWS
    from kernels.triton import sse_decode_triton
    H, c, dv = (SHAPES[device][n] for n in ("H", "c", "dv"))
    N, K, B = 4, 1, 6
    slots = torch.arange(B, device=device)
    inputs = exact_in_bf16_inputs(B, H, c, dv, N, 1, device)
    step = {n: x[0] for n, x in inputs.items() if n != "initial_state"}
    cache = partition_major_cache(torch.randn(B, H, N + 1, c, dv, device=device), INT16)  # as vLLM lays it out
    exact = states_from_cache(cache)                 # the float32 states the int16 cache holds
    held = exact.clone()
    sse_decode_torch(exact, slots, **step, top_k=K)  # their float32 update
    updated = (exact != held).any(-1, keepdim=True).any(-2, keepdim=True).expand_as(exact)  # routed + shared
    sse_decode_triton(cache, slots, **step, top_k=K)
    stored = cache[..., :-SCALE_ROWS, :].float()
    scale_rows = cache[..., -SCALE_ROWS:-SCALE_ROWS + 2, :]  # the scales' float32s, two int16 rows per column
    new_scale = scale_rows.contiguous().view(torch.float32).reshape(*scale_rows.shape[:-2], 1, -1)
    steps = (exact / new_scale)[updated]
    off = (stored[updated] - steps).abs()
    # float32 slack: the GPU's exp and fused multiply-adds move S in its last bits, up to 65534 steps of s
    assert bool((off <= 0.5 + 1e-2 + 1e-6 * steps.abs()).all()), float(off.max())
    assert float(off.mean()) > 0.2  # S / s is no integer already: the check above can fail


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_int16_decode_never_stores_past_the_bound(device, impl):
    """A column stored under a loose scale (here 100x its largest |S|) holds values rounded up past that largest
    |S|; a step that keeps them (decay 1, v = 0) must scale for that, or the largest values land past 32,767
    (clamped 50 steps off, or wrapped to the other sign by a kernel that does not clamp)."""
    from kernels import sse_decode, states_from_cache, states_to_cache
    from kernels.sse.decode import SCALE_ROWS
    H, c, dv = (SHAPES[device][n] for n in ("H", "c", "dv"))
    N, K, B = 4, 1, 6
    slots = torch.arange(B, device=device)
    step = {n: x[0] for n, x in exact_in_bf16_inputs(B, H, c, dv, N, 1, device).items() if n != "initial_state"}
    step["log_decay"], step["v"] = torch.zeros_like(step["log_decay"]), torch.zeros_like(step["v"])
    S = torch.randn(B, H, N + 1, c, dv, device=device)
    cache = states_to_cache(S, INT16, bound=100 * S.abs().amax(-2, keepdim=True))
    before = states_from_cache(cache)
    assert bool((before.abs().amax(-2) > S.abs().amax(-2)).any())  # some columns were rounded up past their top
    sse_decode(cache, slots, **step, top_k=K, impl=impl)
    scale_rows = cache[..., -SCALE_ROWS:-SCALE_ROWS + 2, :]
    new_scale = scale_rows.contiguous().view(torch.float32).reshape(*scale_rows.shape[:-2], 1, -1)
    off = (states_from_cache(cache) - before).abs() / new_scale
    assert bool((off <= 0.5 + 1e-2).all()), float(off.max())


@pytest.mark.parametrize("shared_lora", [False, True], ids=["shared-given", "shared-lora"])
@pytest.mark.parametrize("decay", ["log_decay", "logits"])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_decode_reads_packed_rows_and_writes_into_out(device, impl, decay, shared_lora):
    """The vLLM layout: every input a view into one packed [B, width] projection buffer (token stride = width; the
    float32 router logits viewed from its bytes), the output rows of a larger buffer, and (as vLLM passes them) raw
    decay logits with `decay_normalizer`. Same
    result as contiguous float64 inputs with log a = logsigmoid(x) / 16 given, written in place, nothing else
    touched. The decay logits run from -30 to 30 (both branches of the kernel's logsigmoid). With `shared_lora`
    the shared partition's views are low-rank terms, added to q and k for the expected result; they and q, k are
    multiples of 1/4 there, so the sums are exact in bfloat16 (Triton's interpreter rounds a float32 to bfloat16
    towards zero, the GPU to nearest)."""
    from kernels import sse_decode
    H, c, dv = (SHAPES[device][n] for n in ("H", "c", "dv"))
    N, K, B = 4, 2, 5
    slots = torch.tensor([3, -1, 0, 6, 2], device=device)
    dtype = F32 if decay == "logits" else BF16
    # q, k, v, decay, router, q_shared, k_shared; the router logits are float32, their bytes in the buffer's dtype
    sizes = [H * c, H * c, H * dv, H * c, N * 4 // dtype.itemsize, H * c, H * c]
    packed = torch.randn(B, sum(sizes), device=device, dtype=dtype)
    parts = packed.split(sizes, -1)
    names = ["q", "k_logits", "v", "log_decay", "router_logits", "q_shared", "k_shared_logits"]
    views = {n: p.view(F32) if n == "router_logits" else p.view(B, H, -1) for n, p in zip(names, parts)}
    views["router_logits"].copy_(torch.randn(B, N, device=device))
    views["log_decay"].copy_(torch.linspace(-30, 30, H * c, device=device).view(H, c)[None])
    log_decay = torch.nn.functional.logsigmoid(views["log_decay"].double()) / 16
    fused = dict(decay_normalizer=16.0) if decay == "logits" else {}
    if not fused:
        views["log_decay"] = log_decay.float()
    if shared_lora:
        for name in ("q", "k_logits", "q_shared", "k_shared_logits"):
            views[name].copy_(torch.randint(-16, 16, views[name].shape, device=device) / 4)
    assert not views["q"].is_contiguous()
    state = torch.randn(8, H, N + 1, c, dv, device=device, dtype=torch.float64)
    expect_state = state.clone()
    given = {n: x.double().contiguous() for n, x in views.items()} | dict(log_decay=log_decay)
    if shared_lora:
        given["q_shared"] = (views["q"] + views["q_shared"]).double()
        given["k_shared_logits"] = (views["k_logits"] + views["k_shared_logits"]).double()
    expect = sse_decode(expect_state, slots, **given, top_k=K, impl="torch")
    state = state.float()
    buffer = torch.full((B + 2, H, dv), 7.0, device=device, dtype=packed.dtype)
    returned = sse_decode(state, slots, **views, top_k=K, out=buffer[1:B + 1], impl=impl, shared_lora=shared_lora,
                          **fused)
    assert returned.data_ptr() == buffer[1].data_ptr()
    errors = {"o": rel_err(buffer[1:B + 1], expect), "state": rel_err(state, expect_state)}
    assert errors["state"] < 1e-5 and errors["o"] < (1e-5 if packed.dtype == F32 else 1e-2), errors
    assert bool((buffer[0] == 7).all() and (buffer[B + 1] == 7).all()), "rows outside out were written"


def test_decode_row_topk_ties_keep_exactly_r_rows(device):
    """Ties in the row-sparse top-r (common in bf16) keep exactly r rows, the lowest indices."""
    from kernels import sse_decode
    cache = torch.zeros(1, 1, 2, 8, 4, device=device)
    ones = torch.ones(1, 1, 8, dtype=BF16, device=device)
    zeros = torch.zeros(1, 1, 8, dtype=BF16, device=device)
    sse_decode(cache, torch.tensor([0], device=device), ones, zeros, torch.ones(1, 1, 4, device=device), zeros,
               torch.zeros(1, 1, device=device), top_k=1, q_shared=ones, k_shared_logits=zeros, row_topk=3,
               impl="triton")
    written = cache[0, 0].abs().sum(-1) > 0
    assert written[:, :3].all() and not written[:, 3:].any(), written


def test_decode_nan_router_logits_stay_in_their_state(device):
    """A token whose router logits are all NaN updates its own state's lowest partition (with NaN) and nothing
    else: not the idle slot after its state, where a partition index past N would land (N = 3 + shared)."""
    from kernels import sse_decode
    H, c, dv, N = 2, 8, 4, 3
    ins = random_inputs(2, 1, H, c, dv, N, True, 3, F32, device)
    cache = ins.pop("initial_state").detach().contiguous()
    step = {n: x.detach()[:, 0] for n, x in ins.items()}
    step["router_logits"][0] = float("nan")
    before = cache.clone()
    sse_decode(cache, torch.tensor([0, 2], device=device), **step, top_k=1, impl="triton")
    assert torch.equal(cache[1], before[1]), "the idle slot between the two tokens' slots was written"
    assert cache[0, :, 0].isnan().all() and torch.equal(cache[0, :, 1:N], before[0, :, 1:N])
    expect = before[2:].clone()
    sse_decode(expect, torch.tensor([0], device=device), **{n: x[1:] for n, x in step.items()}, top_k=1,
               impl="torch")
    assert rel_err(cache[2], expect[0]) < 1e-5, "the other token's state"


def test_decode_triton_rejects_keys_narrower_than_four():
    """The token kernel's maxima row holds four floats: a key width c < 4 is refused with its name, not overrun."""
    from kernels.triton import sse_decode_triton
    x = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="c >= 4"):
        sse_decode_triton(torch.zeros(1, 1, 1, 2, 4), torch.tensor([0]), x, x, torch.zeros(1, 1, 4), x,
                          torch.zeros(1, 1), top_k=1)


@pytest.mark.gpu
@pytest.mark.usefixtures("one_triton_config")
def test_decode_cuda_graph_replay():
    """One decode step captured in a CUDA graph, replayed on new inputs, against the torch step (bf16)."""
    from kernels.sse import sse_decode_torch
    from kernels.triton import sse_decode_triton
    H, c, dv = (SHAPES["cuda"][n] for n in ("H", "c", "dv"))
    N, K, B = 4, 1, 64

    def make():
        def bf16(*shape):
            return torch.randn(*shape, device="cuda", dtype=BF16)
        return dict(q=bf16(B, H, c), k_logits=bf16(B, H, c), v=bf16(B, H, dv),
                    log_decay=-torch.rand(B, H, c, device="cuda", dtype=BF16) / 16,
                    router_logits=torch.randn(B, N, device="cuda"), q_shared=bf16(B, H, c),
                    k_shared_logits=bf16(B, H, c))

    static, slots = make(), torch.randperm(2 * B, device="cuda")[:B]
    slots[::7] = -1
    cache = torch.randn(2 * B, H, N + 1, c, dv, device="cuda")
    step = functools.partial(sse_decode_triton, top_k=K)
    step(cache.clone(), slots, **static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(cache, slots, **static)
    fresh = make()
    for n in static:
        static[n].copy_(fresh[n])
    expect_cache = cache.clone()
    expect = sse_decode_torch(expect_cache, slots, **fresh, top_k=K)
    graph.replay()
    torch.cuda.synchronize()
    errors = {"o": rel_err(out, expect), "state": rel_err(cache, expect_cache)}
    print({n: f"{e:.1e}" for n, e in errors.items()})
    assert max(errors.values()) < 1e-2, errors


# ---------------------------------------------------------------------------------------------------------------
# A prefill's states in and out of vLLM's state cache (kernels/triton/state_cache.py).

def partition_major_cache(states, dtype):
    """`states_to_cache(states, dtype)` laid out as vLLM's cache is (partition-major: a strided view)."""
    from kernels import states_to_cache
    cache = states_to_cache(states, dtype)
    return torch.empty_like(cache.transpose(1, 2)).transpose(1, 2).copy_(cache)


@pytest.mark.parametrize("state_dtype", [F32, BF16, INT16], ids=["f32", "bf16", "int16"])
def test_state_cache_read_and_write_match_the_twin(device, state_dtype):
    """The one-pass kernels give the torch twin's values on a partition-major cache, slots out of order: a read
    is exact and zero for a state without a past (its slot unread), a write rounds once as `states_to_cache` does
    (within one unit of the last place: Triton's CPU interpreter truncates to bfloat16, a GPU may fuse the int16
    rounding's multiply-add) with exact int16 column scales, and touches no other slot. An empty batch is a no-op."""
    from kernels.sse import read_states_torch, write_states_torch
    from kernels.triton.state_cache import read_states_triton, write_states_triton
    H, c, dv = (SHAPES[device][n] for n in ("H", "c", "dv"))
    P, num_slots = 5, 9
    columns = torch.logspace(-3, 3, dv, device=device)  # columns of very different sizes (int16 scales per column)
    cache = partition_major_cache(torch.randn(num_slots, H, P, c, dv, device=device) * columns, state_dtype)
    slots = torch.tensor([6, 0, 3, 8], device=device)
    has_state = torch.tensor([True, False, True, True], device=device)
    for mask in (has_state, None):
        got, want = read_states_triton(cache, slots, mask), read_states_torch(cache, slots, mask)
        assert got.dtype == F32 and torch.equal(got, want)
    assert torch.count_nonzero(got[1]) > 0 and torch.count_nonzero(read_states_triton(cache, slots, has_state)[1]) == 0

    states = torch.randn(len(slots), H, P, c, dv, device=device) * columns
    states[0, 0, 0] = 0.0                   # a zero state
    states[1, 0, 1, :, 0] = 1e-35           # a column too small to scale: stored as zeros
    ours, twin = cache.clone(), cache.clone()
    write_states_triton(ours, slots, states)
    write_states_torch(twin, slots, states)
    if state_dtype == INT16:
        ulp = torch.ones((), device=device)
        floats = [x[..., c:, :].contiguous().view(F32).reshape(*x.shape[:3], 2, dv) for x in (ours, twin)]
        assert torch.equal(floats[0][..., 1, :], floats[1][..., 1, :]), "largest |S| differ"
        # torch on CUDA divides by a scalar as a multiply by its reciprocal: the twin's scale may be an ulp off
        assert torch.allclose(floats[0][..., 0, :], floats[1][..., 0, :], rtol=2**-23, atol=0), "scales differ"
    else:
        ulp = twin.float().abs() * (2**-7 if state_dtype == BF16 else 0.0)
    values = [x[..., :c, :] for x in (ours, twin)]  # the int16 scale rows are checked above
    assert bool(((values[0].float() - values[1].float()).abs() <= ulp[..., :c, :] if ulp.dim() else ulp).all())
    if device == "cuda" or state_dtype != BF16:  # otherwise a truncation is off for half of the values
        assert float((values[0] != values[1]).float().mean()) < 0.01
    untouched = [i for i in range(num_slots) if i not in slots.tolist()]
    assert torch.equal(ours[untouched], cache[untouched])

    none = slots[:0]
    write_states_triton(ours, none, states[:0])
    assert torch.equal(ours[untouched], cache[untouched]) and read_states_triton(cache, none).shape == (0, H, P, c, dv)


def test_prefill_through_an_int16_state_cache_vs_reference(device):
    """What the vLLM layer does with a step's prefills: initial states read from their slots (two of them start
    from nothing, so their slots hold another request's state), the chunked path over the varlen batch (T = 1,
    empty and longer segments), final states written back; against the float64 token loop from the states the
    cache held. The int16 rounding of the final states adds a part in 65,534 of each column's largest value."""
    from kernels import read_states, states_from_cache, write_states
    from kernels.sse import sse_reference
    N, K = 4, 1
    shape = SHAPES[device]
    H, c, dv, lengths = shape["H"], shape["c"], shape["dv"], shape["lengths"]
    cu = torch.tensor([0] + lengths, device=device).cumsum(0)
    T, S = int(cu[-1]), len(lengths)
    inputs = exact_in_bf16_inputs(T, H, c, dv, N, S, device)
    del inputs["initial_state"]
    cache = partition_major_cache(torch.randn(S + 3, H, N + 1, c, dv, device=device), INT16)
    slots = torch.randperm(S + 3, device=device)[:S]
    has_state = torch.arange(S, device=device) % 3 != 1
    held = states_from_cache(cache[slots]) * has_state.view(-1, 1, 1, 1, 1)
    ref_o, ref_final = sse_reference(**{n: x.double() for n, x in inputs.items()}, top_k=K, cu_seqlens=cu,
                                     initial_state=held.double(), output_final_state=True)
    for dtype in shape["dtypes"]:
        ours = cache.clone()
        initial = read_states(ours, slots, has_state, impl="triton")
        o, final = chunk_impl("triton_indexed", device)(**{n: x if n == "router_logits" else x.to(dtype)
                                                          for n, x in inputs.items()}, top_k=K, cu_seqlens=cu,
                                                       initial_state=initial, output_final_state=True)
        write_states(ours, slots, final, impl="triton")
        errors = {"o": rel_err(o, ref_o), "final": rel_err(states_from_cache(ours[slots]), ref_final)}
        print(str(dtype), {n: f"{e:.1e}" for n, e in errors.items()})
        assert max(errors.values()) < CHUNK_TOL[device][dtype], errors


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm, w * rmsnorm(x), and the layer's output step, w * rmsnorm(o) * silu(gate).

@pytest.mark.parametrize("gated", [True, False], ids=["norm_gate", "rms_norm"])
@pytest.mark.parametrize("rows, D, dtype, tol, programs", [
    (37, 16, F32, 1e-5, None),    # rows not a multiple of the kernel's 128 per program
    (5, 40, F32, 1e-5, None),     # D not a power of two
    (0, 16, F32, 0.0, None),      # no rows
    (50, 128, BF16, 1e-2, None),  # the models' head width, bf16
    (50, 128, F32, 1e-5, 3),      # more row blocks (7) than backward programs: each program loops
    (9, 2048, BF16, 1e-2, 4),     # a hidden state, one row per program, 18 rows over 4 backward programs
])
def test_norm_vs_float64_twin(device, gated, rows, D, dtype, tol, programs, monkeypatch):
    """Forward and backward (x, weight[, gate]) of the fused kernels against the torch twins in float64."""
    from kernels.norm_gate import norm_gate_torch, rms_norm_torch
    from kernels.triton import norm_gate as kernels_module
    from kernels.triton.norm_gate import norm_gate_triton, rms_norm_triton
    if programs:
        monkeypatch.setattr(kernels_module, "BACKWARD_PROGRAMS", programs)
    x = torch.randn(rows, 2, D, device=device) * 3
    # the gate as the SSE layer's projection GEMM leaves it: a column block, tokens 2 D + 3 values apart
    gate = (torch.randn(rows, 2 * D + 3, device=device) * 3)[:, 1:2 * D + 1].view(rows, 2, D)
    weight, dy = torch.randn(D, device=device), torch.randn(rows, 2, D, device=device)
    inputs = (x, weight, gate) if gated else (x, weight)
    fns = (norm_gate_triton, norm_gate_torch) if gated else (rms_norm_triton, rms_norm_torch)
    results = {}
    for name, fn, cast in (("triton", fns[0], dtype), ("twin", fns[1], torch.float64)):
        leaves = [t.to(cast).requires_grad_() for t in inputs]
        y = fn(*leaves, 1e-6)
        assert y.dtype == cast
        results[name] = [y, *torch.autograd.grad(y, leaves, dy.to(cast))]
    errors = {n: rel_err(a, b) for n, a, b in zip(["y", "d_x", "d_weight", "d_gate"], *results.values())}
    print({n: f"{e:.1e}" for n, e in errors.items()})
    assert rows == 0 or max(errors.values()) < tol, errors


def test_sse_layer_recomputes_the_inputs_the_operator_saves(device, monkeypatch):
    """The Triton path's operator saves the decay logits and the shared partition's q and key logits as they come,
    so the HF layer keeps all three as recipes (`kernels.recomputed_when_saved`), as it keeps W_o's input: their
    memory is free once the forward returns, they are made again in the backward, and the gradients are those of a
    layer that kept the tensors."""
    import kernels
    from sse_model import SSEConfig, SSEForCausalLM
    config = SSEConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                       layer_types=["linear_attention"], num_attention_heads=2, head_dim=32, sse_num_heads=2,
                       sse_key_dim=32, sse_value_dim=32, sse_num_partitions=4, sse_top_k=1, sse_lora_rank=4,
                       sse_impl="triton_indexed")
    layer = SSEForCausalLM(config).model.layers[0].linear_attn.to(device)
    monkeypatch.setattr("kernels.modules.recompute.RECIPES_ABOVE_BYTES", -1)  # tiny tensors: every recipe applies
    calls, storages = [], []
    up_weights = [getattr(layer, name).weight for name in ("decay_up", "q_shared_up", "k_shared_up")]
    linear, addmm, project, norm_gate = F.linear, torch.addmm, layer.project, kernels.norm_gate

    def count(weight):  # the low-rank terms' up projections
        calls.extend(name for name, w in zip(("decay", "q", "k"), up_weights) if w is weight)

    def counted_linear(x, weight, *args):  # the decay logits'
        count(weight)
        return linear(x, weight, *args)

    def counted_addmm(routed, code, weight_t):  # the shared partition's q and key logits' (`_shared_term`)
        count(weight_t._base)
        return addmm(routed, code, weight_t)
    monkeypatch.setattr(F, "linear", counted_linear)
    monkeypatch.setattr(torch, "addmm", counted_addmm)

    def remembered(*tensors):  # weak references to their memory, not to the tensor objects
        storages.extend(t.untyped_storage()._weak_ref() for t in tensors)
        return tensors[0]
    def project_remembered(*args):
        inputs, gate = project(*args)
        remembered(inputs["log_decay"], inputs["q_shared"], inputs["k_shared_logits"])
        return inputs, gate
    monkeypatch.setattr(layer, "project", project_remembered)
    monkeypatch.setattr(kernels, "norm_gate", lambda *a, **kw: remembered(norm_gate(*a, **kw)))
    x, dy = torch.randn(1, 40, 64, device=device), torch.randn(1, 40, 64, device=device)

    def grads(recompute):
        calls.clear()
        storages.clear()
        leaf = x.clone().requires_grad_()
        identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with contextlib.nullcontext() if recompute else identity:
            y, _ = layer(leaf)
        # Triton's interpreter keeps its arguments' storages in a reference cycle (GridExecutor._init_args_hst)
        # until Python's collector runs, whenever that is; what the backward keeps is no garbage, so it stays
        gc.collect()
        made, freed = len(calls), [torch.UntypedStorage._expired(s) for s in storages]
        return torch.autograd.grad(y, [leaf, *layer.parameters()], dy, allow_unused=True), (made, len(calls) - made,
                                                                                            freed)

    recomputed, counts = grads(recompute=True)
    assert counts == (3, 3, [True] * 4)
    kept, counts = grads(recompute=False)
    assert counts == (3, 0, [False] * 4)
    errors = [rel_err(a, b) for a, b in zip(recomputed, kept) if a is not None]
    assert len(errors) == len(kept) and max(errors) < 1e-6, errors


# ---------------------------------------------------------------------------------------------------------------
# The model on the indexed path: "auto" takes it on GPU.

@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.triton_interpret),
                                    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.exact_f32_dots])])
def test_model_step_takes_the_indexed_path_and_matches_torch(device, monkeypatch, padded):
    """A small SSE-H training step (loss + backward, float32 model) on the indexed Triton path -- what "auto" takes on
    GPU; on CPU, interpreted, asked for by name -- gives the torch path's loss and parameter gradients, also with a
    left-padded row, whose pad tokens' v the projections zero inside their GEMM's output (read in place by the
    kernels), and with gradient checkpointing the same step. Rows cross chunks (64 rows on GPU, 8 here on CPU).

    On the GPU the float32 dots are exact (`exact_f32_dots`), so the bound is the CPU's: with tf32 the first SSE
    layer's output is 1.5e-3 from the torch path's, which moves the second layer's router logits enough to flip a
    near-tied token's top-1 partition, and a flip is a discontinuity, not an error (with 37 pads on an H200 the
    second router's gradient came out 7.7 % apart; 2e-6 with exact dots). The operator's tf32 error is bounded by the
    other tests here."""
    from kernels import dispatch
    from tiny_checkpoints import small_sse_h
    width, T = (256, 200) if device == "cuda" else (64, 40)
    model = small_sse_h(width, device, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, T), device=device)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :T // 5] = 0
    used = []

    def counted(name, impl):
        def call(*args, **kwargs):
            used.append(name)
            return impl(*args, **kwargs)
        return call

    for name, impl in dict(dispatch.IMPLEMENTATIONS).items():
        if name == "triton_indexed" and device == "cpu":
            impl = chunk_impl(name, device)  # chunks of 8 rows
        monkeypatch.setitem(dispatch.IMPLEMENTATIONS, name, counted(name, impl))

    def train_step(sse_impl):
        model.config.sse_impl = sse_impl
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    indexed = "auto" if device == "cuda" else "triton_indexed"
    loss, grads = train_step(indexed)
    taken = sorted(set(used))
    loss_ref, grads_ref = train_step("chunk_torch_varlen")
    print(f"dispatched to {taken}, loss {loss.item():.6f} (indexed) vs {loss_ref.item():.6f} (torch)")
    assert taken == ["triton_indexed"], taken
    errors = {"loss": rel_err(loss, loss_ref), "grads": max(rel_err(a, b) for a, b in zip(grads, grads_ref))}
    assert max(errors.values()) < CHUNK_TOL["cpu"][F32], errors  # exact dots on both devices
    # With gradient checkpointing the operator's saves (`kernels.saved_views`: views saved as their bases) are
    # packed by checkpoint's hooks and made again in the backward, and the recomputation takes the first forward's
    # routing tables and output (`kernels.CheckpointReplay`): the same step, routed once per SSE layer.
    from kernels.triton import indexed_chunk
    routed = []
    real_tables = indexed_chunk.index_tables
    monkeypatch.setattr(indexed_chunk, "index_tables", lambda *a: routed.append(1) or real_tables(*a))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss_ck, grads_ck = train_step(indexed)
    assert len(routed) == model.config.layer_types.count("linear_attention"), len(routed)
    assert rel_err(loss_ck, loss) < 1e-6 and max(rel_err(a, b) for a, b in zip(grads_ck, grads)) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# The SSE authors' layer (flash-linear-attention PR #882 at 741fbbf, fla/layers/sse.py): the shared partition's own
# decay gate, an operator input of every path (here the Triton ones, forward and backward, and decode).

@pytest.mark.parametrize("impl, row_topk, decay_logits", [
    ("triton_indexed", None, False), ("triton_indexed", 5, False), ("triton_indexed", None, True),
    ("triton_indexed", 5, True), ("triton_varlen", 5, False), ("triton_mask", None, False),
], ids=["indexed", "indexed-row-sparse", "indexed-logits", "indexed-row-sparse-logits", "varlen-row-sparse",
        "mask"])
def test_chunk_shared_decay(device, impl, row_topk, decay_logits):
    """`log_decay_shared` (log-decays, or decay logits with `decay_normalizer` on the indexed path) against the
    float64 reference on a varlen batch from initial states: output, final states and every gradient, its own
    included."""
    from kernels.sse import log_decay_from_logits, sse_reference
    H, c, dv = (SHAPES[device][n] for n in ("H", "c", "dv"))
    cu = torch.tensor([0, 1, 1, 8, 13], device=device)
    T, N, K = 13, 4, 2
    ins = random_inputs(1, T, H, c, dv, N, True, 4, F32, device)
    shared = torch.randn(1, T, H, c, device=device) * 2 + 1
    ins["log_decay_shared"] = (shared if decay_logits else F.logsigmoid(shared) / 16).requires_grad_()
    if decay_logits:
        ins["log_decay"] = (torch.randn(1, T, H, c, device=device) * 2).requires_grad_()
    kw = dict(top_k=K, row_topk=row_topk, cu_seqlens=cu)
    cot = cotangents_for(T, H, N, c, dv, 4, device)
    fn = chunk_impl(impl, device)
    got = forward_backward(functools.partial(fn, decay_normalizer=16.0) if decay_logits else fn, ins, cot, **kw)
    leaves = {n: x.detach().double().requires_grad_() for n, x in ins.items()}

    def reference(log_decay, log_decay_shared, **rest):
        if decay_logits:
            log_decay, log_decay_shared = (log_decay_from_logits(x, 16.0) for x in (log_decay, log_decay_shared))
        return sse_reference(log_decay=log_decay, log_decay_shared=log_decay_shared, **rest)
    ref = forward_backward(reference, leaves, cot, **kw)
    errors = {n: rel_err(got[n], ref[n]) for n in ref}
    print({n: f"{e:.1e}" for n, e in errors.items()})
    assert max(errors.values()) < CHUNK_TOL[device][F32], errors
    # the shared decay is used: the routed decay alone misses the reference by far more than the kernel does (by
    # some 30x its error with the row-sparse choice, where fewer writes reach the shared partition)
    alone = fn(**{n: x.detach() for n, x in ins.items() if n != "log_decay_shared"}, **kw,
               **(dict(decay_normalizer=16.0) if decay_logits else {}))[0]
    assert rel_err(alone, ref["o"]) > 10 * max(errors.values()), (rel_err(alone, ref["o"]), errors)


@pytest.mark.parametrize("state_dtype", [F32, INT16], ids=["f32-state", "int16-state"])
@pytest.mark.parametrize("decay_logits", [False, True], ids=["log-decay", "logits"])
def test_decode_shared_decay(device, state_dtype, decay_logits):
    """The Triton decode step with the shared partition's own decay against the float64 reference and the torch
    twin (same cache, same rounding)."""
    from kernels import states_from_cache, states_to_cache
    from kernels.sse import log_decay_from_logits, sse_decode_torch, sse_reference
    from kernels.triton import sse_decode_triton
    H, c, dv = (SHAPES[device][n] for n in ("H", "c", "dv"))
    N, K = 4, 1
    slots = torch.tensor([3, -1, 0, 5], device=device)
    step = {n: x.detach()[:, 0] for n, x in random_inputs(4, 1, H, c, dv, N, True, 1, F32, device).items()
            if n != "initial_state"}
    shared = torch.randn(4, H, c, device=device) * 2 + 1
    step["log_decay_shared"] = shared if decay_logits else F.logsigmoid(shared) / 16
    if decay_logits:
        step["log_decay"] = torch.randn(4, H, c, device=device) * 2
    normalizer = 16.0 if decay_logits else None
    cache = states_to_cache(torch.randn(6, H, N + 1, c, dv, device=device), state_dtype)
    twin = cache.clone()
    state = states_from_cache(cache).clone()  # (a float32 cache's states are the cache itself)
    o = sse_decode_triton(cache, slots, **step, top_k=K, decay_normalizer=normalizer)
    twin_o = sse_decode_torch(twin, slots, **step, top_k=K, decay_normalizer=normalizer)
    live = slots >= 0
    ref_in = {n: x[live][:, None].double() for n, x in step.items()}
    if decay_logits:
        for n in ("log_decay", "log_decay_shared"):
            ref_in[n] = log_decay_from_logits(ref_in[n], 16.0)
    ref_o, ref_state = sse_reference(**ref_in, top_k=K, initial_state=state[slots[live]].double(),
                                     output_final_state=True)
    tolerance = 1e-5 if state_dtype == F32 else 1e-4
    errors = {"o": rel_err(o[live], ref_o[:, 0]), "state": rel_err(states_from_cache(cache[slots[live]]), ref_state),
              "twin_o": rel_err(o, twin_o)}
    print({n: f"{e:.1e}" for n, e in errors.items()})
    assert max(errors.values()) < tolerance, errors
