"""A prefill's states between vLLM's state cache and the chunk kernels' float32 layout: one pass each way.

`read_states_triton(cache, slots, has_state)` returns the states of rows `slots` of a cache
[num_slots, H, P, rows, d_v] (float32, bfloat16 or int16 fixed point; any strides) as float32 [S, H, P, c, d_v], zero
where `has_state` is False; `write_states_triton(cache, slots, states)` stores float32 states [S, H, P, c, d_v] into
the cache, int16 columns scaled by their largest |S|. The torch twins (`kernels.sse.decode.read_states_torch`,
`write_states_torch`) give the same values. In torch, a write is a dozen elementwise passes over the group's
float32 states (largest |S|, the scale, round, clamp, the concatenated scale rows, the scatter) and a read a gather
and two more, a large share of a prefill's GPU time when many short prompts arrive together
(`python -m bench.rollouts`).
"""
import torch
import triton
import triton.language as tl

from kernels.sse import decode as twin
from kernels.triton.common import cdiv, pow2
from kernels.triton.decode import FIXED_MAX, ZERO_BELOW, check_state_cache, store_rounded


@triton.jit
def _state_tile(cache_ptr, slot_ptr, has_ptr, H, P, C, V, stride_slot, stride_head, stride_part, stride_row,
                stride_col, MASKED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's [BLOCK_C, BLOCK_V] tile of the columns of state (s, h, p), and where it lives: its offsets
    in the float32 [S, H, P, C, V] states, its pointers in the cache and its columns' scale pointers; then the
    tile's mask in the states, and the tile's and its columns' masks in the cache (empty where `has_ptr` says s
    has no past, with MASKED)."""
    pid, vb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    s, h, p = pid // (H * P), pid // P % H, pid % P
    live = 1
    if MASKED:
        live = tl.load(has_ptr + s).to(tl.int32)
    r = tl.arange(0, BLOCK_C)[:, None]
    d = vb * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    base = cache_ptr + tl.load(slot_ptr + s).to(tl.int64) * stride_slot + h * stride_head + p * stride_part
    scales = (base + C * stride_row).to(tl.pointer_type(tl.float32)) + d  # int16: after the C rows (twin's layout)
    mask, cache_mask = (r < C) & (d < V), (r < C * live) & (d < V * live)
    return pid * C * V + r * V + d, base + r * stride_row + d * stride_col, scales, mask, cache_mask, d < V * live


@triton.jit
def _read_kernel(cache_ptr, slot_ptr, has_ptr, out_ptr, H, P, C, V, stride_slot, stride_head, stride_part,
                 stride_row, stride_col, MASKED: tl.constexpr, FIXED: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    at, tile, scales, mask, load, load_columns = _state_tile(cache_ptr, slot_ptr, has_ptr, H, P, C, V, stride_slot,
                                                            stride_head, stride_part, stride_row, stride_col, MASKED,
                                                            BLOCK_C, BLOCK_V)
    S = tl.load(tile, mask=load, other=0).to(tl.float32)
    if FIXED:
        S = S * tl.load(scales, mask=load_columns, other=0.0)
    tl.store(out_ptr + at, S, mask=mask)


@triton.jit
def _write_kernel(states_ptr, slot_ptr, cache_ptr, H, P, C, V, stride_slot, stride_head, stride_part, stride_row,
                  stride_col, FIXED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    at, tile, scales, mask, _, columns = _state_tile(cache_ptr, slot_ptr, slot_ptr, H, P, C, V, stride_slot,
                                                     stride_head, stride_part, stride_row, stride_col, False, BLOCK_C,
                                                     BLOCK_V)
    S = tl.load(states_ptr + at, mask=mask, other=0.0)
    if FIXED:  # `states_to_cache`'s arithmetic; each column's C rows are in this tile
        top = tl.max(tl.abs(S), 0)[None, :]
        x = S * tl.div_rn(FIXED_MAX, tl.where(top > ZERO_BELOW, top, 1.0))
        store_rounded(tile, x, mask)
        tl.store(scales, tl.div_rn(top, FIXED_MAX), mask=columns)
        tl.store(scales + V, top, mask=columns)
    else:
        tl.store(tile, S.to(cache_ptr.dtype.element_ty), mask=mask)


def _launch(states_shape: tuple[int, ...]) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_C, BLOCK_V): one program per state and block of columns holding all c rows (an int16 column's
    scale is its largest |S|), 4,096 values a program."""
    S, H, P, C, V = states_shape
    block_c = pow2(C)
    block_v = min(pow2(V), max(1, 4096 // block_c))
    return (S * H * P, cdiv(V, block_v)), block_c, block_v


def read_states_triton(cache: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor | None = None) -> torch.Tensor:
    """float32 states [S, H, P, c, d_v] of rows `slots` [S] of `cache`, zero where `has_state` [S] is False."""
    num_slots, H, P, rows, V = cache.shape
    C = rows - (twin.SCALE_ROWS if cache.dtype == torch.int16 else 0)
    check_state_cache(cache, (H, P, C, V))
    out = torch.empty(len(slots), H, P, C, V, dtype=torch.float32, device=cache.device)
    grid, block_c, block_v = _launch(out.shape)
    if out.numel():
        masked = has_state is not None
        _read_kernel[grid](cache, slots.contiguous(), has_state.to(torch.int8) if masked else slots, out, H, P, C, V,
                           *cache.stride(), masked, cache.dtype == torch.int16, block_c, block_v)
    return out


def write_states_triton(cache: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Store states [S, H, P, c, d_v] into rows `slots` [S] (distinct) of `cache`, from float32 (the chunk paths'
    final states are float32; another dtype is converted first)."""
    S, H, P, C, V = states.shape
    check_state_cache(cache, (H, P, C, V))
    states = states.float()
    grid, block_c, block_v = _launch(states.shape)
    if states.numel():
        _write_kernel[grid](states.contiguous(), slots.contiguous(), cache, H, P, C, V, *cache.stride(),
                            cache.dtype == torch.int16, block_c, block_v)
