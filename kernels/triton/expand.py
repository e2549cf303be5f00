"""Gather and scatter around the GLA core: token inputs -> GLA rows, GLA output rows -> token outputs.

Every token t owns J rows of the GLA input, at rows pos[t, j], each for a partition part[t, j]:
  0 <= p < N  routed:  (w_p q, w_p softmax_keys(k_logits), v, log_decay masked to the kept key rows)
  p == N      shared:  (q_shared, softmax_keys(k_shared_logits), v, its log-decay masked likewise: the routed
              partitions' log_decay, or log_decay_shared where the layer gives the shared partition its own)
  p == -1     inactive (mask layout, unselected): (0, 0, v, 0) -- leaves its state and output untouched.
w = softmax(router_logits) over all N partitions. The varlen layout has J = K + shared rows per token, all
active, at positions from the counting sort; the mask layout has J = N + shared rows at t * J + j.

One program per token over all heads, so the router gradient (a sum over heads) needs no atomics, the token's
inputs are read once in the forward and once in the backward, and every GLA row is read or written once.
"""
import torch
import triton
import triton.language as tl

from kernels.triton.common import pow2, router_softmax, softmax_keys


@triton.jit
def _expand_fwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, e_ptr, qs_ptr, ks_ptr, gs_ptr, part_ptr, pos_ptr,
                       q_rows, k_rows, v_rows, g_rows, H, C, V, N, J: tl.constexpr, SHARED: tl.constexpr,
                       ROW_TOPK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_C)[None, :]
    d = tl.arange(0, BLOCK_V)[None, :]
    n = tl.arange(0, BLOCK_N)[None, :]
    in_c, in_v = (h < H) & (c < C), (h < H) & (d < V)
    hc, hv = t * H * C + h * C + c, t * H * V + h * V + d

    q = tl.load(q_ptr + hc, mask=in_c, other=0.0).to(tl.float32)
    keys, keep = softmax_keys(tl.load(k_ptr + hc, mask=in_c, other=0.0).to(tl.float32), c < C, ROW_TOPK, BLOCK_C)
    g = tl.load(g_ptr + hc, mask=in_c, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + hv, mask=in_v, other=0.0)
    w = router_softmax(tl.load(e_ptr + t * N + n, mask=n < N, other=0.0).to(tl.float32), n, N)
    if SHARED:
        q_s = tl.load(qs_ptr + hc, mask=in_c, other=0.0).to(tl.float32)
        keys_s, keep_s = softmax_keys(tl.load(ks_ptr + hc, mask=in_c, other=0.0).to(tl.float32), c < C,
                                      ROW_TOPK, BLOCK_C)
        g_s = tl.load(gs_ptr + hc, mask=in_c, other=0.0).to(tl.float32)
    for j in tl.static_range(J):
        p = tl.load(part_ptr + t * J + j)
        row = tl.load(pos_ptr + t * J + j).to(tl.int64)
        weight = tl.sum(tl.where((n == p) & (n < N), w, 0.0))  # 0 for inactive and shared rows
        q_row, k_row = weight * q, weight * keys
        g_row = tl.where(keep & (p >= 0), g, 0.0)
        if SHARED:
            is_shared = p == N
            q_row = tl.where(is_shared, q_s, q_row)
            k_row = tl.where(is_shared, keys_s, k_row)
            g_row = tl.where(is_shared, tl.where(keep_s, g_s, 0.0), g_row)
        rc = row * H * C + h * C + c
        tl.store(q_rows + rc, q_row.to(q_rows.dtype.element_ty), mask=in_c)
        tl.store(k_rows + rc, k_row.to(k_rows.dtype.element_ty), mask=in_c)
        tl.store(g_rows + rc, g_row, mask=in_c)
        tl.store(v_rows + row * H * V + h * V + d, v, mask=in_v)


@triton.jit
def _expand_bwd_kernel(q_ptr, k_ptr, e_ptr, qs_ptr, ks_ptr, x_ptr, xs_ptr, part_ptr, pos_ptr, dq_rows, dk_rows,
                       dv_rows, dg_rows, dq_ptr, dk_ptr, dv_ptr, dg_ptr, de_ptr, dqs_ptr, dks_ptr, dgs_ptr,
                       decay_normalizer, H, C, V, N, SQ, SK, J: tl.constexpr, SHARED: tl.constexpr,
                       ROW_TOPK: tl.constexpr, DECAY_LOGITS: tl.constexpr, SHARED_DECAY: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr):
    """The row gradients summed back to each token's inputs. With DECAY_LOGITS the log-decay came from decay logits
    x (log a = logsigmoid(x) / decay_normalizer, x at x_ptr), and dg is taken through that step. With SHARED_DECAY
    the shared rows' decay gradient goes to the shared partition's own log-decay (dgs_ptr; its logits at xs_ptr)
    instead of dg. The tokens of q and k_logits are SQ and SK apart; every other token tensor is contiguous."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_C)[None, :]
    d = tl.arange(0, BLOCK_V)[None, :]
    n = tl.arange(0, BLOCK_N)[None, :]
    in_c, in_v = (h < H) & (c < C), (h < H) & (d < V)
    hc, hv = t * H * C + h * C + c, t * H * V + h * V + d

    q = tl.load(q_ptr + t * SQ + h * C + c, mask=in_c, other=0.0).to(tl.float32)
    keys, keep = softmax_keys(tl.load(k_ptr + t * SK + h * C + c, mask=in_c, other=0.0).to(tl.float32), c < C,
                              ROW_TOPK, BLOCK_C)
    w = router_softmax(tl.load(e_ptr + t * N + n, mask=n < N, other=0.0).to(tl.float32), n, N)
    dq = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    dkeys = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    dg = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    dv = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    dw = tl.zeros([1, BLOCK_N], tl.float32)
    if SHARED:
        keys_s, keep_s = softmax_keys(tl.load(ks_ptr + hc, mask=in_c, other=0.0).to(tl.float32), c < C,
                                      ROW_TOPK, BLOCK_C)
        dq_s = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        dkeys_s = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        dg_s = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for j in tl.static_range(J):
        p = tl.load(part_ptr + t * J + j)
        row = tl.load(pos_ptr + t * J + j).to(tl.int64)
        rc = row * H * C + h * C + c
        d_q = tl.load(dq_rows + rc, mask=in_c, other=0.0).to(tl.float32)
        d_k = tl.load(dk_rows + rc, mask=in_c, other=0.0).to(tl.float32)
        d_g = tl.load(dg_rows + rc, mask=in_c, other=0.0).to(tl.float32)
        dv += tl.load(dv_rows + row * H * V + h * V + d, mask=in_v, other=0.0).to(tl.float32)
        routed = (n == p) & (n < N)
        weight = tl.sum(tl.where(routed, w, 0.0))  # 0 unless p is a routed partition
        dq += weight * d_q
        dkeys += weight * d_k
        dw += tl.where(routed, tl.sum(q * d_q + keys * d_k), 0.0)
        dg += tl.where(keep & (p >= 0) & (p < N), d_g, 0.0)
        if SHARED:
            is_shared = p == N
            dq_s += tl.where(is_shared, d_q, 0.0)
            dkeys_s += tl.where(is_shared, d_k, 0.0)
            dg_s += tl.where(is_shared & keep_s, d_g, 0.0)
    if SHARED and not SHARED_DECAY:
        dg += dg_s
    # Softmax backward: dx = y * (dy - sum(y * dy)); keys are 0 off the kept rows, so those get 0.
    tl.store(dk_ptr + hc, (keys * (dkeys - tl.sum(keys * dkeys, 1, keep_dims=True))).to(dk_ptr.dtype.element_ty),
             mask=in_c)
    tl.store(de_ptr + t * N + n, (w * (dw - tl.sum(w * dw, 1, keep_dims=True))).to(de_ptr.dtype.element_ty),
             mask=n < N)
    tl.store(dq_ptr + hc, dq.to(dq_ptr.dtype.element_ty), mask=in_c)
    if DECAY_LOGITS:
        dg *= tl.sigmoid(-tl.load(x_ptr + hc, mask=in_c, other=0.0).to(tl.float32)) / decay_normalizer
    tl.store(dg_ptr + hc, dg.to(dg_ptr.dtype.element_ty), mask=in_c)
    tl.store(dv_ptr + hv, dv.to(dv_ptr.dtype.element_ty), mask=in_v)
    if SHARED:
        tl.store(dqs_ptr + hc, dq_s.to(dqs_ptr.dtype.element_ty), mask=in_c)
        dz_s = keys_s * (dkeys_s - tl.sum(keys_s * dkeys_s, 1, keep_dims=True))
        tl.store(dks_ptr + hc, dz_s.to(dks_ptr.dtype.element_ty), mask=in_c)
        if SHARED_DECAY:
            if DECAY_LOGITS:
                dg_s *= tl.sigmoid(-tl.load(xs_ptr + hc, mask=in_c, other=0.0).to(tl.float32)) / decay_normalizer
            tl.store(dgs_ptr + hc, dg_s.to(dgs_ptr.dtype.element_ty), mask=in_c)


@triton.jit
def _collect_fwd_kernel(rows_ptr, pos_ptr, o_ptr, H, V, J: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_V: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hv = tl.arange(0, BLOCK_H)[:, None] * V + tl.arange(0, BLOCK_V)[None, :]
    mask = (tl.arange(0, BLOCK_H)[:, None] < H) & (tl.arange(0, BLOCK_V)[None, :] < V)
    o = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for j in tl.static_range(J):
        row = tl.load(pos_ptr + t * J + j).to(tl.int64)
        o += tl.load(rows_ptr + row * H * V + hv, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + t * H * V + hv, o, mask=mask)


@triton.jit
def _collect_bwd_kernel(do_ptr, pos_ptr, drows_ptr, H, V, J: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_V: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hv = tl.arange(0, BLOCK_H)[:, None] * V + tl.arange(0, BLOCK_V)[None, :]
    mask = (tl.arange(0, BLOCK_H)[:, None] < H) & (tl.arange(0, BLOCK_V)[None, :] < V)
    do = tl.load(do_ptr + t * H * V + hv, mask=mask)
    for j in tl.static_range(J):
        row = tl.load(pos_ptr + t * J + j).to(tl.int64)
        tl.store(drows_ptr + row * H * V + hv, do, mask=mask)


def _blocks(H, C, V, N):
    return dict(BLOCK_H=pow2(H), BLOCK_C=pow2(C), BLOCK_V=pow2(V), BLOCK_N=pow2(N))


def _warps(H, C):
    # Enough threads that the backward's dozen [H, C] float32 tiles stay in registers.
    return 8 if pow2(H) * pow2(C) >= 2048 else 4


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits, log_decay_shared, part, pos,
                num_rows, row_topk):
        L, H, C = q.shape
        V, N, J = v.shape[-1], router_logits.shape[-1], part.shape[1]
        shared = q_shared is not None

        def new(d, dtype):
            return torch.empty(num_rows, H, d, dtype=dtype, device=q.device)

        rows = new(C, q.dtype), new(C, q.dtype), new(V, v.dtype), new(C, torch.float32)
        if L:
            _expand_fwd_kernel[(L,)](q, k_logits, v, log_decay, router_logits, q_shared if shared else q,
                                     k_shared_logits if shared else k_logits,
                                     log_decay if log_decay_shared is None else log_decay_shared, part, pos, *rows,
                                     H, C, V, N, J,
                                     shared, row_topk or 0, **_blocks(H, C, V, N), num_warps=_warps(H, C))
        ctx.save_for_backward(q, k_logits, router_logits, q_shared, k_shared_logits, part, pos)
        ctx.shapes, ctx.row_topk, ctx.dtypes = (L, H, C, V, N, J), row_topk, (v.dtype, log_decay.dtype)
        ctx.shared_decay = log_decay_shared is not None
        return rows

    @staticmethod
    def backward(ctx, dq_rows, dk_rows, dv_rows, dg_rows):
        q, k_logits, router_logits, q_shared, k_shared_logits, part, pos = ctx.saved_tensors
        (L, H, C, V, N, J), (v_dtype, g_dtype) = ctx.shapes, ctx.dtypes
        shared = q_shared is not None
        # Gradients are written once, in the inputs' dtypes (the kernel accumulates in float32).
        dq, dk, de = torch.empty_like(q), torch.empty_like(k_logits), torch.empty_like(router_logits)
        dv = torch.empty(L, H, V, dtype=v_dtype, device=q.device)
        dg = torch.empty(L, H, C, dtype=g_dtype, device=q.device)
        dqs, dks = (torch.empty_like(q_shared), torch.empty_like(k_shared_logits)) if shared else (None, None)
        dgs = torch.empty_like(dg) if ctx.shared_decay else None
        if L:
            grads = [x.contiguous() for x in (dq_rows, dk_rows, dv_rows, dg_rows)]
            _expand_bwd_kernel[(L,)](q, k_logits, router_logits, q_shared if shared else q,
                                     k_shared_logits if shared else k_logits, dg, dg, part, pos, *grads, dq, dk, dv,
                                     dg, de, dqs if shared else dq, dks if shared else dk,
                                     dg if dgs is None else dgs, 1.0, H, C, V, N, H * C, H * C, J, shared,
                                     ctx.row_topk or 0, False, ctx.shared_decay, **_blocks(H, C, V, N),
                                     num_warps=_warps(H, C))
        return dq, dk, dv, dg, de, dqs, dks, dgs, None, None, None, None


class _Collect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, pos, out_dtype):
        R, H, V = rows.shape
        L, J = pos.shape
        o = torch.empty(L, H, V, dtype=out_dtype, device=rows.device)
        if L:
            _collect_fwd_kernel[(L,)](rows.contiguous(), pos, o, H, V, J, pow2(H), pow2(V))
        ctx.save_for_backward(pos)
        ctx.rows_shape, ctx.rows_dtype = rows.shape, rows.dtype
        return o

    @staticmethod
    def backward(ctx, do):
        (pos,) = ctx.saved_tensors
        R, H, V = ctx.rows_shape
        drows = torch.empty(R, H, V, dtype=ctx.rows_dtype, device=do.device)
        if pos.shape[0]:
            _collect_bwd_kernel[(pos.shape[0],)](do.contiguous(), pos, drows, H, V, pos.shape[1], pow2(H), pow2(V))
        return drows, None, None


def expand(q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits, part, pos, num_rows, row_topk,
           log_decay_shared=None):
    """GLA input rows (q, k, v, g) [num_rows, H, *] from token inputs [L, H, *] and router logits [L, N]; the shared
    rows' log-decay is `log_decay_shared` where given.

    part, pos [L, J] int32: partition (N = shared, -1 = inactive) and row of each of a token's J rows; every
    row must be covered exactly once. Differentiable in all float inputs.
    """
    def flat(x):
        return None if x is None else x.contiguous()

    return _Expand.apply(*map(flat, (q, k_logits, v, log_decay, router_logits, q_shared, k_shared_logits,
                                     log_decay_shared)),
                         part.contiguous(), pos.contiguous(), num_rows, row_topk)


def collect(rows, pos, out_dtype):
    """o[t] = sum over j of rows[pos[t, j]]: the token outputs [L, H, V] from GLA output rows [R, H, V]."""
    return _Collect.apply(rows, pos.contiguous(), out_dtype)
