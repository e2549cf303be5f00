"""Routing: top-K partitions per token and the counting sort that groups rows by (segment, partition).

The varlen layout needs every (token, selected partition) row placed so that the rows of each (segment,
partition) group are contiguous and in time order, shared partition (index N) last in each segment. Segments
are contiguous in time, so with C(t)[n] = number of tokens before t that selected n (a prefix count):

    row of (t, n) = first row of group (seg(t), n) + C(t)[n] - C(start of seg(t))[n]

Three launches, each parallel over tokens or segments, no host synchronisation and no torch op between them (each
op or launch costs the host 5-40 us, and a training step routes every SSE layer, twice with checkpointing):
1. `_route_kernel`, per block of tokens: top-K partitions and the block's histogram over partitions.
2. `_segment_kernel`, per segment: group sizes from C at the segment's two ends -> the new cu_seqlens and the
   per-group base `first row - C(start)`; and the segment of each of its tokens. Empty groups just get an empty
   range: no work is launched for them.
3. `_position_kernel`, per block of tokens: C(t) from an in-block cumsum, then each row's position, partition and
   the inverse map (row -> token).
C at a block's start is the sum of the histograms of the blocks before it, summed where it is needed.
`pos` [L, K + shared] (row of each token's j-th selection) is a bijection onto the rows, so it is both the
reorder index (the gather writes row pos[t, j]) and the inverse map (the scatter back reads it).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton.common import pow2, top1

BLOCK_T = 256  # tokens per program in the token-parallel kernels
HIST_BLOCKS = tl.constexpr(64)  # token blocks' histograms summed per step


@triton.jit(do_not_specialize=["L"])
def _route_kernel(logits_ptr, idx_ptr, hist_ptr, L, N, K: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    blk = tl.program_id(0)
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    n = tl.arange(0, BLOCK_N)[None, :]
    live = t < L
    scores = tl.load(logits_ptr + t * N + n, mask=live & (n < N), other=float("-inf")).to(tl.float32)
    hits = tl.zeros([BLOCK_T, BLOCK_N], tl.int32)
    for k in tl.static_range(K):
        index, scores = top1(scores, n, BLOCK_N)
        tl.store(idx_ptr + t * K + k, index, mask=live)
        hits += (n == index).to(tl.int32)
    hits = tl.where(live, hits, 0)
    tl.store(hist_ptr + blk * BLOCK_N + tl.arange(0, BLOCK_N), tl.sum(hits, 0))


@triton.jit
def _count_before(idx_ptr, hist_ptr, t0, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """C(t0)[n]: tokens before t0 that selected n = those of the blocks before t0's block + those of its block."""
    blk = t0 // BLOCK_T
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    n = tl.arange(0, BLOCK_N)[None, :]
    hits = tl.zeros([BLOCK_T, BLOCK_N], tl.int32)
    for k in tl.static_range(K):
        index = tl.load(idx_ptr + t * K + k, mask=t < t0, other=-1)
        hits += (index == n).to(tl.int32)
    return _blocks_before(hist_ptr, blk, BLOCK_N) + tl.sum(hits, 0)


@triton.jit
def _blocks_before(hist_ptr, blk, BLOCK_N: tl.constexpr):
    """C at the start of token block `blk`: the histograms of the blocks before it, summed."""
    n = tl.arange(0, BLOCK_N)[None, :]
    total = tl.zeros([BLOCK_N], tl.int32)
    for b0 in range(0, blk, HIST_BLOCKS):
        b = b0 + tl.arange(0, HIST_BLOCKS)[:, None]
        total += tl.sum(tl.load(hist_ptr + b * BLOCK_N + n, mask=b < blk, other=0), 0)
    return total


@triton.jit(do_not_specialize=["num_segments"])
def _segment_kernel(bounds_ptr, idx_ptr, hist_ptr, cu_ptr, base_ptr, seg_ptr, num_segments, N, K: tl.constexpr,
                    SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    s = tl.program_id(0)
    start = tl.load(bounds_ptr + s)
    end = tl.load(bounds_ptr + s + 1)
    before = _count_before(idx_ptr, hist_ptr, start, K, BLOCK_T, BLOCK_N)
    size = _count_before(idx_ptr, hist_ptr, end, K, BLOCK_T, BLOCK_N) - before
    n = tl.arange(0, BLOCK_N)
    P = N + SHARED
    first = start * (K + SHARED) + tl.cumsum(size, 0) - size  # segment s owns rows [start, end) * (K + shared)
    tl.store(cu_ptr + s * P + n, first, mask=n < N)
    tl.store(base_ptr + s * P + n, first - before, mask=n < N)
    if SHARED:  # one shared row per token, after the segment's routed rows
        shared_first = start * (K + 1) + (end - start) * K
        tl.store(cu_ptr + s * P + N, shared_first)
        tl.store(base_ptr + s * P + N, shared_first - start)
    if s == num_segments - 1:
        tl.store(cu_ptr + num_segments * P, end * (K + SHARED))
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tl.store(seg_ptr + t, s, mask=t < end)


@triton.jit(do_not_specialize=["L"])
def _position_kernel(idx_ptr, hist_ptr, seg_ptr, base_ptr, pos_ptr, part_ptr, row_token_ptr, L, N,
                     K: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    blk = tl.program_id(0)
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.arange(0, BLOCK_N)[None, :]
    live = t < L
    hits = tl.zeros([BLOCK_T, BLOCK_N], tl.int32)
    for k in tl.static_range(K):
        index = tl.load(idx_ptr + t * K + k, mask=live, other=-1)
        hits += (index[:, None] == n).to(tl.int32)
    before = _blocks_before(hist_ptr, blk, BLOCK_N)[None, :] + tl.cumsum(hits, 0) - hits  # C(t), every token
    group = tl.load(seg_ptr + t, mask=live, other=0) * (N + SHARED)
    J = K + SHARED
    for k in tl.static_range(K):
        index = tl.load(idx_ptr + t * K + k, mask=live, other=0)
        rank = tl.sum(tl.where(index[:, None] == n, before, 0), 1)
        row = tl.load(base_ptr + group + index, mask=live) + rank
        tl.store(pos_ptr + t * J + k, row, mask=live)
        tl.store(part_ptr + t * J + k, index, mask=live)
        tl.store(row_token_ptr + row, t, mask=live)
    if SHARED:
        row = tl.load(base_ptr + group + N, mask=live) + t
        tl.store(pos_ptr + t * J + K, row, mask=live)
        tl.store(part_ptr + t * J + K, tl.zeros([BLOCK_T], tl.int32) + N, mask=live)
        tl.store(row_token_ptr + row, t, mask=live)


def _topk(router_logits: torch.Tensor, top_k: int):
    L, N = router_logits.shape
    block_n = pow2(N)
    blocks = triton.cdiv(L, BLOCK_T)
    idx = torch.empty(L, top_k, dtype=torch.int32, device=router_logits.device)
    hist = torch.empty(blocks, block_n, dtype=torch.int32, device=router_logits.device)
    if L:
        _route_kernel[(blocks,)](router_logits.contiguous(), idx, hist, L, N, top_k, BLOCK_T, block_n)
    return idx, hist


def route_topk(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-K partitions [L, K] (int32, descending logits) of router logits [L, N]."""
    return _topk(router_logits, top_k)[0]


class Routing(NamedTuple):
    """The varlen layout of L tokens with J = K + shared rows each (`route_varlen`)."""
    idx: torch.Tensor        # [L, K] int32: top-K partitions, descending logits
    pos: torch.Tensor        # [L, J] int32: row of each (token, selection), the shared row last
    cu: torch.Tensor         # [S * (N + shared) + 1] int64: bounds of the (segment, partition) groups
    part: torch.Tensor       # [L, J] int32: partition of each (token, selection), N for the shared one
    row_token: torch.Tensor  # [L * J] int32: token of each row (pos's inverse)


def route_varlen(router_logits: torch.Tensor, bounds: torch.Tensor, top_k: int, shared: bool) -> Routing:
    """Routing for the varlen layout: router_logits [L, N]; bounds [S + 1] token offsets of the S segments
    (cu_seqlens). The groups of `cu` are segment-major, shared partition last in each segment."""
    L, N = router_logits.shape
    S, P, J = bounds.numel() - 1, N + shared, top_k + shared
    device = router_logits.device
    idx, hist = _topk(router_logits, top_k)
    block_n = hist.shape[1]
    bounds = bounds.to(device=device, dtype=torch.int64).contiguous()
    cu = torch.empty(S * P + 1, dtype=torch.int64, device=device)
    base = torch.empty(S, P, dtype=torch.int64, device=device)
    seg = torch.empty(L, dtype=torch.int32, device=device)
    pos, part = (torch.empty(L, J, dtype=torch.int32, device=device) for _ in range(2))
    row_token = torch.empty(L * J, dtype=torch.int32, device=device)
    _segment_kernel[(S,)](bounds, idx, hist, cu, base, seg, S, N, top_k, shared, BLOCK_T, block_n)
    if L:
        _position_kernel[(triton.cdiv(L, BLOCK_T),)](idx, hist, seg, base, pos, part, row_token, L, N, top_k,
                                                     shared, BLOCK_T, block_n)
    return Routing(idx, pos, cu, part, row_token)
