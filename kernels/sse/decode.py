"""One decode step for a batch of sequences whose states live in rows `slot_ids` of a state cache.

Torch twin of the fused Triton decode kernel (same signature); it serves the CPU and is the kernel's check.
Only the K selected partitions and the shared one are read and written.

A state cache holds float32, bfloat16 or int16 states. int16 is 16-bit fixed point: a state [c, d_v] is stored as
[c + SCALE_ROWS, d_v], the values round(S / s) with one float32 scale s per column, then two float32 rows: the d_v
scales, and each column's largest |S| when it was stored (so one tensor, copied and zeroed whole, holds a state; a
zeroed state is zero). It moves half of float32's bytes, like bfloat16, but its error is set by the column's
largest value rather than by each value's own exponent: an update as small as a part in 32,767 of that value still
counts, where bfloat16 loses every update below half its value's last bit (a part in 512), which is what a decay
close to 1 asks for (docs/vllm-backend.md on the state dtypes' drift).

The scale: a whole state written at once (`states_to_cache`) gets s = its column's largest |S| / FIXED_MAX. A
decode step gets s = bound / FIXED_MAX from a bound on the updated column known before the state is read:
    |decay_c S[c, d] + key_c v_d| <= max_c decay_c * (largest |S[:, d]| stored + s_d / 2) + max_c |key_c| * |v_d|
(half a step s_d: a stored value may have been rounded up past the largest |S|), so the kernel can round and store
each value as soon as it is updated, instead of holding the whole updated tile in registers until its columns'
largest values are reduced (`python -m bench.op --sections decode` times the step), and need not clamp it. The
bound is loose by how far the largest decay and key overstate the column's: over 4k steps the outputs drift 2.2e-4 /
5.4e-4 from float64 (typical / long-memory gates) against 1.7e-4 / 4.8e-4 with exact scales.
"""
import torch

from kernels.sse.routing import log_decay_from_logits, route_read_write, softmax_keys

FIXED_MAX = 32767   # the int16 value a column's bound (or largest |S|) is stored as
SCALE_ROWS = 4      # two float32 per column (scale, largest |S|) = four int16 rows
ZERO_BELOW = 1e-30  # a column whose bound is below this is stored as zeros (its 1 / scale would overflow)


def cache_rows(c: int, dtype: torch.dtype) -> int:
    """Rows of one stored [c, d_v] state in a cache of `dtype`."""
    return c + SCALE_ROWS if dtype == torch.int16 else c


def _column_floats(cached: torch.Tensor, i: int) -> torch.Tensor:
    """The i-th float32 row [..., 1, d_v] (0: scales, 1: largest |S|) of int16 cache rows [..., c + 4, d_v]."""
    first = cached.shape[-2] - SCALE_ROWS + 2 * i
    rows = cached[..., first:first + 2, :]
    return rows.contiguous().view(torch.float32).reshape(*rows.shape[:-2], 1, -1)


def states_from_cache(cached: torch.Tensor) -> torch.Tensor:
    """States [..., c, d_v] in float32 at least (float64 stays) from cache rows [..., cache_rows(c), d_v]."""
    if cached.dtype != torch.int16:
        return cached.to(torch.promote_types(cached.dtype, torch.float32))
    return cached[..., :-SCALE_ROWS, :].float() * _column_floats(cached, 0)


def states_to_cache(states: torch.Tensor, dtype: torch.dtype, bound: torch.Tensor | None = None) -> torch.Tensor:
    """Cache rows [..., cache_rows(c, dtype), d_v] of `dtype` holding states [..., c, d_v] (rounded once). int16
    states are scaled by `bound` [..., 1, d_v] when given (a decode step's, see above; values past it are clamped),
    else by each column's largest |S|. The Triton decode kernel stores them with the same arithmetic."""
    if dtype != torch.int16:
        return states.to(dtype)
    states = states.float()
    top = states.abs().amax(-2, keepdim=True)                                   # [..., 1, d_v]
    bound = top if bound is None else bound.float()
    x = states * (FIXED_MAX / torch.where(bound > ZERO_BELOW, bound, torch.ones_like(bound)))
    values = x.round().clamp(-FIXED_MAX, FIXED_MAX).to(torch.int16)           # ties to even
    floats = torch.cat([bound / FIXED_MAX, top], -2).contiguous()             # [..., 2, d_v]
    return torch.cat([values, floats.view(torch.int16).reshape(*top.shape[:-2], SCALE_ROWS, -1)], -2)


def read_states_torch(cache: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor | None = None) -> torch.Tensor:
    """The states [S, ..., c, d_v] of rows `slots` of a state cache, in float32 at least (`states_from_cache`);
    zeros where `has_state` [S] is False (their slots are not read: a request that starts from nothing)."""
    states = states_from_cache(cache[slots])
    return states if has_state is None else torch.where(has_state.view(-1, *[1] * (states.dim() - 1)), states, 0)


def write_states_torch(cache: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Store states [S, ..., c, d_v] into rows `slots` of a state cache, rounded once to its dtype
    (`states_to_cache`: int16 columns scaled by their largest |S|)."""
    cache[slots] = states_to_cache(states, cache.dtype)


def sse_decode_torch(state, slot_ids, q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None,
                     k_shared_logits=None, row_topk=None, scale=None, out=None, decay_normalizer=None,
                     shared_lora=False, log_decay_shared=None, read_top_k=None):
    """state [num_slots, H, N + shared, c, d_v] (float32, float64, bfloat16, or int16 with [c + 4, d_v] per state:
    `states_to_cache`; updated in place); q, k_logits, log_decay, q_shared, k_shared_logits [B, H, c];
    v [B, H, d_v]; router_logits [B, N]; slot_ids [B] (-1 = skip). Returns o [B, H, d_v] in v's dtype (zeros for
    skipped rows), copied into `out` when given. The step is computed in float32 at least (float64 for a float64
    state); a bfloat16 or int16 state is rounded once, when it is written back, as the Triton kernel does (the
    output is computed from the unrounded update). With `decay_normalizer`, `log_decay` holds the decay logits x and
    the step uses log a = logsigmoid(x) / decay_normalizer (the Triton kernel fuses it: no extra kernels per layer in
    vLLM). With `shared_lora`, q_shared and k_shared_logits are the low-rank terms of the shared partition's q and key
    logits, which are q + q_shared and k_logits + k_shared_logits added in the inputs' dtype, as the models add
    them (the Triton kernel adds them itself: vLLM passes the up-projection's output as it is).
    `log_decay_shared` [B, H, c]: the shared partition's own log-decay (decay logits with `decay_normalizer`),
    else it decays as the routed ones; `read_top_k`: partitions read when they differ from the `top_k` written
    (`kernels.sse_attention`); a partition only read is not written back."""
    if shared_lora and q_shared is not None:
        q_shared, k_shared_logits = q + q_shared, k_logits + k_shared_logits
    if decay_normalizer is not None:
        log_decay, log_decay_shared = (
            None if x is None else log_decay_from_logits(x.to(torch.promote_types(state.dtype, x.dtype)),
                                                         decay_normalizer)
            for x in (log_decay, log_decay_shared))
    if out is not None:
        return out.copy_(sse_decode_torch(state, slot_ids, q, k_logits, v, log_decay, router_logits, top_k=top_k,
                                          q_shared=q_shared, k_shared_logits=k_shared_logits, row_topk=row_topk,
                                          scale=scale, log_decay_shared=log_decay_shared, read_top_k=read_top_k))
    B, H, c = q.shape
    N = router_logits.shape[-1]
    scale = c**-0.5 if scale is None else scale
    compute = torch.float32 if state.dtype == torch.int16 else torch.promote_types(state.dtype, torch.float32)
    o = torch.zeros(B, H, v.shape[-1], dtype=compute, device=state.device)
    live = slot_ids >= 0
    if not bool(live.all()):
        rows = live.nonzero().squeeze(1)

        def pick(x):
            return None if x is None else x[rows]

        o[rows] = sse_decode_torch(state, slot_ids[rows], *map(pick, (q, k_logits, v, log_decay, router_logits)),
                                   top_k=top_k, q_shared=pick(q_shared), k_shared_logits=pick(k_shared_logits),
                                   row_topk=row_topk, scale=scale, log_decay_shared=pick(log_decay_shared),
                                   read_top_k=read_top_k).to(o.dtype)
        return o.to(v.dtype)

    def f(x):
        return x.to(compute)

    _, index, topk_weight, writes, reads = route_read_write(router_logits, top_k, read_top_k)  # [B, J]
    keys, decay = softmax_keys(f(k_logits), f(log_decay), row_topk)
    parts, w = index, f(topk_weight)[..., None, None]              # gathered partitions and their weights
    written = writes.expand_as(index)
    q_rows, k_rows = [f(q)[:, None] * (w * reads[:, None, None])], [keys[:, None] * (w * writes[:, None, None])]
    g_rows = [decay[:, None] * writes[:, None, None]]
    if q_shared is not None:
        keys_s, decay_s = softmax_keys(f(k_shared_logits), f(log_decay if log_decay_shared is None else
                                                            log_decay_shared), row_topk)
        parts = torch.cat([index, torch.full_like(index[:, :1], N)], 1)
        written = torch.cat([written, written[:, :1].new_ones(B, 1)], 1)
        q_rows.append(f(q_shared)[:, None]), k_rows.append(keys_s[:, None]), g_rows.append(decay_s[:, None])
    qq, kk, gg = torch.cat(q_rows, 1), torch.cat(k_rows, 1), torch.cat(g_rows, 1)   # [B, P_sel, H, c]
    slots = slot_ids[:, None].expand_as(parts)
    cached = state[slots, :, parts]                                 # [B, P_sel, H, rows, d_v]
    S = f(states_from_cache(cached))                                # [B, P_sel, H, c, d_v]
    decay, vv = gg.exp(), f(v)[:, None, :, None, :]                 # vv [B, 1, H, 1, d_v]
    bound = None
    if state.dtype == torch.int16:  # the decode step's scale bound (module docstring), as the kernel computes it
        bound = (decay.amax(-1)[..., None, None] * (_column_floats(cached, 1) + 0.5 * _column_floats(cached, 0))
                 + kk.abs().amax(-1)[..., None, None] * vv.abs())
    S = decay[..., None] * S + kk[..., None] * vv
    if read_top_k is None or read_top_k <= top_k:  # every row written
        state[slots, :, parts] = states_to_cache(S, state.dtype, bound)
    else:  # partitions only read keep their stored state (an int16 one would be rounded again)
        state[slots[written], :, parts[written]] = states_to_cache(S[written], state.dtype,
                                                                   None if bound is None else bound[written])
    o = scale * torch.einsum("bphc,bphcv->bhv", qq, S)
    return o.to(v.dtype)
