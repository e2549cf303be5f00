"""The SSE training operator of our own: chunked GLA kernels that load the routed rows by index.

The varlen layout (docs/model.md, "Equivalences") runs GLA over rows grouped by (segment, partition), K + shared
rows per token. `chunk.py` materialises those rows and hands them to fla's `chunk_gla`; here every kernel reads
a row straight from the token tensors through `row_token` (row -> token, from the counting sort in routing.py)
and builds it on the fly: w_p q, w_p keys, v, log-decay masked to the kept key rows (routed), or the shared
partition's q_shared, shared keys -- the same rows `expand.py` writes (keys = softmax_keys(k_logits), once per
call by `_keys_kernel`). No host synchronisation: grids are sized from host-side bounds (rows, groups), and
programs past the last chunk exit.

Per chunk of BT rows of one group (b = in-chunk cumulative log decay, b_last its last row, scale folded into q):
    A = tril((q e^b) (k e^-b)^T)         o = A v + (q e^b) h        h' = e^b_last h + (k e^(b_last - b))^T v
The factorised scores need e^-b finite: chunks whose decays pass -FACTORISED_LIMIT take the pairwise form
sum_c q_tc k_sc e^(b_tc - b_sc) instead (a uniform branch per program, exact for any decay).

Kernels (grid in brackets; G groups, NC chunk slots, NV value blocks of BLOCK_V columns, configs.py):
- forward  `_chunk_sums` [NC, H, NV]: each chunk's state update, all chunks at once, float32 (in the backward
           rounded to the activations' dtype where the final state / dh0 is not used); `_scan`
           [state tiles, H, G]: chains a group's chunks in float32 and stores the state before every chunk in the
           activations' dtype (and the final state in float32); `_output` [NC, H, NV]: o rows; `collect`
           (expand.py) sums a token's rows.
- backward the states and row sources (kept from the forward up to `KEPT_BYTES`, made again above it and in a
           checkpointed call, whose recomputation replays the first forward: kernels/checkpoint_replay.py), then
           `_chunk_sums` + `_scan` in reverse for the gradient
           of the state after every chunk and dh0; `_dv` [NC, H, NV] and `_dq_dk_dg` [NC, H, key blocks] (one
           pass over the value blocks for dA, dq, dk and the decay gradient of its key columns): row gradients;
           `_expand_bwd_kernel` (expand.py) reduces them to the token inputs.
The decay gradient uses dg_t = sum over u >= t of (q_u dq_u - k_u dk_u) within the chunk, plus
sum_v(h_after * dh_after): everything after the chunk sees this chunk's decays only through h_after.
"""
import functools

import torch
import triton
import triton.language as tl

from kernels import saved_views
from kernels.sse.routing import selection_scores
from kernels.triton.common import cdiv, logsigmoid, pow2, router_softmax, softmax_keys, token_rows
from kernels.triton.configs import launch_settings
from kernels.triton.expand import _blocks, _collect_fwd_kernel, _expand_bwd_kernel, _warps
from kernels.triton.routing import route_varlen

CHUNK = 64               # rows per chunk
# The forward keeps for the backward what the backward would otherwise make again -- the per-chunk and final states
# and `_keys_kernel`'s keys and log-decays -- when together they take at most this many bytes; above it the backward
# makes them again. The states cost H C d_v bf16 values per chunk of 64 rows (16 KiB per token and layer with one
# routed partition + the shared one at 16 heads of 128 x 128), the keys, shared keys and log-decays 6 bytes per
# token, head and key column (bf16): at 8k tokens they fit and are kept, at 32k they are made again. Making them is
# three launches (`_keys_kernel`, `_chunk_sums`, `_scan`) in the backward. Long rows are where memory binds, short
# ones where the recompute shows (`python -m bench.train_step` at 8k and 32k tokens).
KEPT_BYTES = 256 * 2**20
# Largest |b| in a chunk for the factorised scores: e^60 is far from float32 / bfloat16 overflow.
FACTORISED_LIMIT = tl.constexpr(60.0)


@triton.jit
def _rows(cid, row_token_ptr, cu_ptr, chunk_first_ptr, chunk_group_ptr, G, BT: tl.constexpr):
    """The rows of chunk slot `cid`: its group, row ids, which rows exist, their tokens."""
    g = tl.load(chunk_group_ptr + cid)
    gs = tl.minimum(g, G - 1)  # slots past the last chunk read a real group and are masked off by `live`
    start = tl.load(cu_ptr + gs) + (cid - tl.load(chunk_first_ptr + gs)) * BT
    r = start + tl.arange(0, BT)
    end = tl.where(g < G, tl.load(cu_ptr + gs + 1), 0)
    live = r < end
    tok = tl.load(row_token_ptr + r, mask=live, other=0).to(tl.int64)
    return gs, r.to(tl.int64), live, tok


@triton.jit
def _row_inputs(tok, live, part, h, q_ptr, k_ptr, g_ptr, e_ptr, qs_ptr, ks_ptr, gs_ptr, H, C, N, SQ, scale, c0,
                BT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    """(scale * q_row, k_row, b, b_last) [BT, BLOCK_C] in float32 for rows of partition `part` (N = shared), from
    the token tensors of `_keys_kernel` (keys, decays masked to the kept key rows) and q (tokens SQ apart), key
    columns c0 ... c0 + BLOCK_C. Dead rows give zeros (and zero decay, so b is flat past a group's last row)."""
    c = c0 + tl.arange(0, BLOCK_C)[None, :]
    n = tl.arange(0, BLOCK_N)[None, :]
    m = live[:, None] & (c < C)
    hc = tok[:, None] * H * C + h * C + c
    if part == N:
        q = tl.load(qs_ptr + hc, mask=m, other=0.0).to(tl.float32) * scale
        k = tl.load(ks_ptr + hc, mask=m, other=0.0).to(tl.float32)
        g = tl.load(gs_ptr + hc, mask=m, other=0.0).to(tl.float32)
    else:
        p = router_softmax(tl.load(e_ptr + tok[:, None] * N + n, mask=live[:, None] & (n < N), other=0.0)
                           .to(tl.float32), n, N)
        w = tl.sum(tl.where(n == part, p, 0.0), 1)[:, None]
        q = tl.load(q_ptr + tok[:, None] * SQ + h * C + c, mask=m, other=0.0).to(tl.float32) * (w * scale)
        k = tl.load(k_ptr + hc, mask=m, other=0.0).to(tl.float32) * w
        g = tl.load(g_ptr + hc, mask=m, other=0.0).to(tl.float32)
    b = tl.cumsum(g, 0)
    return q, k, b, _row_of(b, BT - 1, BT)


@triton.jit
def _row_of(x, i, BT: tl.constexpr):
    """Row i of a register tile [BT, D] -> [D]."""
    return tl.sum(tl.where(tl.arange(0, BT)[:, None] == i, x, 0.0), 0)


@triton.jit
def _scores(q, k, b, dtype, BT: tl.constexpr):
    """A = tril(sum_c q_tc k_sc e^(b_tc - b_sc)) [BT, BT]."""
    t = tl.arange(0, BT)[:, None]
    s = tl.arange(0, BT)[None, :]
    if tl.min(b) > -FACTORISED_LIMIT:
        A = tl.dot((q * tl.exp(b)).to(dtype), tl.trans((k * tl.exp(-b)).to(dtype)))
    else:
        A = tl.zeros([BT, BT], tl.float32)
        for j in range(BT):
            col = tl.sum(q * _row_of(k, j, BT)[None, :] * tl.exp(tl.minimum(b - _row_of(b, j, BT)[None, :], 0.0)), 1)
            A = tl.where(s == j, col[:, None], A)
    return tl.where(t >= s, A, 0.0)


@triton.jit
def _keys_kernel(k_ptr, ks_ptr, g_ptr, gs_in_ptr, keys_ptr, keys_s_ptr, g_out_ptr, g_s_ptr, decay_normalizer, H, C,
                 SK, SHARED: tl.constexpr, ROW_TOPK: tl.constexpr, DECAY_LOGITS: tl.constexpr,
                 SHARED_DECAY: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per token, all heads: keys = softmax_keys(k_logits) (and the shared partition's), and where the chunk
    kernels cannot read g as given, the log-decay they read: from decay logits (logsigmoid(x) / decay_normalizer)
    and / or masked to the kept rows (row-sparse; the shared keys keep rows of their own, so their decay is
    masked on its own). With SHARED_DECAY the shared partition's decay is its own input (gs_in_ptr), made the same
    way. Computed once per call instead of in every chunk kernel. k_logits' tokens are SK apart."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_C)[None, :]
    m = (h < H) & (c < C)
    hc = t * H * C + h * C + c
    keys, keep = softmax_keys(tl.load(k_ptr + t * SK + h * C + c, mask=m, other=0.0).to(tl.float32), c < C, ROW_TOPK,
                              BLOCK_C)
    tl.store(keys_ptr + hc, keys.to(keys_ptr.dtype.element_ty), mask=m)
    if DECAY_LOGITS or ROW_TOPK > 0:
        g = tl.load(g_ptr + hc, mask=m, other=0.0).to(tl.float32)
        if DECAY_LOGITS:
            g = logsigmoid(g) / decay_normalizer
        tl.store(g_out_ptr + hc, tl.where(keep, g, 0.0), mask=m)
    if SHARED:
        keys, keep = softmax_keys(tl.load(ks_ptr + hc, mask=m, other=0.0).to(tl.float32), c < C, ROW_TOPK, BLOCK_C)
        tl.store(keys_s_ptr + hc, keys.to(keys_s_ptr.dtype.element_ty), mask=m)
        if SHARED_DECAY:
            if DECAY_LOGITS or ROW_TOPK > 0:
                g_s = tl.load(gs_in_ptr + hc, mask=m, other=0.0).to(tl.float32)
                if DECAY_LOGITS:
                    g_s = logsigmoid(g_s) / decay_normalizer
                tl.store(g_s_ptr + hc, tl.where(keep, g_s, 0.0), mask=m)
        elif ROW_TOPK > 0:
            tl.store(g_s_ptr + hc, tl.where(keep, g, 0.0), mask=m)


# Arguments that count tokens, groups or chunks (G, NC, num_slots here, L / num_segments in routing.py, R in the
# norm gate) change with every vLLM prefill step and packed batch; specialised on being 1 or a multiple of 16 they
# would compile a new variant, which takes seconds, in the middle of a rollout (`python -m bench.rollouts`).
@triton.jit(do_not_specialize=["G", "NC"])
def _chunk_sums_kernel(row_token_ptr, cu_ptr, chunk_first_ptr, chunk_group_ptr, q_ptr, k_ptr, x_ptr, g_ptr, e_ptr,
                       qs_ptr, ks_ptr, gs_ptr, out_ptr, decay_ptr, G, NC, H, C, V, N, P, SQ, SX, scale,
                       QUERY: tl.constexpr, BT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """What one chunk adds to the state, before `_scan_kernel` chains the chunks: (k e^(b_last - b))^T v going
    forward (x = v), or (q e^b)^T do going backward (QUERY, x = do); and the chunk's decay b_last. Tokens of q
    and x are SQ and SX apart."""
    cid, h, vb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    g, r, live, tok = _rows(cid, row_token_ptr, cu_ptr, chunk_first_ptr, chunk_group_ptr, G, BT)
    if tl.max(live.to(tl.int32)) == 0:
        return
    q, k, b, b_last = _row_inputs(tok, live, g % P, h, q_ptr, k_ptr, g_ptr, e_ptr, qs_ptr, ks_ptr, gs_ptr, H, C, N,
                                     SQ, scale, 0, BT, BLOCK_C, BLOCK_N)
    c = tl.arange(0, BLOCK_C)
    d = vb * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    x = tl.load(x_ptr + tok[:, None] * SX + h * V + d, mask=live[:, None] & (d < V), other=0.0)
    if QUERY:
        side = q * tl.exp(b)
    else:
        side = k * tl.exp(b_last[None, :] - b)
    update = tl.dot(tl.trans(side.to(x.dtype)), x)
    tl.store(out_ptr + (h * NC + cid) * C * V + c[:, None] * V + d, update.to(out_ptr.dtype.element_ty),
             mask=(c[:, None] < C) & (d < V))
    if vb == 0:
        tl.store(decay_ptr + (h * NC + cid) * C + c, b_last, mask=c < C)


@triton.jit
def _scan_at(first, n_chunks, i, h, NC, REVERSE: tl.constexpr):
    """Row (h, chunk) of the scan's i-th step in the [H, NC] chunk layout."""
    if REVERSE:
        cid = first + n_chunks - 1 - i
    else:
        cid = first + i
    return h * NC + cid


@triton.jit
def _scan_load(x_ptr, decay_ptr, first, n_chunks, i, h, NC, H, C, V, cv, c, m, REVERSE: tl.constexpr):
    """(x, b_last) of the scan's i-th step. Steps past the group's end re-read a real row (never used), so the
    loads need no mask beyond the tile's."""
    at = _scan_at(first, n_chunks, tl.minimum(i, n_chunks - 1), h, NC, REVERSE)
    at = tl.minimum(tl.maximum(at, 0), H * NC - 1)
    return tl.load(x_ptr + at * C * V + cv, mask=m, other=0.0), tl.load(decay_ptr + at * C + c, mask=c < C, other=0.0)


@triton.jit(do_not_specialize=["NC"])
def _scan_kernel(x_ptr, out_ptr, decay_ptr, chunk_first_ptr, init_ptr, last_ptr, NC, H, C, V, P,
                 HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    """Chains a group's chunks elementwise over a [BLOCK_C, BLOCK_V] tile of the state, in float32:
    forward, x[c] = chunk c's update, out[c] = the state before chunk c (h' = e^b_last h + update);
    REVERSE, x[c] = (q e^b)^T do, out[c] = the gradient of the state after chunk c (dh = e^b_last dh' + x[c]).
    out may be x itself (step i writes slot i after its load) or a buffer of the activations' dtype.
    init = h0 / d final state (optional), last = final state / d h0 (float32); layout [S, H, P, C, V]."""
    tile, h, g = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    tiles_v = tl.cdiv(V, BLOCK_V)
    c = (tile // tiles_v) * BLOCK_C + tl.arange(0, BLOCK_C)
    d = (tile % tiles_v) * BLOCK_V + tl.arange(0, BLOCK_V)
    cv = c[:, None] * V + d[None, :]
    m = (c[:, None] < C) & (d[None, :] < V)
    state_at = (((g // P) * H + h) * P + g % P) * C * V
    state = tl.zeros([BLOCK_C, BLOCK_V], tl.float32)
    if HAS_INIT:
        state = tl.load(init_ptr + state_at + cv, mask=m, other=0.0).to(tl.float32)
    first = tl.load(chunk_first_ptr + g)
    n_chunks = tl.load(chunk_first_ptr + g + 1) - first
    # Each step only waits on loads issued two steps earlier: the chain is latency-bound otherwise.
    x0, d0 = _scan_load(x_ptr, decay_ptr, first, n_chunks, 0, h, NC, H, C, V, cv, c, m, REVERSE)
    x1, d1 = _scan_load(x_ptr, decay_ptr, first, n_chunks, 1, h, NC, H, C, V, cv, c, m, REVERSE)
    for i in range(n_chunks):
        x2, d2 = _scan_load(x_ptr, decay_ptr, first, n_chunks, i + 2, h, NC, H, C, V, cv, c, m, REVERSE)
        tl.store(out_ptr + _scan_at(first, n_chunks, i, h, NC, REVERSE) * C * V + cv,
                 state.to(out_ptr.dtype.element_ty), mask=m)
        state = state * tl.exp(d0)[:, None] + x0
        x0, d0, x1, d1 = x1, d1, x2, d2
    tl.store(last_ptr + state_at + cv, state, mask=m)


@triton.jit(do_not_specialize=["G", "NC"])
def _output_kernel(row_token_ptr, cu_ptr, chunk_first_ptr, chunk_group_ptr, q_ptr, k_ptr, v_ptr, g_ptr, e_ptr,
                   qs_ptr, ks_ptr, gs_ptr, h_ptr, o_ptr, G, NC, H, C, V, N, P, SQ, SV, scale, BT: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr):
    cid, h, vb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    g, r, live, tok = _rows(cid, row_token_ptr, cu_ptr, chunk_first_ptr, chunk_group_ptr, G, BT)
    if tl.max(live.to(tl.int32)) == 0:
        return
    q, k, b, _ = _row_inputs(tok, live, g % P, h, q_ptr, k_ptr, g_ptr, e_ptr, qs_ptr, ks_ptr, gs_ptr, H, C, N, SQ,
                                scale, 0, BT, BLOCK_C, BLOCK_N)
    c = tl.arange(0, BLOCK_C)[:, None]
    d = vb * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    dt = v_ptr.dtype.element_ty
    v = tl.load(v_ptr + tok[:, None] * SV + h * V + d, mask=live[:, None] & (d < V), other=0.0)
    state = tl.load(h_ptr + (h * NC + cid) * C * V + c * V + d, mask=(c < C) & (d < V), other=0.0)
    o = tl.dot(_scores(q, k, b, dt, BT).to(dt), v) + tl.dot((q * tl.exp(b)).to(dt), state.to(dt))
    tl.store(o_ptr + r[:, None] * H * V + h * V + d, o.to(o_ptr.dtype.element_ty), mask=live[:, None] & (d < V))


@triton.jit(do_not_specialize=["G", "NC"])
def _dv_kernel(row_token_ptr, cu_ptr, chunk_first_ptr, chunk_group_ptr, q_ptr, k_ptr, g_ptr, e_ptr, qs_ptr, ks_ptr,
               gs_ptr, do_ptr, dh_ptr, dv_ptr, G, NC, H, C, V, N, P, SQ, scale, BT: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr):
    """dv = A^T do + (k e^(b_last - b)) dh_after."""
    cid, h, vb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    g, r, live, tok = _rows(cid, row_token_ptr, cu_ptr, chunk_first_ptr, chunk_group_ptr, G, BT)
    if tl.max(live.to(tl.int32)) == 0:
        return
    q, k, b, b_last = _row_inputs(tok, live, g % P, h, q_ptr, k_ptr, g_ptr, e_ptr, qs_ptr, ks_ptr, gs_ptr, H, C, N,
                                     SQ, scale, 0, BT, BLOCK_C, BLOCK_N)
    c = tl.arange(0, BLOCK_C)[:, None]
    d = vb * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    dt = do_ptr.dtype.element_ty
    do = tl.load(do_ptr + tok[:, None] * H * V + h * V + d, mask=live[:, None] & (d < V), other=0.0)
    dh = tl.load(dh_ptr + (h * NC + cid) * C * V + c * V + d, mask=(c < C) & (d < V), other=0.0)
    dv = tl.dot(tl.trans(_scores(q, k, b, dt, BT).to(dt)), do)
    dv += tl.dot((k * tl.exp(b_last[None, :] - b)).to(dt), dh.to(dt))
    tl.store(dv_ptr + r[:, None] * H * V + h * V + d, dv.to(dv_ptr.dtype.element_ty), mask=live[:, None] & (d < V))


@triton.jit(do_not_specialize=["G", "NC"])
def _dq_dk_dg_kernel(row_token_ptr, cu_ptr, chunk_first_ptr, chunk_group_ptr, q_ptr, k_ptr, v_ptr, g_ptr, e_ptr,
                     qs_ptr, ks_ptr, gs_ptr, do_ptr, h_ptr, final_ptr, dh_ptr, dq_ptr, dk_ptr, dg_ptr, G, NC, H, C, V,
                     N, P, SQ, SV, scale, BT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """With dA = tril(do v^T), both from one pass over the value blocks:
    dq_row = scale * (dA (k e^-b) + do h^T) e^b,  dk_row = (dA^T (q e^b)) e^-b + (v dh_after^T) e^(b_last - b),
    dg_row from q dq - k dk (module docstring); pairwise when e^-b would overflow."""
    cid, h, c0 = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2) * BLOCK_C
    g, r, live, tok = _rows(cid, row_token_ptr, cu_ptr, chunk_first_ptr, chunk_group_ptr, G, BT)
    if tl.max(live.to(tl.int32)) == 0:
        return
    dt = do_ptr.dtype.element_ty
    c = c0 + tl.arange(0, BLOCK_C)
    dA = tl.zeros([BT, BT], tl.float32)
    dq = tl.zeros([BT, BLOCK_C], tl.float32)  # w.r.t. the scaled q
    dk = tl.zeros([BT, BLOCK_C], tl.float32)
    dgh = tl.zeros([BLOCK_C], tl.float32)  # sum_v(h_after * dh_after)
    # h after this chunk: the next chunk's state, or the group's final state (float32) after its last chunk.
    # (A tile, not a scalar, because Triton's interpreter refuses a scalar inside a load mask.)
    has_next = tl.zeros([BLOCK_C, BLOCK_V], tl.int64) + tl.load(chunk_first_ptr + g + 1) > cid + 1
    final_at = (((g // P) * H + h) * P + g % P) * C * V
    for vb in range(tl.cdiv(V, BLOCK_V)):
        d = vb * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
        m = live[:, None] & (d < V)
        do = tl.load(do_ptr + tok[:, None] * H * V + h * V + d, mask=m, other=0.0)
        v = tl.load(v_ptr + tok[:, None] * SV + h * V + d, mask=m, other=0.0)
        in_cv = (c[:, None] < C) & (d < V)
        at = (h * NC + cid) * C * V + c[:, None] * V + d
        state = tl.load(h_ptr + at, mask=in_cv, other=0.0)
        dh = tl.load(dh_ptr + at, mask=in_cv, other=0.0)
        after = tl.load(h_ptr + at + C * V, mask=in_cv & has_next, other=0.0).to(tl.float32)
        after += tl.load(final_ptr + final_at + c[:, None] * V + d, mask=in_cv & ~has_next, other=0.0)
        dA += tl.dot(do, tl.trans(v))
        dq += tl.dot(do, tl.trans(state.to(dt)))
        dk += tl.dot(v, tl.trans(dh.to(dt)))
        dgh += tl.sum(after * dh.to(tl.float32), 1)
    # The rows' inputs only now: the loop above keeps fewer registers live without them.
    q, k, b, b_last = _row_inputs(tok, live, g % P, h, q_ptr, k_ptr, g_ptr, e_ptr, qs_ptr, ks_ptr, gs_ptr, H, C, N,
                                     SQ, scale, c0, BT, BLOCK_C, BLOCK_N)
    dk *= tl.exp(b_last[None, :] - b)
    t, s = tl.arange(0, BT)[:, None], tl.arange(0, BT)[None, :]
    dA = tl.where(t >= s, dA, 0.0)
    if tl.min(b) > -FACTORISED_LIMIT:
        dq += tl.dot(dA.to(dt), (k * tl.exp(-b)).to(dt))
        dq *= tl.exp(b)
        dk += tl.dot(tl.trans(dA.to(dt)), (q * tl.exp(b)).to(dt)) * tl.exp(-b)
    else:
        dq *= tl.exp(b)
        for j in range(BT):
            a = tl.sum(tl.where(s == j, dA, 0.0), 1)
            b_j = _row_of(b, j, BT)[None, :]
            dq += a[:, None] * _row_of(k, j, BT)[None, :] * tl.exp(tl.minimum(b - b_j, 0.0))
            row = tl.sum(a[:, None] * q * tl.exp(tl.minimum(b - b_j, 0.0)), 0)
            dk += tl.where(t == j, row[None, :], 0.0)
    dg = tl.cumsum(q * dq - k * dk, 0, reverse=True) + dgh[None, :]
    hc = r[:, None] * H * C + h * C + c[None, :]
    m = live[:, None] & (c[None, :] < C)
    tl.store(dq_ptr + hc, (dq * scale).to(dq_ptr.dtype.element_ty), mask=m)
    tl.store(dk_ptr + hc, dk.to(dk_ptr.dtype.element_ty), mask=m)
    tl.store(dg_ptr + hc, dg, mask=m)


def _row_sources(q, k_logits, log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared, row_topk,
                 decay_normalizer, strides):
    """The token tensors every chunk kernel builds its rows from: (q, keys, g, router logits, q_shared,
    shared keys, shared g), one `_keys_kernel` launch; log_decay (and log_decay_shared, the shared partition's own
    where given) hold decay logits when `decay_normalizer` is given. Without a shared partition the shared slots
    repeat the routed ones (never read). `strides`: the token strides of q, k_logits and v (`token_rows`); all else
    is contiguous."""
    H, C = k_logits.shape[-2:]
    L = k_logits.numel() // (H * C)
    shared, made_g = q_shared is not None, decay_normalizer is not None or bool(row_topk)
    shared_decay = log_decay_shared is not None
    made_gs = shared and (bool(row_topk) or (shared_decay and made_g))
    # g in q's dtype, as fla's GLA layer hands chunk_gla its log-decays: the chunk kernels sum it in float32 (b), and
    # it is read K + 1 times per token by five kernels. All made tensors are one allocation (one op, not four).
    buffers = iter(torch.empty(1 + made_g + shared + made_gs, *k_logits.shape, dtype=q.dtype,
                               device=q.device).unbind(0))
    keys = next(buffers)
    g = next(buffers) if made_g else log_decay
    keys_s = next(buffers) if shared else keys
    # without row-sparse keys the shared rows decay as given: as the routed ones, or by their own log-decay
    g_s = next(buffers) if made_gs else log_decay_shared if shared_decay else g
    if L:
        _keys_kernel[(L,)](k_logits, k_shared_logits if shared else k_logits, log_decay,
                           log_decay_shared if shared_decay else log_decay, keys, keys_s, g, g_s,
                           decay_normalizer or 1.0, H, C, strides[1], shared, row_topk or 0,
                           decay_normalizer is not None, shared_decay, pow2(H), pow2(C), num_warps=_warps(H, C))
    return _sources(q, keys, g, router_logits, q_shared, keys_s, g_s)


def _sources(q, keys, g, router_logits, q_shared, keys_s, g_s):
    """The tuple the chunk kernels take (`_row_sources`); without a shared partition keys_s and g_s are keys and g,
    and q stands in for q_shared."""
    return q, keys, g, router_logits, q if q_shared is None else q_shared, keys_s, g_s


def _launch(kernel, C, V, N, chunk_size, device):
    """Block sizes and launch settings of one chunk kernel on `device` (kernels/triton/configs.py). Its "BLOCK_V"
    caps the value columns of one program; "BLOCK_C", where given, the key columns of one program
    (`_dq_dk_dg_kernel`, whose results split by key column)."""
    launch = dict(launch_settings("indexed_chunk", device)[kernel])
    return dict(BT=chunk_size, BLOCK_C=min(pow2(C), launch.pop("BLOCK_C", pow2(C))),
                BLOCK_V=min(pow2(V), launch.pop("BLOCK_V")), BLOCK_N=pow2(N), **launch)


def _chunk_grid(tables, H, V, launch):
    return (tables[3].numel(), H, cdiv(V, launch["BLOCK_V"]))


class _IndexedChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared,
                initial_state, tables, scale, row_topk, chunk_size, decay_normalizer, final_returned, replayed):
        # [B, T, H, -1] in and out, read as token rows [B * T, H, -1], nothing reshaped (each reshape or view is host
        # work, and the SSE layer's host time bounds short training steps). q, k_logits and v may be
        # column blocks of a wider tensor (`token_rows`: the SSE layer's projections are one GEMM); the rest, made
        # by ops of their own, are contiguous. `replayed` (kernels/checkpoint_replay.py): None, or under checkpointing
        # () in the first forward, which keeps nothing for the backward, and (o,) in the recomputation, which
        # computes nothing and returns the first forward's o.
        (q, sq), (k_logits, sk), (v, sv) = (token_rows(t) for t in (q, k_logits, v))
        strides = (sq, sk, sv)
        log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared = (
            None if t is None else t.contiguous()
            for t in (log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared))
        if replayed:
            o, final, kept = replayed[0].detach(), None, (None,) * 6
        else:
            o, final, kept = _forward(q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits,
                                      log_decay_shared, initial_state, tables, scale, row_topk, chunk_size,
                                      decay_normalizer, final_returned, strides, may_keep=replayed is None)
        saved_views.save(ctx, q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared,
                         initial_state, *kept, *tables[:6])
        ctx.rest = (*tables[6:], scale, row_topk, chunk_size, decay_normalizer, strides, final_returned)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        (q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared, initial_state, h,
         final, keys, g, keys_s, gs, *index) = saved_views.saved(ctx)
        S, P, scale, row_topk, chunk_size, decay_normalizer, strides, final_returned = ctx.rest
        sq, _, sv = strides
        row_token, cu, chunk_first, chunk_group, part, pos = index
        tables = (*index, S, P)
        H, C = q.shape[-2:]
        V, N, G, NC, R = v.shape[-1], router_logits.shape[-1], cu.numel() - 1, chunk_group.numel(), row_token.numel()
        do = do.contiguous()
        if h is None:  # not kept (KEPT_BYTES, or the first forward of a checkpointed call): made as the forward did
            sources = _row_sources(q, k_logits, log_decay, router_logits, q_shared, k_shared_logits,
                                   log_decay_shared, row_topk, decay_normalizer, strides)
            h, final = _chained(sources, sq, v, sv, initial_state, tables, scale, chunk_size, query=False,
                                exact_last=final_returned)
        else:
            sources = _sources(q, keys, g, router_logits, q_shared, keys_s, gs)
        dh, dh0 = _chained(sources, sq, do, H * V, dfinal, tables, scale, chunk_size, query=True,
                           exact_last=initial_state is not None)
        dq_rows, dk_rows = (torch.empty(R, H, C, dtype=q.dtype, device=q.device) for _ in range(2))
        dg_rows = torch.empty(R, H, C, dtype=torch.float32, device=q.device)
        dv_rows = torch.empty(R, H, V, dtype=v.dtype, device=q.device)
        q_, keys, g, e, qs, keys_s, gs = sources
        index = (row_token, cu, chunk_first, chunk_group)
        launch = _launch("dv", C, V, N, chunk_size, q.device)
        _dv_kernel[_chunk_grid(tables, H, V, launch)](*index, q_, keys, g, e, qs, keys_s, gs, do, dh, dv_rows, G, NC,
                                                      H, C, V, N, P, sq, scale, **launch)
        # [chunk slots, heads, key blocks]: it loops over values
        launch = _launch("dq_dk_dg", C, V, N, chunk_size, q.device)
        _dq_dk_dg_kernel[(chunk_group.numel(), H, cdiv(C, launch["BLOCK_C"]))](
            *index, q_, keys, v, g, e, qs, keys_s, gs, do, h, final, dh, dq_rows, dk_rows, dg_rows, G, NC, H, C, V, N,
            P, sq, sv, scale, **launch)
        del h, dh, sources
        grads = _token_grads(q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared,
                             part, pos, (dq_rows, dk_rows, dv_rows, dg_rows), row_topk, decay_normalizer, strides)
        dh0 = dh0.to(initial_state.dtype) if initial_state is not None else None
        return (*grads, dh0, None, None, None, None, None, None, None)


def _forward(q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared, initial_state,
             tables, scale, row_topk, chunk_size, decay_normalizer, final_returned, strides, may_keep):
    """`_IndexedChunk.forward`'s computation: (o [B, T, H, V], the final states, what the backward would otherwise
    make again -- per-chunk states, final states, `_keys_kernel`'s keys and log-decays -- where `may_keep` and they
    take at most KEPT_BYTES beyond the inputs, else Nones)."""
    B, T, H, C = q.shape
    L = B * T
    sq, _, sv = strides
    row_token, cu, chunk_first, chunk_group, part, pos, S, P = tables
    V, N, G, NC = v.shape[-1], router_logits.shape[-1], cu.numel() - 1, chunk_group.numel()
    sources = _row_sources(q, k_logits, log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared,
                           row_topk, decay_normalizer, strides)
    # The final state is read again only by the backward, for the last chunk's state term, where the other
    # chunks' states are bf16 anyway: exact (float32 updates) only where the caller gets it.
    h, final = _chained(sources, sq, v, sv, initial_state, tables, scale, chunk_size, query=False,
                        exact_last=final_returned)
    o_rows = torch.empty(row_token.numel(), H, V, dtype=v.dtype, device=v.device)
    q_, keys, g, e, qs, keys_s, gs = sources
    launch = _launch("output", C, V, N, chunk_size, v.device)
    _output_kernel[_chunk_grid(tables, H, V, launch)](
        row_token, cu, chunk_first, chunk_group, q_, keys, v, g, e, qs, keys_s, gs, h, o_rows, G, NC, H, C, V, N,
        P, sq, sv, scale, **launch)
    made = {id(t): t for t in (keys, g, keys_s, gs)
            if t is not log_decay and t is not log_decay_shared}.values()  # _keys_kernel's outputs
    keep = may_keep and h.numel() * h.element_size() + sum(t.numel() * t.element_size() for t in made) <= KEPT_BYTES
    kept = (h, final, keys, g, keys_s, gs) if keep else (None,) * 6
    del sources, made, h, keys, g, keys_s, gs  # freed here unless kept
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    if L:
        _collect_fwd_kernel[(L,)](o_rows, pos, o, H, V, pos.shape[1], pow2(H), pow2(V))
    return o, final, kept


def _chained(sources, sq, x, sx, init, tables, scale, chunk_size, query, exact_last):
    """Going forward (x = v, init = h0): the state before every chunk [H, NC, C, V] and the final states
    [S, H, P, C, V]. Going backward (query, x = do, init = d final): the gradient of the state after every chunk
    and d h0. The chain runs in float32; the per-chunk states are stored in x's dtype, as fla stores its chunk
    states: the kernels that read them cast them to it for their dots anyway, and bf16 halves their largest read.
    The final state / d h0 are float32; with `exact_last` (they are used) the chunks' updates are kept in float32
    too, otherwise they are rounded to x's dtype like the states made from them, which halves the traffic between
    `_chunk_sums_kernel` and `_scan_kernel` (their largest). The tokens of q (in `sources`) and x are sq and sx
    apart."""
    q, keys, g, e, qs, keys_s, gs = sources
    row_token, cu, chunk_first, chunk_group, _, _, S, P = tables
    H, C = q.shape[-2:]
    V, N, G, NC = x.shape[-1], e.shape[-1], cu.numel() - 1, chunk_group.numel()
    sums = torch.empty(H, NC, C, V, dtype=torch.float32 if exact_last else x.dtype, device=q.device)
    decay = torch.empty(H, NC, C, dtype=torch.float32, device=q.device)
    launch = _launch("chunk_sums", C, V, N, chunk_size, q.device)
    _chunk_sums_kernel[_chunk_grid(tables, H, V, launch)](row_token, cu, chunk_first, chunk_group, q, keys, x, g, e,
                                                          qs, keys_s, gs, sums, decay, G, NC, H, C, V, N, P, sq, sx,
                                                          scale, query, **launch)
    states = sums if sums.dtype == x.dtype else torch.empty(H, NC, C, V, dtype=x.dtype, device=q.device)
    last = torch.empty(S, H, P, C, V, dtype=torch.float32, device=q.device)
    launch = _launch("scan", C, V, N, chunk_size, q.device)
    block_c, block_v = min(launch["BLOCK_C"], 32), launch["BLOCK_V"]
    tiles = cdiv(C, block_c) * cdiv(V, block_v)
    _scan_kernel[(tiles, H, G)](sums, states, decay, chunk_first, init.contiguous() if init is not None else last,
                                last, NC, H, C, V, P, init is not None, query, block_c, block_v,
                                num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    return states, last


def _token_grads(q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared, part, pos,
                 row_grads, row_topk, decay_normalizer, strides):
    """The row gradients summed back to the token inputs, through the softmaxes (and the decay logits' logsigmoid)
    (expand.py's backward)."""
    H, C = q.shape[-2:]
    (L, J), V, N = part.shape, v.shape[-1], router_logits.shape[-1]
    shared = q_shared is not None
    # contiguous gradients, whatever the inputs' token strides
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k_logits, v))
    dg, de = torch.empty_like(log_decay), torch.empty_like(router_logits)
    dqs, dks = (torch.empty_like(q_shared), torch.empty_like(k_shared_logits)) if shared else (None, None)
    shared_decay = log_decay_shared is not None
    dgs = torch.empty_like(log_decay_shared) if shared_decay else None
    if L:
        _expand_bwd_kernel[(L,)](q, k_logits, router_logits, q_shared if shared else q,
                                 k_shared_logits if shared else k_logits, log_decay,
                                 log_decay_shared if shared_decay else log_decay, part, pos, *row_grads, dq, dk,
                                 dv, dg, de, dqs if shared else dq, dks if shared else dk, dgs if shared_decay else dg,
                                 decay_normalizer or 1.0, H, C, V, N, strides[0], strides[1], J, shared,
                                 row_topk or 0, decay_normalizer is not None, shared_decay, **_blocks(H, C, V, N),
                                 num_warps=_warps(H, C))
    return dq, dk, dv, dg, de, dqs, dks, dgs


def index_tables(router_logits, bounds, top_k, shared, chunk_size):
    """Routing and the chunk index (`route_varlen`, three launches): (row_token [R], group bounds [G + 1], first
    chunk of each group [G + 1], group of each chunk slot [NC] (G past the last chunk), part and pos
    [L, K + shared], S, P)."""
    routing = route_varlen(router_logits, bounds, top_k, shared, chunk_size)
    return (routing.row_token, routing.cu, routing.chunk_first, routing.chunk_group, routing.part, routing.pos,
            bounds.numel() - 1, router_logits.shape[-1] + shared)


@functools.lru_cache(maxsize=64)
def _batch_bounds(B: int, T: int, device: torch.device) -> torch.Tensor:
    """Segment bounds of B unpadded rows of T tokens, made once per shape (two torch ops a call otherwise); read
    only."""
    return torch.arange(B + 1, device=device) * T


def sse_triton_indexed(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                       row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                       decay_normalizer=None, replay=None, log_decay_shared=None, route_index=None,
                       chunk_size=CHUNK):
    """`kernels.sse_attention` on the indexed chunk kernels; with `decay_normalizer`, log_decay (and
    log_decay_shared, the shared partition's own) holds the decay logits, with `replay` (a
    `kernels.CheckpointReplay`) a checkpoint's recomputation takes the first forward's tables and output (see
    there), and with `route_index` [B, T, K] the tables route to those partitions (the kernels still weigh them by
    the softmax of `router_logits`)."""
    B, T, H, c = q.shape
    scale = c**-0.5 if scale is None else scale
    # A caller that wants the final state gets it computed.
    slot = None if output_final_state or replay is None else replay.slot(B * T * H * v.shape[-1] * v.element_size())
    if slot is not None and slot.kept is not None:
        tables, o = slot.kept
    else:
        bounds = _batch_bounds(B, T, q.device) if cu_seqlens is None else cu_seqlens
        chosen = router_logits if route_index is None else selection_scores(route_index, router_logits.shape[-1])
        tables = index_tables(chosen, bounds, top_k, q_shared is not None, chunk_size)
    replayed = None if slot is None else (o,) if slot.kept is not None else ()
    o, final = _IndexedChunk.apply(q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits,
                                   log_decay_shared, initial_state, tables, scale, row_topk, chunk_size,
                                   decay_normalizer, output_final_state, replayed)
    if slot is not None and slot.kept is None:
        slot.keep(tables, o.detach())
    return o, (final if output_final_state else None)
