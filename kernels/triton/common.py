"""Device functions every SSE Triton kernel shares, so routing, the training path and decode agree bit for bit
on router weights, top-K tie-breaking (lowest index wins, like a stable sort) and the row-sparse rule.

All of them take 2-D float32 register tiles [rows, columns] and reduce over the columns (axis 1).
"""
import functools
import math

import torch
import triton
import triton.language as tl


@functools.cache
def pow2(n: int) -> int:
    """triton.next_power_of_2(n) for the launches' block sizes, cached: the host asks for ~20 of them in an SSE
    layer's training forward, Triton's own is a `constexpr_function` from 3.9 on (a Python call chain each time),
    and the host's time bounds a short training step (`python -m bench.train_step`)."""
    return triton.next_power_of_2(n)


def cdiv(a: int, b: int) -> int:
    """triton.cdiv on the host without its cost: a `constexpr_function` from Triton 3.9 on, ten of them in an SSE
    layer's training forward."""
    return -(-a // b)


def carve(sizes: list[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """1-D tensors of `sizes` elements carved from one allocation: two torch ops however many tensors, where an
    SSE layer's forward would otherwise make ~20 `torch.empty` calls, each a trip through the caching allocator on
    the host. Each part starts
    16-byte aligned: Triton specialises a kernel on its pointers' alignment, and parts that were aligned or not as
    lengths change would compile other variants mid-run."""
    align = max(1, 16 // dtype.itemsize)
    sizes_and_pads = [m for n in sizes for m in (n, -n % align)]
    return list(torch.empty(sum(sizes_and_pads), dtype=dtype, device=device).split(sizes_and_pads)[::2])


def token_stride(x: torch.Tensor, token_dims: int = 2) -> int | None:
    """The stride s (in elements) at which x [*tokens, *values] holds its tokens, the tokens being x's first
    `token_dims` dimensions flattened, when each token's values are contiguous and the tokens do not overlap
    (token i's values at element i * s of x's data); None when x is not laid out so."""
    size = math.prod(x.shape[token_dims:])
    if x.is_contiguous():
        return size
    expect = 1
    for n, s in reversed(list(zip(x.shape[token_dims:], x.stride()[token_dims:]))):
        if n > 1 and s != expect:
            return None
        expect *= n
    stride = outer = None
    for n, s in reversed(list(zip(x.shape[:token_dims], x.stride()[:token_dims]))):
        if n == 1:
            continue
        if stride is None:
            stride = s
        elif s != outer:
            return None
        outer = s * n
    if stride is None:  # at most one token
        return size
    return stride if stride >= size else None


def token_rows(x: torch.Tensor, token_dims: int = 2) -> tuple[torch.Tensor, int]:
    """(x, its `token_stride`) as the kernels read it, copied to contiguous only where x has no token stride:
    column blocks of a wider tensor (the SSE layer's q, k, v and gate are blocks of one GEMM's output) are read in
    place."""
    stride = token_stride(x, token_dims)
    return (x, stride) if stride is not None else (x.contiguous(), math.prod(x.shape[token_dims:]))


@triton.jit
def router_softmax(logits, n, N):
    """Softmax of router logits [rows, BLOCK_N] over the N real partitions (`n` is the partition index)."""
    logits = tl.where(n < N, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 1, keep_dims=True))
    return p / tl.sum(p, 1, keep_dims=True)


@triton.jit
def top1(scores, n, BLOCK_N: tl.constexpr):
    """Index of the largest score along axis 1 (lowest index on ties), and scores with it removed,
    so calling it K times walks the top-K in order. A NaN counts as the largest score, as in torch.topk: the index
    is always a real column, so a token whose router logits went NaN updates (with NaN) states of its own instead of
    addressing partition BLOCK_N, past its state (no score would have equalled a NaN maximum)."""
    ranked = tl.where(scores != scores, float("inf"), scores)
    best = tl.max(ranked, 1, keep_dims=True)
    index = tl.min(tl.where(ranked == best, n, BLOCK_N), 1, keep_dims=True)
    return index, tl.where(n == index, float("-inf"), scores)


@triton.jit
def softmax_keys(z, valid, ROW_TOPK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Keys = softmax over the valid columns of key logits z [heads, BLOCK_C], and the mask of the state rows
    (columns here) they write.

    Row-sparse mode (ROW_TOPK > 0) keeps exactly ROW_TOPK columns: those above the ROW_TOPK-th largest value
    and, among the ones equal to it (ties are common in bf16), the lowest indices, like `top1`.
    """
    z = tl.where(valid, z, float("-inf"))
    keep = valid
    if ROW_TOPK > 0:
        ranked = tl.sort(z, 1, descending=True)
        col = tl.arange(0, BLOCK_C)[None, :]
        threshold = tl.sum(tl.where(col == ROW_TOPK - 1, ranked, 0.0), 1, keep_dims=True)
        above = z > threshold
        tied = (z == threshold).to(tl.int32)
        room = ROW_TOPK - tl.sum(above.to(tl.int32), 1, keep_dims=True)
        keep = valid & (above | ((tied > 0) & (tl.cumsum(tied, 1) <= room)))
        z = tl.where(keep, z, float("-inf"))
    p = tl.exp(z - tl.max(z, 1, keep_dims=True))
    return p / tl.sum(p, 1, keep_dims=True), keep


@triton.jit
def logsigmoid(x):
    """log sigmoid(x) = min(x, 0) - log(1 + e), e = exp(-|x|); the log's series where e is small keeps the
    relative accuracy of tiny log-decays (x >> 0), which log(1 + e) in float32 rounds away. x = +inf gives 0."""
    e = tl.exp(-tl.abs(x))
    return tl.minimum(x, 0.0) - tl.where(e < 1e-2, e * (1.0 - e * (0.5 - e / 3.0)), tl.log(1.0 + e))
