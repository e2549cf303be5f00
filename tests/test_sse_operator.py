"""The chunked torch paths and the decode step against the float64 token-loop reference (issue 2)."""
import pytest
import torch

from conftest import rel_err, sse_inputs
from kernels import CheckpointReplay, sse_attention, sse_decode
from kernels.checkpoint_replay import KEPT_BYTES
from kernels.dispatch import pick_implementation
from kernels.gla import recurrent_gla_reference
from kernels.sse import softmax_keys, states_from_cache, states_to_cache

CHUNKED = ["chunk_torch_varlen", "chunk_torch_mask"]
H, C, DV = 2, 8, 4

# (name, batch, T, N, top_k, shared, row_topk, cu_seqlens, never_route)
CASES = [
    ("dense_n4k1_shared", 2, 37, 4, 1, True, None, None, ()),
    ("varlen_len1_and_empty_segment", 1, 30, 4, 1, True, None, [0, 1, 1, 17, 18, 30], ()),
    ("row_sparse_n8k2", 2, 21, 8, 2, True, 3, None, ()),
    ("k_equals_n", 2, 19, 3, 3, True, None, None, ()),
    ("empty_partitions", 1, 26, 6, 2, False, None, [0, 9, 26], (0, 4)),
    ("length_one", 3, 1, 4, 2, True, None, None, ()),
    ("no_shared_chunk_boundary", 2, 32, 4, 1, False, 5, None, ()),
]


def run(impl, x, case, *, initial_state=None, output_final_state=True):
    _, _, _, N, K, _, row_topk, cu, _ = case
    return sse_attention(**x, top_k=K, row_topk=row_topk, initial_state=initial_state,
                         output_final_state=output_final_state,
                         cu_seqlens=None if cu is None else torch.tensor(cu), impl=impl)


def initial_state_for(case, dtype, seed):
    _, B, _, N, _, shared, _, cu, _ = case
    segments = B if cu is None else len(cu) - 1
    return torch.randn(segments, H, N + shared, C, DV, dtype=dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl", CHUNKED)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_reference(impl, case, dtype, tol, with_state):
    name, B, T, N, _, shared, _, _, never = case
    seed = hash((impl, name, str(dtype), with_state)) % 2**31
    x = sse_inputs(B, T, H, C, DV, N, shared=shared, seed=seed, never_route=never)
    h0 = initial_state_for(case, torch.float64, seed + 1) if with_state else None
    o_ref, s_ref = run("reference", x, case, initial_state=h0)
    o, s = run(impl, {k: v.to(dtype) for k, v in x.items()}, case,
               initial_state=None if h0 is None else h0.to(dtype))
    assert o.dtype == dtype and o.shape == o_ref.shape and s.shape == s_ref.shape
    assert rel_err(o, o_ref) < tol
    assert rel_err(s, s_ref) < tol


@pytest.mark.parametrize("top_k,N,want", [(1, 4, "chunk_torch_varlen"), (2, 4, "chunk_torch_varlen"),
                                           (4, 4, "chunk_torch_mask"), (1, 1, "chunk_torch_mask")])
def test_cpu_dispatch(top_k, N, want):
    """On CPU dense updates (K = N) take the mask layout, sparse ones the varlen layout (kernels/dispatch.py)."""
    assert pick_implementation(torch.device("cpu"), top_k, N) == want
    assert pick_implementation(torch.device("cpu")) == "chunk_torch_varlen"


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]], ids=["k1", "varlen_k1", "k_equals_n"])
def test_auto_on_cpu_matches_reference(case):
    """What `impl="auto"` picks on CPU, on either side of the K = N rule, equals the reference (float32)."""
    name, B, T, N, _, shared, _, _, never = case
    x = sse_inputs(B, T, H, C, DV, N, shared=shared, seed=hash((name, "auto")) % 2**31, never_route=never)
    h0 = initial_state_for(case, torch.float64, 7)
    o_ref, s_ref = run("reference", x, case, initial_state=h0)
    o, s = run("auto", {k: v.float() for k, v in x.items()}, case, initial_state=h0.float())
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


def test_empty_partition_state_is_untouched():
    case = CASES[4]
    x = sse_inputs(1, 26, H, C, DV, 6, shared=False, seed=3, never_route=(0, 4))
    h0 = initial_state_for(case, torch.float64, 4)
    for impl in ["reference", *CHUNKED]:
        _, s = run(impl, x, case, initial_state=h0)
        assert torch.equal(s[:, :, [0, 4]], h0[:, :, [0, 4]]), impl


def test_gla_special_case():
    """N = 1, K = 1 without shared partition is plain GLA on (q, softmax(k), v, log a) (router weight is 1)."""
    x = sse_inputs(2, 29, H, C, DV, 1, shared=False, seed=11)
    keys, decay = softmax_keys(x["k_logits"], x["log_decay"], None)
    o_gla, s_gla = recurrent_gla_reference(x["q"], keys, x["v"], decay, output_final_state=True)
    for impl in ["reference", *CHUNKED]:
        o, s = sse_attention(**x, top_k=1, output_final_state=True, impl=impl)
        assert rel_err(o, o_gla) < 1e-12, impl
        assert rel_err(s[:, :, 0], s_gla) < 1e-12, impl


@pytest.mark.parametrize("impl", CHUNKED)
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4]], ids=["varlen", "row_sparse", "empty_partitions"])
def test_chunked_gradients_match_reference(impl, case):
    name, B, T, N, _, shared, _, _, never = case
    seed = hash((impl, name, "grad")) % 2**31
    x = sse_inputs(B, T, H, C, DV, N, shared=shared, seed=seed, never_route=never, requires_grad=True)
    h0 = initial_state_for(case, torch.float64, seed + 1).requires_grad_()
    weights = {k: torch.randn_like(v) for k, v in
               zip(["o", "s"], run("reference", x, case, initial_state=h0))}
    grads = {}
    for which in ["reference", impl]:
        o, s = run(which, x, case, initial_state=h0)
        loss = (o * weights["o"]).sum() + (s * weights["s"]).sum()
        inputs = [*x.values(), h0]
        grads[which] = torch.autograd.grad(loss, inputs)
    for name_, g_ref, g in zip([*x.keys(), "initial_state"], grads["reference"], grads[impl]):
        assert rel_err(g, g_ref) < 1e-10, name_


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("act_dtype,state_dtype,tol", [
    (torch.float64, torch.float64, 1e-12), (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.float32, 2e-2), (torch.bfloat16, torch.bfloat16, 2e-2), (torch.float32, torch.int16, 1e-4),
    (torch.bfloat16, torch.int16, 2e-2)])
def test_decode_steps_match_reference(shared, act_dtype, state_dtype, tol):
    """Several decode steps over a state cache with permuted slots and skipped rows (-1) equal running the
    reference on the same tokens from the same initial states (a bfloat16 or int16 cache: vLLM's
    mamba_ssm_cache_dtype, or its default for a 16-bit model; its states rounded once per step)."""
    N, K, steps, num_slots = 6, 2, 5, 9
    slots = torch.tensor([7, -1, 2, 0])
    live = slots >= 0
    x = sse_inputs(4, steps, H, C, DV, N, shared=shared, seed=5)
    x = {k: v.to(act_dtype).double() for k, v in x.items()}   # inputs representable in the activation dtype
    state = states_to_cache(torch.randn(num_slots, H, N + shared, C, DV, dtype=torch.float64,
                                        generator=torch.Generator().manual_seed(6)), state_dtype)
    h0 = states_from_cache(state[slots[live]]).double()
    ref_o, ref_s = sse_attention(**{k: v[live] for k, v in x.items()}, top_k=K, initial_state=h0,
                                 output_final_state=True, impl="reference")
    before = state.clone()
    outs = []
    for t in range(steps):
        step = {k: v[:, t].to(act_dtype) for k, v in x.items()}
        outs.append(sse_decode(state, slots, **step, top_k=K))
    o = torch.stack(outs, 1)
    assert o.dtype == act_dtype and state.dtype == state_dtype
    assert torch.count_nonzero(o[~live]) == 0
    assert rel_err(o[live], ref_o) < tol
    assert rel_err(states_from_cache(state[slots[live]]), ref_s) < max(tol, 1e-6 if act_dtype != torch.float64 else tol)
    untouched = [i for i in range(num_slots) if i not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])


def test_int16_states_round_trip():
    """int16 states written whole: each value within half a step (a part in 2 * 32,767 of its column's largest
    |value|) of the float32 one, the column's largest |value| kept beside its scale (a decode step bounds its next
    scale with it); a zero column and one too small to scale are stored as zeros (scales included), so zeroing a
    slot's bytes is a zero state."""
    S = torch.randn(3, 2, 5, C, DV, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, DV)
    S[0, 0, 0] = 0.0
    S[0, 0, 1, :, 0] = 1e-35
    cached = states_to_cache(S, torch.int16)
    assert cached.dtype == torch.int16 and cached.shape == (3, 2, 5, C + 4, DV)
    back = states_from_cache(cached)
    top = S.abs().amax(-2, keepdim=True)
    bound = torch.where(top > 1e-30, 0.51 * top / 32767, top)  # float32 rounding: 32,767 x 2^-24 of a step
    assert bool(((back - S).abs() <= bound).all())
    largest = cached[..., C + 2:, :].contiguous().view(torch.float32).reshape(top.shape)  # the last two rows
    assert torch.equal(largest, top)
    assert torch.count_nonzero(cached[0, 0, 0]) == 0 and torch.count_nonzero(back[0, 0, 1, :, 0]) == 0
    assert torch.count_nonzero(states_from_cache(torch.zeros_like(cached))) == 0


def test_int16_states_keep_long_memory_updates():
    """A decay close to 1 (~0.999 a step) over 1,024 decode steps: bfloat16 states lose every update below half
    their last bit and drift by several percent, int16 ones (fixed point per column) stay within 1e-3 of float64
    (dev/LOG.md has the longer runs)."""
    g = torch.Generator().manual_seed(0)
    steps, N = 1024, 4
    inputs = [dict(q=torch.randn(1, 1, C, generator=g), k_logits=2 * torch.randn(1, 1, C, generator=g),
                   v=torch.randn(1, 1, DV, generator=g), router_logits=torch.randn(1, N, generator=g),
                   log_decay=torch.randn(1, 1, C, generator=g) + 4, q_shared=torch.randn(1, 1, C, generator=g),
                   k_shared_logits=2 * torch.randn(1, 1, C, generator=g)) for _ in range(steps)]

    def outputs(dtype):
        state = states_to_cache(torch.zeros(1, 1, N + 1, C, DV), dtype)
        return torch.stack([sse_decode(state, torch.tensor([0]), **{k: v.to(torch.promote_types(dtype, v.dtype))
                                                                   if dtype == torch.float64 else v
                                                                   for k, v in x.items()},
                                       top_k=1, decay_normalizer=16.0, impl="torch") for x in inputs])
    ref = outputs(torch.float64)
    errors = {dtype: rel_err(outputs(dtype)[steps // 2:], ref[steps // 2:])
              for dtype in (torch.int16, torch.bfloat16, torch.float32)}
    print({str(k): f"{e:.1e}" for k, e in errors.items()})
    assert errors[torch.float32] < 1e-5
    assert errors[torch.int16] < 1e-3 < 1e-2 < errors[torch.bfloat16]


def test_decode_touches_only_selected_partitions():
    N, K = 5, 1
    x = sse_inputs(3, 1, H, C, DV, N, shared=True, seed=9)
    state = torch.randn(3, H, N + 1, C, DV, dtype=torch.float64)
    before = state.clone()
    sse_decode(state, torch.arange(3), **{k: v[:, 0] for k, v in x.items()}, top_k=K)
    chosen = x["router_logits"][:, 0].argmax(-1)
    for b in range(3):
        changed = [p for p in range(N + 1) if not torch.equal(state[b, :, p], before[b, :, p])]
        assert changed == [int(chosen[b]), N]


@pytest.mark.parametrize("bad,message", [
    (dict(top_k=5), "top_k must be in"),
    (dict(row_topk=99), "row_topk must be in"),
    (dict(drop="k_shared_logits"), "go together"),
    (dict(cu_seqlens=torch.tensor([0, 3, 5])), "cu_seqlens"),
    (dict(initial_state=torch.zeros(2, H, 3, C, DV)), "initial_state must be"),
    (dict(impl="nope"), "unknown SSE implementation"),
])
def test_bad_arguments_are_named(bad, message):
    x = sse_inputs(2, 7, H, C, DV, 4, seed=1)
    kwargs = dict(top_k=1)
    if "drop" in bad:
        x.pop(bad.pop("drop"))
    kwargs.update(bad)
    with pytest.raises(ValueError, match=message):
        sse_attention(**x, **kwargs)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("decays", ["weak", "strong", "mixed", "one head"])
@pytest.mark.parametrize("layout", ["batch", "varlen"])
def test_gla_core_both_score_forms(dtype, tol, decays, layout):
    """The chunked GLA core takes the block-relative scores for the (chunk, head) pairs whose in-chunk decay would
    overflow exp(-b), the factorised ones elsewhere ("strong": every token, "mixed": a few sharp decays among weak
    ones, so blocks see both, "one head": sharp decays in head 0 only); output, final state and gradients (initial
    state included) must match the recurrence, with no NaN from the strong decay. Both chunk layouts: a batch of
    equal rows (a reshape) and packed segments (rows placed by index; a length-1 and an empty segment among them)."""
    from kernels.gla import chunk_gla_torch
    g_ = torch.Generator().manual_seed(21)
    B, T, cu = (2, 45, None) if layout == "batch" else (1, 90, torch.tensor([0, 1, 1, 40, 90]))
    segments = B if cu is None else len(cu) - 1
    q = torch.randn(B, T, 2, 8, generator=g_, dtype=torch.float64)
    k = torch.randn(B, T, 2, 8, generator=g_, dtype=torch.float64)
    v = torch.randn(B, T, 2, 4, generator=g_, dtype=torch.float64)
    g = -0.05 * torch.rand(B, T, 2, 8, generator=g_, dtype=torch.float64)
    h0 = torch.randn(segments, 2, 8, 4, generator=g_, dtype=torch.float64)
    if decays == "strong":
        g = g * 800
    elif decays == "mixed":
        g = torch.where(torch.rand(B, T, 1, 1, generator=g_) < 0.15, g * 2000, g)
    elif decays == "one head":
        g[:, :, 0] *= torch.where(torch.rand(B, T, 1, generator=g_) < 0.15, 2000.0, 1.0)
    inputs = [x.requires_grad_() for x in (q, k, v, g, h0)]
    o_ref, s_ref = recurrent_gla_reference(*inputs[:4], initial_state=inputs[4], output_final_state=True,
                                           cu_seqlens=cu)
    w_o, w_s = torch.randn_like(o_ref), torch.randn_like(s_ref)
    ref_grads = torch.autograd.grad((o_ref * w_o).sum() + (s_ref * w_s).sum(), inputs)
    cast = [x.detach().to(dtype).requires_grad_() for x in inputs]
    o, s = chunk_gla_torch(*cast[:4], initial_state=cast[4], output_final_state=True, cu_seqlens=cu)
    grads = torch.autograd.grad((o * w_o.to(dtype)).sum() + (s * w_s.to(dtype)).sum(), cast)
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol
    for name, got, want in zip(["q", "k", "v", "g", "initial_state"], grads, ref_grads):
        assert rel_err(got, want) < tol, name


def test_checkpoint_replay_gives_slots_only_inside_its_passes():
    """A `CheckpointReplay` gives the operator a slot only inside one of its contexts and up to KEPT_BYTES: in the
    first forward an empty one whose `keep` stores, in the recomputation what the forward kept in call order (from
    the first call again in a second recomputation, as a retained graph's second backward runs); a recomputation
    with more operator calls than its forward is refused (the operator's replay: tests/test_triton_kernels.py)."""
    replay = CheckpointReplay()
    forward, recomputation = replay.contexts()
    assert replay.slot(8) is None  # not inside checkpoint
    with forward:
        assert replay.slot(KEPT_BYTES + 1) is None  # too large: computed on both passes
        for i in range(2):
            slot = replay.slot(KEPT_BYTES)
            assert slot.kept is None
            slot.keep(i)
    assert replay.slot(8) is None
    for _ in range(2):
        with recomputation:
            assert replay.slot(KEPT_BYTES + 1) is None
            assert [replay.slot(8).kept for _ in range(2)] == [(0,), (1,)]
    with recomputation, pytest.raises(RuntimeError, match="more SSE operator calls than its forward"):
        for _ in range(3):
            replay.slot(8)


# The SSE authors' layer (flash-linear-attention PR #882 at 741fbbf, fla/layers/sse.py and fla/ops/sse/mask.py):
# the shared partition's own decay and reading other partitions than are written.
# (name, batch, T, N, top_k (writes), read_top_k, shared_decay, row_topk, cu_seqlens)
AUTHORS_CASES = [
    ("shared_decay_n4k1", 2, 37, 4, 1, None, True, None, None),
    ("shared_decay_varlen_row_sparse", 1, 30, 4, 2, None, True, 3, [0, 1, 1, 17, 18, 30]),
    ("reads_more_than_writes", 2, 21, 6, 1, 3, True, None, None),
    ("writes_more_than_reads_varlen", 1, 26, 5, 3, 2, False, None, [0, 9, 26]),
    ("reads_all_no_shared_decay", 2, 19, 4, 2, 4, False, 5, None),
]


def authors_inputs(case, seed, **kwargs):
    _, B, T, N, _, _, shared_decay, _, _ = case
    return sse_inputs(B, T, H, C, DV, N, shared=True, shared_decay=shared_decay, seed=seed, **kwargs)


def run_authors(impl, x, case, *, initial_state=None):
    _, _, _, _, K, R, _, row_topk, cu = case
    return sse_attention(**x, top_k=K, read_top_k=R, row_topk=row_topk, initial_state=initial_state,
                         output_final_state=True, cu_seqlens=None if cu is None else torch.tensor(cu), impl=impl)


def authors_mask_formulation(x, top_k, read_top_k):
    """The authors' mask path written out (fla/layers/sse.py `sse_linear_attention_mask` with fla/ops/sse/mask.py
    `softmax_and_mask`, PR #882 at 741fbbf): partition n gets (q e_n [n read], softmax(k) e_n [n written],
    v [n written], log a [n written]) with e = softmax over all N partitions, the shared one (q_shared,
    softmax(k_shared), v, its own log a), each a plain GLA, and the outputs summed. Independent of
    kernels/sse/naive.py, whose extension to these options it checks."""
    e = torch.softmax(x["router_logits"], -1)
    order = x["router_logits"].argsort(-1, descending=True)
    ranks = order.argsort(-1)
    writer, reader = ranks < top_k, ranks < read_top_k
    keys = torch.softmax(x["k_logits"], -1)
    o = recurrent_gla_reference(x["q_shared"], torch.softmax(x["k_shared_logits"], -1), x["v"],
                                x.get("log_decay_shared", x["log_decay"]))[0]
    for n in range(e.shape[-1]):
        w, r = writer[..., n, None, None], reader[..., n, None, None]
        e_n = e[..., n, None, None]
        o = o + recurrent_gla_reference(x["q"] * e_n * r, keys * e_n * w, x["v"] * w, x["log_decay"] * w)[0]
    return o


@pytest.mark.parametrize("top_k,read_top_k,shared_decay", [(1, 1, True), (1, 3, True), (3, 2, False), (2, 4, True)])
def test_reference_is_the_authors_mask_formulation(top_k, read_top_k, shared_decay):
    x = sse_inputs(2, 23, H, C, DV, 4, shared=True, shared_decay=shared_decay, seed=31 + top_k + 5 * read_top_k)
    o, _ = sse_attention(**x, top_k=top_k, read_top_k=read_top_k, impl="reference")
    assert rel_err(o, authors_mask_formulation(x, top_k, read_top_k)) < 1e-12


def test_shared_decay_and_reads_change_the_function():
    """Each option changes the output (else the tests above could not tell a path that ignores it)."""
    x = sse_inputs(2, 23, H, C, DV, 4, shared=True, shared_decay=True, seed=3)
    base = {k: v for k, v in x.items() if k != "log_decay_shared"}
    o_base, _ = sse_attention(**base, top_k=1, impl="reference")
    o_decay, _ = sse_attention(**x, top_k=1, impl="reference")
    o_reads, _ = sse_attention(**base, top_k=1, read_top_k=2, impl="reference")
    o_same, _ = sse_attention(**base, log_decay_shared=base["log_decay"], top_k=1, read_top_k=1, impl="reference")
    assert rel_err(o_decay, o_base) > 1e-3 and rel_err(o_reads, o_base) > 1e-3
    assert torch.equal(o_same, o_base)


@pytest.mark.parametrize("impl", CHUNKED)
@pytest.mark.parametrize("case", AUTHORS_CASES, ids=[c[0] for c in AUTHORS_CASES])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_chunked_authors_options_match_reference(impl, case, dtype, tol):
    seed = hash((impl, case[0], str(dtype))) % 2**31
    x = authors_inputs(case, seed)
    _, B, _, N, _, _, _, _, cu = case
    h0 = torch.randn(B if cu is None else len(cu) - 1, H, N + 1, C, DV, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(seed + 1))
    o_ref, s_ref = run_authors("reference", x, case, initial_state=h0)
    o, s = run_authors(impl, {k: v.to(dtype) for k, v in x.items()}, case, initial_state=h0.to(dtype))
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol


@pytest.mark.parametrize("impl", CHUNKED)
@pytest.mark.parametrize("case", AUTHORS_CASES[1:4], ids=[c[0] for c in AUTHORS_CASES[1:4]])
def test_chunked_authors_options_gradients_match_reference(impl, case):
    seed = hash((impl, case[0], "grad")) % 2**31
    x = authors_inputs(case, seed, requires_grad=True)
    _, B, _, N, _, _, _, _, cu = case
    h0 = torch.randn(B if cu is None else len(cu) - 1, H, N + 1, C, DV, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(seed + 1)).requires_grad_()
    weights = [torch.randn_like(t) for t in run_authors("reference", x, case, initial_state=h0)]
    grads = {}
    for which in ["reference", impl]:
        o, s = run_authors(which, x, case, initial_state=h0)
        grads[which] = torch.autograd.grad((o * weights[0]).sum() + (s * weights[1]).sum(), [*x.values(), h0])
    for name, g_ref, g in zip([*x.keys(), "initial_state"], grads["reference"], grads[impl]):
        assert rel_err(g, g_ref) < 1e-10, name


@pytest.mark.parametrize("top_k,read_top_k", [(1, 1), (1, 3), (3, 2)])
@pytest.mark.parametrize("state_dtype,tol", [(torch.float64, 1e-12), (torch.int16, 1e-4)])
@pytest.mark.parametrize("decay_logits", [False, True])
def test_decode_authors_options_match_reference(top_k, read_top_k, state_dtype, tol, decay_logits):
    """Decode steps with the shared partition's own decay and read_top_k against the reference; a partition only
    read keeps its stored state bit for bit (an int16 one is not rounded again)."""
    N, steps, num_slots = 5, 4, 6
    slots = torch.tensor([4, -1, 1])
    live = slots >= 0
    x = sse_inputs(3, steps, H, C, DV, N, shared=True, shared_decay=True, seed=17 + read_top_k)
    state = states_to_cache(torch.randn(num_slots, H, N + 1, C, DV, dtype=torch.float64,
                                        generator=torch.Generator().manual_seed(6)), state_dtype)
    h0 = states_from_cache(state[slots[live]]).double()
    normalizer = 4.0 if decay_logits else None
    if decay_logits:  # the same log-decays, given as logits x with logsigmoid(x) / 4
        for name in ("log_decay", "log_decay_shared"):
            x[name] = torch.log(torch.expm1(-4 * x[name]).reciprocal())
    ref = {k: v[live] for k, v in x.items()}
    if decay_logits:
        ref["log_decay"], ref["log_decay_shared"] = (torch.nn.functional.logsigmoid(ref[n]) / 4
                                                     for n in ("log_decay", "log_decay_shared"))
    ref_o, ref_s = sse_attention(**ref, top_k=top_k, read_top_k=read_top_k, initial_state=h0,
                                 output_final_state=True, impl="reference")
    outs = []
    for t in range(steps):
        before = state.clone()
        step = {k: v[:, t] for k, v in x.items()}
        outs.append(sse_decode(state, slots, **step, top_k=top_k, read_top_k=read_top_k,
                               decay_normalizer=normalizer, impl="torch"))
        order = x["router_logits"][:, t].argsort(-1, descending=True)
        for b in live.nonzero().squeeze(1).tolist():
            for p in order[b, top_k:].tolist():  # not written this step
                assert torch.equal(state[slots[b], :, p], before[slots[b], :, p])
    o = torch.stack(outs, 1)
    assert torch.count_nonzero(o[~live]) == 0
    assert rel_err(o[live], ref_o) < tol
    assert rel_err(states_from_cache(state[slots[live]]), ref_s) < tol


@pytest.mark.parametrize("bad,message", [
    (dict(read_top_k=5), "read_top_k must be in"),
    (dict(read_top_k=2, impl="triton_indexed"), "reads the partitions it writes"),
    (dict(drop="q_shared,k_shared_logits"), "log_decay_shared is the shared partition's"),
])
def test_bad_authors_arguments_are_named(bad, message):
    x = sse_inputs(2, 7, H, C, DV, 4, seed=1, shared_decay=True)
    for name in bad.pop("drop", "").split(","):
        x.pop(name, None)
    with pytest.raises(ValueError, match=message):
        sse_attention(**x, top_k=1, **bad)


def test_triton_decode_refuses_other_reads():
    x = sse_inputs(2, 1, H, C, DV, 4, seed=1)
    state = torch.zeros(2, H, 5, C, DV)
    with pytest.raises(ValueError, match="reads the partitions it writes"):
        sse_decode(state, torch.arange(2), **{k: v[:, 0].float() for k, v in x.items()}, top_k=1, read_top_k=2,
                   impl="triton")
