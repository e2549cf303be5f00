"""Fused SSE decode step: one new token for each of a batch of sequences, states updated in place.

Two launches, no host sync. `_token_kernel`, one program per token (all heads): routes the token (softmax + top-K
over N), makes its softmax keys, decays and q (and the shared partition's) and the int16 bound's largest decay and
|key| per head, into a float32 buffer. `_decode_kernel`, one program per (sequence, head, block of d_v columns):
reads those vectors straight into its tile's row layout, then for each of the K selected partitions and the shared
one loads its [c, BLOCK_V] state tile, decays and writes it, stores it back and accumulates w * q S. So each
touched state is read once and written once, the other partitions are not touched, and a slot id of -1 masks every
state load and store (output 0). Shapes are all the launches need: the step is CUDA-graph capturable. (Made in
every program, the token's vectors would be a fixed cost per program; `python -m bench.op --sections decode` times
the step.)

Token vectors are read and the output written through their token (row) stride, so a caller's views into one
packed projection buffer and into its output buffer go in as they are: in vLLM that saves a copy per input and
one for the output in every layer of every decode step.
"""
import torch
import triton
import triton.language as tl

from kernels.sse import decode as twin
from kernels.triton.common import cdiv, logsigmoid, pow2, router_softmax, softmax_keys, token_rows, token_stride, top1
from kernels.triton.configs import launch_settings

FIXED_MAX = tl.constexpr(float(twin.FIXED_MAX))
ZERO_BELOW = tl.constexpr(twin.ZERO_BELOW)
# Rounding to an integer with one fused multiply-add: for |x| < 2**22, x + 1.5 * 2**23 rounds x to the nearest integer
# (ties to even) and its float32 bits are 0x4B400000 + round(x), whose low 16 bits are round(x) as an int16 (the
# constant's are 0). With no clamp (the scale's bound covers the rounding) that replaces a compare, a select, an
# add, two clamps and a quarter-rate float-to-int conversion per value in the int16 step's inner loop
# (`python -m bench.op --sections decode`).
ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def store_rounded(ptr, x, mask):
    """Store round(x) as int16 (ties to even; |x| <= FIXED_MAX), by ROUNDER's add."""
    tl.store(ptr, (x + ROUNDER).to(tl.int32, bitcast=True).to(tl.int16), mask=mask)


@triton.jit
def _update(state_ptr, tile, mask, decay, key, v, q, scale_ptr, scale_mask, V, decay_max, key_max,
            FIXED: tl.constexpr, PTX: tl.constexpr):
    """S <- diag(decay) S + key^T v on one [c, BLOCK_V] tile; returns q S [1, BLOCK_V]. The update is float32 in
    registers whatever the cache's dtype; a bfloat16 or int16 cache rounds it once, on the store. int16: fixed point
    with a float32 scale per column at `scale_ptr` and the column's largest |S| V floats after it
    (kernels/sse/decode.py); the new scale comes from a bound known before the tile is read, so each value is
    stored as soon as it is updated (the arithmetic of `sse_decode_torch`, except that the largest decay here also
    counts the tile's padding rows past C, whose decay is 1: for c not a power of two the bound is looser than the
    twin's, still a bound). The bound covers the stored values' rounding too, so no rounded value passes
    +-FIXED_MAX and none is clamped."""
    if FIXED:
        scale = tl.load(scale_ptr, mask=scale_mask, other=0.0)
        top = tl.load(scale_ptr + V, mask=scale_mask, other=0.0)
        bound = decay_max * (top + 0.5 * scale) + key_max * tl.abs(v)
    S = tl.load(state_ptr + tile, mask=mask, other=0)
    if FIXED and PTX:
        # int16 x to float32 without a conversion instruction (quarter rate): flipping x's sign bit gives x + 32768
        # as 16 unsigned bits, and a byte permute puts 0x4B40 above them, the bits of 1.5 * 2**23 + 32768 + x;
        # one XOR and two permutes per pair of values, fewer issue slots than two conversions
        # (`python -m bench.op --sections decode`).
        f = tl.inline_asm_elementwise(
            "{ .reg .b32 t, k; mov.b32 k, 0x4B40; xor.b32 t, $2, 0x80008000; prmt.b32 $0, t, k, 0x5410; "
            "prmt.b32 $1, t, k, 0x5432; }", "=r,=r,r", [S], dtype=tl.float32, is_pure=True, pack=2)
        S = (f - (ROUNDER + 32768.0)) * scale
    elif FIXED:  # Triton's CPU interpreter (the CPU tests) runs no PTX
        S = S.to(tl.float32) * scale
    else:
        S = S.to(tl.float32)
    S = decay * S + key * v
    if FIXED:
        x = S * (FIXED_MAX / tl.where(bound > ZERO_BELOW, bound, 1.0))
        store_rounded(state_ptr + tile, x, mask)
        tl.store(scale_ptr, bound / FIXED_MAX, mask=scale_mask)
        tl.store(scale_ptr + V, tl.max(tl.abs(S), 0)[None, :], mask=scale_mask)  # rows past C are 0
    else:
        tl.store(state_ptr + tile, S.to(state_ptr.dtype.element_ty), mask=mask)
    return tl.sum(q * S, 0)[None, :]


# What a decode step needs of a token besides its states, per head: the rows of `_token_kernel`'s output.
KEYS, DECAY, QUERY, KEYS_SHARED, DECAY_SHARED, QUERY_SHARED, MAXIMA = (tl.constexpr(i) for i in range(7))
VECTOR_ROWS = 7
ROWS = tl.constexpr(VECTOR_ROWS)


@triton.jit
def _token_kernel(q_ptr, k_ptr, g_ptr, e_ptr, qs_ptr, ks_ptr, gs_ptr, vec_ptr, part_ptr, decay_normalizer, H, C, N,
                  row_q, row_k, row_g, row_e, row_qs, row_ks, row_gs, K: tl.constexpr, SHARED: tl.constexpr,
                  SHARED_LORA: tl.constexpr, SHARED_DECAY: tl.constexpr, ROW_TOPK: tl.constexpr,
                  DECAY_LOGITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per token, all heads: its keys, decays and q (and the shared partition's) as float32 rows
    vec [B, H, 7, C] (the six vectors, then a row whose first four floats are the int16 bound's largest decay and
    |key|, routed then shared), its K partitions and their router weights part [B, 2K] (weights as float32 bits). Made
    once here, not in each of `_decode_kernel`'s programs (one per head and block of columns): there the
    softmaxes, reductions and transposes were a fixed cost per program that smaller tiles could not amortise.
    With SHARED_DECAY the shared partition decays by its own log-decay (or logits) at gs_ptr."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_C)[None, :]
    n = tl.arange(0, BLOCK_N)[None, :]
    m = (h < H) & (c < C)
    hc = h * C + c
    z = tl.load(k_ptr + b * row_k + hc, mask=m, other=0.0)
    keys, keep = softmax_keys(z.to(tl.float32), c < C, ROW_TOPK, BLOCK_C)
    g = tl.load(g_ptr + b * row_g + hc, mask=m, other=0.0).to(tl.float32)
    if DECAY_LOGITS:
        g = logsigmoid(g) / decay_normalizer
    q = tl.load(q_ptr + b * row_q + hc, mask=m, other=0.0)
    heads = tl.arange(0, BLOCK_H)
    head_rows = vec_ptr + b * H * ROWS * C + heads * ROWS * C  # each head's first row
    out = head_rows[:, None] + c
    decay = tl.exp(tl.where(keep, g, 0.0))             # 1 on the tile's padding rows past C, as before
    tl.store(out + KEYS * C, keys, mask=m)
    tl.store(out + DECAY * C, decay, mask=m)
    tl.store(out + QUERY * C, q.to(tl.float32), mask=m)
    # the int16 bound's largest decay and |key| per head (routed keys times their weight w_p > 0 keep the order)
    maxima = head_rows + MAXIMA * C
    tl.store(maxima, tl.max(decay, 1), mask=heads < H)
    tl.store(maxima + 1, tl.max(tl.abs(keys), 1), mask=heads < H)
    if SHARED:
        z_s = tl.load(ks_ptr + b * row_ks + hc, mask=m, other=0.0)
        q_s = tl.load(qs_ptr + b * row_qs + hc, mask=m, other=0.0)
        if SHARED_LORA:  # the low-rank terms, added to the routed q and key logits in the inputs' dtype
            z_s = (z.to(tl.float32) + z_s.to(tl.float32)).to(k_ptr.dtype.element_ty)
            q_s = (q.to(tl.float32) + q_s.to(tl.float32)).to(q_ptr.dtype.element_ty)
        keys_s, keep_s = softmax_keys(z_s.to(tl.float32), c < C, ROW_TOPK, BLOCK_C)
        g_s = g
        if SHARED_DECAY:
            g_s = tl.load(gs_ptr + b * row_gs + hc, mask=m, other=0.0).to(tl.float32)
            if DECAY_LOGITS:
                g_s = logsigmoid(g_s) / decay_normalizer
        decay_s = tl.exp(tl.where(keep_s, g_s, 0.0))
        tl.store(out + KEYS_SHARED * C, keys_s, mask=m)
        tl.store(out + DECAY_SHARED * C, decay_s, mask=m)
        tl.store(maxima + 2, tl.max(decay_s, 1), mask=heads < H)
        tl.store(maxima + 3, tl.max(tl.abs(keys_s), 1), mask=heads < H)
        tl.store(out + QUERY_SHARED * C, q_s.to(tl.float32), mask=m)
    logits = tl.load(e_ptr + b * row_e + n, mask=n < N, other=0.0).to(tl.float32)
    w = router_softmax(logits, n, N)
    scores = tl.where(n < N, logits, float("-inf"))
    for i in tl.static_range(K):
        p, scores = top1(scores, n, BLOCK_N)           # [1, 1]
        w_p = tl.sum(tl.where(n == p, w, 0.0), 1, keep_dims=True)
        tl.store(part_ptr + b * 2 * K + i + tl.zeros([1, 1], tl.int64), p)
        tl.store(part_ptr + b * 2 * K + K + i + tl.zeros([1, 1], tl.int64), w_p.to(tl.int32, bitcast=True))


@triton.jit
def _decode_kernel(state_ptr, slot_ptr, vec_ptr, part_ptr, v_ptr, o_ptr, scale, H, C, V, N, stride_slot,
                   stride_head, stride_part, stride_row, stride_col, row_v, row_o, K: tl.constexpr,
                   SHARED: tl.constexpr, FIXED: tl.constexpr, PTX: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    # Column blocks vary fastest: the programs sharing one state's rows run side by side, so each row is read
    # whole at once instead of one half now and the other half-way through the launch (same results; it matters
    # most for bfloat16 caches at large batches, `python -m bench.op --sections decode`).
    pid = tl.program_id(0)
    blocks_v = tl.cdiv(V, BLOCK_V)
    b = (pid // (blocks_v * H)).to(tl.int64)
    h = pid // blocks_v % H
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = slot >= 0
    d = pid % blocks_v * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    r = tl.arange(0, BLOCK_C)[:, None]                 # state rows
    # The token's vectors, read straight into the tile's row layout [BLOCK_C, 1] (`_token_kernel`)
    head_rows = vec_ptr + b * H * ROWS * C + h * ROWS * C
    vec = head_rows + r
    rows = r < C
    v = tl.load(v_ptr + b * row_v + h * V + d, mask=d < V, other=0.0).to(tl.float32)

    tile = r * stride_row + d * stride_col             # [BLOCK_C, BLOCK_V] offsets inside one state
    mask = (r < tl.where(live, C, 0)) & (d < V)       # a skipped row (slot -1) loads and stores nothing
    base = state_ptr + slot * stride_slot + h * stride_head
    # int16 caches: the column scales' float32s follow a state's C rows, then their largest |S| (contiguous rows,
    # checked on the host)
    scales = (base + C * stride_row).to(tl.pointer_type(tl.float32)) + d
    scale_mask = d < tl.where(live, V, 0)
    acc = tl.zeros([1, BLOCK_V], tl.float32)
    keys = tl.load(vec + KEYS * C, mask=rows, other=0.0)
    decay = tl.load(vec + DECAY * C, mask=rows, other=1.0)
    q = tl.load(vec + QUERY * C, mask=rows, other=0.0)
    maxima = head_rows + MAXIMA * C
    for i in tl.static_range(K):
        p = tl.load(part_ptr + b * 2 * K + i)
        w_p = tl.load(part_ptr + b * 2 * K + K + i).to(tl.float32, bitcast=True)
        acc += w_p * _update(base + p * stride_part, tile, mask, decay, w_p * keys, v, q,
                             scales + p * stride_part // 2, scale_mask, V, tl.load(maxima),
                             w_p * tl.load(maxima + 1), FIXED, PTX)
    if SHARED:
        acc += _update(base + N * stride_part, tile, mask, tl.load(vec + DECAY_SHARED * C, mask=rows, other=1.0),
                       tl.load(vec + KEYS_SHARED * C, mask=rows, other=0.0), v,
                       tl.load(vec + QUERY_SHARED * C, mask=rows, other=0.0), scales + N * stride_part // 2,
                       scale_mask, V, tl.load(maxima + 2), tl.load(maxima + 3), FIXED, PTX)
    o = tl.where(live, scale * acc, 0.0)
    tl.store(o_ptr + b * row_o + h * V + d, o.to(o_ptr.dtype.element_ty), mask=d < V)


def default_launch(C: int, V: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the decode kernel on `device` for a state cache of `dtype` with c = C, d_v = V: the
    device's state tile bytes a program (kernels/triton/configs.py) as columns of all c rows."""
    launch = launch_settings("decode_int16" if dtype == torch.int16 else "decode", device)
    return min(pow2(V), max(16, launch["tile_bytes"] // (pow2(C) * dtype.itemsize))), launch["num_warps"]


def check_state_cache(state: torch.Tensor, shape: tuple[int, int, int, int]) -> None:
    """A state cache the kernels can take: float32, bfloat16 or int16 [num_slots, H, P, c (+ 4 for int16), d_v] for
    shape = (H, P, c, d_v), an int16 one with each state's rows contiguous (its scales are read as float32s)."""
    H, P, C, V = shape
    if state.dtype not in (torch.float32, torch.bfloat16, torch.int16):
        raise ValueError(f"an SSE state cache must be float32, bfloat16 or int16, got {state.dtype}")
    rows = twin.cache_rows(C, state.dtype)
    if state.dim() != 5 or state.shape[1:] != (H, P, rows, V):
        raise ValueError(f"state cache must be [num_slots, H, N + shared, {'c + 4' if rows > C else 'c'}, d_v] = "
                         f"[*, {H}, {P}, {rows}, {V}], got {tuple(state.shape)}")
    if state.dtype == torch.int16 and (state.stride(-1) != 1 or state.stride(-2) != V
                                       or any(st % 2 for st in state.stride()[:-1])):
        raise ValueError(f"an int16 state cache needs each state's rows contiguous (and even strides: its scales are "
                         f"float32s), got strides {state.stride()}")


def sse_decode_triton(state, slot_ids, q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None,
                      k_shared_logits=None, row_topk=None, scale=None, out=None, decay_normalizer=None,
                      shared_lora=False, log_decay_shared=None, block_v=None, num_warps=None):
    """Same contract as kernels.sse.decode.sse_decode_torch: state [num_slots, H, N + shared, c, d_v] float32 or
    bfloat16, or int16 [num_slots, H, N + shared, c + 4, d_v] (fixed point, `states_to_cache`) (any strides, a
    state's rows contiguous for int16; updated in place); q, k_logits, log_decay, q_shared, k_shared_logits [B, H, c];
    v [B, H, d_v]; router_logits [B, N]; slot_ids [B] (-1 = skip). Returns o [B, H, d_v] in v's dtype, written
    into `out` when given. Inputs and `out` may have any token stride (rows of a larger buffer are read in place).
    With `decay_normalizer`, `log_decay` holds decay logits and the kernel takes logsigmoid / normalizer itself.
    With `shared_lora`, q_shared and k_shared_logits are low-rank terms the kernel adds to q and k_logits
    (kernels.sse.decode.sse_decode_torch). `log_decay_shared` [B, H, c]: the shared partition's own log-decay (decay
    logits with `decay_normalizer`). Slot ids must be distinct (two programs writing one state would race).
    `block_v` (state columns per program) and `num_warps` override the device's launch (kernels/triton/configs.py),
    for sweeps and tests."""
    B, H, C = q.shape
    V, N = v.shape[-1], router_logits.shape[-1]
    shared = q_shared is not None
    if C < 4:  # `_token_kernel`'s maxima row holds four floats
        raise ValueError(f"sse_decode_triton needs c >= 4 (q is [B, H, c]), got c = {C}")
    check_state_cache(state, (H, N + shared, C, V))
    fixed = state.dtype == torch.int16
    scale = C**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty(B, H, V, dtype=v.dtype, device=v.device)
    elif out.shape != (B, H, V) or token_stride(out, 1) is None:
        raise ValueError(f"out must be [B, H, d_v] = {(B, H, V)} with contiguous tokens, got shape "
                         f"{tuple(out.shape)}, strides {out.stride()}")
    block_c = pow2(C)
    default_block_v, default_warps = default_launch(C, V, state.dtype, state.device)
    block_v, num_warps = block_v or default_block_v, num_warps or default_warps
    ptx = state.is_cuda and torch.version.cuda is not None  # NVIDIA's GPUs (not the interpreter's CPU, not ROCm)
    args = [token_rows(x, 1)[0] for x in (q, k_logits, v, log_decay, router_logits)]
    shared_args = [token_rows(x, 1)[0] for x in (q_shared, k_shared_logits)] if shared else args[:2]
    shared_decay = shared and log_decay_shared is not None
    shared_args.append(token_rows(log_decay_shared, 1)[0] if shared_decay else args[3])
    if B:
        vec = torch.empty(B, H, VECTOR_ROWS, C, dtype=torch.float32, device=v.device)
        part = torch.empty(B, 2 * top_k, dtype=torch.int32, device=v.device)
        _token_kernel[(B,)](*args[:2], args[3], args[4], *shared_args, vec, part, decay_normalizer or 1.0, H, C, N,
                            *(x.stride(0) for x in (args[0], args[1], args[3], args[4], *shared_args)), top_k,
                            shared, shared and shared_lora, shared_decay, row_topk or 0,
                            decay_normalizer is not None, pow2(H), block_c, pow2(N), num_warps=4)
        _decode_kernel[(B * H * cdiv(V, block_v),)](
            state, slot_ids.contiguous(), vec, part, args[2], out, scale, H, C, V, N, *state.stride(),
            args[2].stride(0), out.stride(0), top_k, shared, fixed, ptx, block_c, block_v, num_warps=num_warps)
    return out
