"""Routing: top-K partitions per token and the counting sort that groups rows by (segment, partition).

The varlen layout needs every (token, selected partition) row placed so that the rows of each (segment,
partition) group are contiguous and in time order, shared partition (index N) last in each segment. Segments
are contiguous in time, so with C(t)[n] = number of tokens before t that selected n (a prefix count):

    row of (t, n) = first row of group (seg(t), n) + C(t)[n] - C(start of seg(t))[n]

Three launches, each parallel over tokens or segments, no host synchronisation and no torch op between them (each
op or launch is host work, and a training step routes every SSE layer, twice with checkpointing; the tables are two
allocations, `carve`):
1. `_route_kernel`, per block of tokens: top-K partitions and the block's histogram over partitions.
2. `_segment_kernel`, per segment: group sizes from C at the segment's two ends -> the new cu_seqlens and the
   per-group base `first row - C(start)`; and the segment of each of its tokens. Empty groups just get an empty
   range: no work is launched for them.
3. `_position_kernel`, per block of tokens: C(t) from an in-block cumsum, then each row's position, partition and
   the inverse map (row -> token); with a chunk size (the indexed chunk kernels'), further programs of the same
   launch index the groups' chunks (`_chunk_index`), which needs only the new cu_seqlens.
C at a block's start is the sum of the histograms of the blocks before it, summed where it is needed.
`pos` [L, K + shared] (row of each token's j-th selection) is a bijection onto the rows, so it is both the
reorder index (the gather writes row pos[t, j]) and the inverse map (the scatter back reads it).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton.common import carve, cdiv, pow2, top1

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


@triton.jit
def _chunk_index(pid, cu_ptr, chunk_first_ptr, chunk_group_ptr, G, num_slots, CHUNK_ROWS: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr):
    """chunk_first [G + 1]: chunks of the groups before each group (program 0 stores it); chunk_group: the group
    of each of this program's chunk slots (G past the last chunk), i.e. how many groups end at or before it."""
    slot = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    group = tl.zeros([BLOCK_S], tl.int32)
    done = tl.sum(tl.zeros([BLOCK_G], tl.int64), 0)  # chunks of the groups before this tile
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        size = tl.load(cu_ptr + g + 1, mask=g < G, other=0) - tl.load(cu_ptr + g, mask=g < G, other=0)
        chunks = (size + CHUNK_ROWS - 1) // CHUNK_ROWS
        ends = done + tl.cumsum(chunks, 0)
        if pid == 0:
            tl.store(chunk_first_ptr + g + 1, ends, mask=g < G)
        group += tl.sum(((ends[None, :] <= slot[:, None]) & (g[None, :] < G)).to(tl.int32), 1)
        done += tl.sum(chunks, 0)
    if pid == 0:
        tl.store(chunk_first_ptr, 0)
    tl.store(chunk_group_ptr + slot, group, mask=slot < num_slots)


@triton.jit(do_not_specialize=["L", "token_blocks", "G", "num_slots"])
def _position_kernel(idx_ptr, hist_ptr, seg_ptr, base_ptr, pos_ptr, part_ptr, row_token_ptr, cu_ptr, chunk_first_ptr,
                     chunk_group_ptr, L, N, token_blocks, G, num_slots, K: tl.constexpr, SHARED: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Programs [0, token_blocks): positions of a block of tokens' rows; the rest: the chunk index (`_chunk_index`,
    BLOCK_S slots each), launched with them to save the host a launch."""
    blk = tl.program_id(0)
    if blk >= token_blocks:
        _chunk_index(blk - token_blocks, cu_ptr, chunk_first_ptr, chunk_group_ptr, G, num_slots, CHUNK_ROWS, BLOCK_S,
                     128)
        return
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


def route_topk(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-K partitions [L, K] (int32, descending logits) of router logits [L, N]."""
    L, N = router_logits.shape
    blocks = cdiv(L, BLOCK_T)
    idx, hist = carve([L * top_k, blocks * pow2(N)], torch.int32, router_logits.device)
    idx = idx.view(L, top_k)
    if L:
        _route_kernel[(blocks,)](router_logits.contiguous(), idx, hist, L, N, top_k, BLOCK_T, pow2(N))
    return idx


class Routing(NamedTuple):
    """The varlen layout of L tokens with J = K + shared rows each (`route_varlen`)."""
    idx: torch.Tensor        # [L, K] int32: top-K partitions, descending logits
    pos: torch.Tensor        # [L, J] int32: row of each (token, selection), the shared row last
    cu: torch.Tensor         # [S * (N + shared) + 1] int64: bounds of the (segment, partition) groups
    part: torch.Tensor       # [L, J] int32: partition of each (token, selection), N for the shared one
    row_token: torch.Tensor  # [L * J] int32: token of each row (pos's inverse)
    # with a chunk size: the first chunk of each group [G + 1] int64 (G = len(cu) - 1), and the group of each of
    # the cdiv(L * J, chunk size) + G chunk slots [NC] int32 (G past the last chunk); else None
    chunk_first: torch.Tensor | None
    chunk_group: torch.Tensor | None


def route_varlen(router_logits: torch.Tensor, bounds: torch.Tensor, top_k: int, shared: bool,
                 chunk_size: int | None = None) -> Routing:
    """Routing for the varlen layout: router_logits [..., N] (L tokens); bounds [S + 1] token offsets of the S
    segments (cu_seqlens). The groups of `cu` are segment-major, shared partition last in each segment. With
    `chunk_size`, also the groups' chunks of that many rows (`Routing`); their number of slots is an upper bound
    known on the host, so nothing waits for the device."""
    N = router_logits.shape[-1]
    L = router_logits.numel() // N
    S, P, J = bounds.numel() - 1, N + shared, top_k + shared
    G, device, block_n, blocks = S * P, router_logits.device, pow2(N), cdiv(L, BLOCK_T)
    num_slots = cdiv(L * J, chunk_size) + G if chunk_size else 0
    idx, hist, seg, pos, part, row_token, chunk_group = carve(
        [L * top_k, blocks * block_n, L, L * J, L * J, L * J, num_slots], torch.int32, device)
    cu, base, chunk_first = carve([G + 1, G, G + 1 if chunk_size else 0], torch.int64, device)
    idx, pos, part = idx.view(L, top_k), pos.view(L, J), part.view(L, J)
    if L:
        _route_kernel[(blocks,)](router_logits.contiguous(), idx, hist, L, N, top_k, BLOCK_T, block_n)
    bounds = bounds.to(device=device, dtype=torch.int64).contiguous()
    _segment_kernel[(S,)](bounds, idx, hist, cu, base, seg, S, N, top_k, shared, BLOCK_T, block_n)
    block_s = 128  # chunk slots per program
    grid = blocks + (cdiv(num_slots, block_s) if chunk_size else 0)
    if grid:
        _position_kernel[(grid,)](idx, hist, seg, base, pos, part, row_token, cu, chunk_first, chunk_group, L, N,
                                  blocks, G, num_slots, top_k, shared, BLOCK_T, block_n, chunk_size or 1, block_s)
    return Routing(idx, pos, cu, part, row_token, chunk_first if chunk_size else None,
                   chunk_group if chunk_size else None)
