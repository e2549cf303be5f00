"""One decode step for a batch of sequences whose states live in rows `slot_ids` of a state cache.

Torch twin of the fused Triton decode kernel (same signature); it serves the CPU and is the kernel's check.
Only the K selected partitions and the shared one are read and written.
"""
import torch

from kernels.sse.routing import log_decay_from_logits, route, softmax_keys


def sse_decode_torch(state, slot_ids, q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None,
                     k_shared_logits=None, row_topk=None, scale=None, out=None, decay_normalizer=None,
                     shared_lora=False):
    """state [num_slots, H, N + shared, c, d_v] (float32, float64, or bfloat16, updated in place); q, k_logits,
    log_decay, q_shared, k_shared_logits [B, H, c]; v [B, H, d_v]; router_logits [B, N]; slot_ids [B] (-1 = skip).
    Returns o [B, H, d_v] in v's dtype (zeros for skipped rows), copied into `out` when given. The step is computed
    in float32 at least (float64 for a float64 state); a bfloat16 state is rounded once, when it is written back,
    as the Triton kernel does. With `decay_normalizer`, `log_decay` holds the decay logits x and the step uses
    log a = logsigmoid(x) / decay_normalizer (the Triton kernel fuses it: no extra kernels per layer in vLLM).
    With `shared_lora`, q_shared and k_shared_logits are the low-rank terms of the shared partition's q and key
    logits, which are q + q_shared and k_logits + k_shared_logits added in the inputs' dtype, as the models add
    them (the Triton kernel adds them itself: vLLM passes the up-projection's output as it is)."""
    if shared_lora and q_shared is not None:
        q_shared, k_shared_logits = q + q_shared, k_logits + k_shared_logits
    if decay_normalizer is not None:
        log_decay = log_decay_from_logits(log_decay.to(torch.promote_types(state.dtype, log_decay.dtype)),
                                          decay_normalizer)
    if out is not None:
        return out.copy_(sse_decode_torch(state, slot_ids, q, k_logits, v, log_decay, router_logits, top_k=top_k,
                                          q_shared=q_shared, k_shared_logits=k_shared_logits, row_topk=row_topk,
                                          scale=scale))
    B, H, c = q.shape
    N = router_logits.shape[-1]
    scale = c**-0.5 if scale is None else scale
    compute = torch.promote_types(state.dtype, torch.float32)
    o = torch.zeros(B, H, v.shape[-1], dtype=compute, device=state.device)
    live = slot_ids >= 0
    if not bool(live.all()):
        rows = live.nonzero().squeeze(1)

        def pick(x):
            return None if x is None else x[rows]

        o[rows] = sse_decode_torch(state, slot_ids[rows], *map(pick, (q, k_logits, v, log_decay, router_logits)),
                                   top_k=top_k, q_shared=pick(q_shared), k_shared_logits=pick(k_shared_logits),
                                   row_topk=row_topk, scale=scale).to(o.dtype)
        return o.to(v.dtype)

    def f(x):
        return x.to(compute)

    _, index, topk_weight = route(router_logits, top_k)            # [B, K]
    keys, decay = softmax_keys(f(k_logits), f(log_decay), row_topk)
    parts, w = index, f(topk_weight)                               # gathered partitions and their weights
    q_rows, k_rows = [f(q)[:, None] * w[..., None, None]], [keys[:, None] * w[..., None, None]]
    g_rows = [decay[:, None].expand(-1, top_k, -1, -1)]
    if q_shared is not None:
        keys_s, decay_s = softmax_keys(f(k_shared_logits), f(log_decay), row_topk)
        parts = torch.cat([index, torch.full_like(index[:, :1], N)], 1)
        q_rows.append(f(q_shared)[:, None]), k_rows.append(keys_s[:, None]), g_rows.append(decay_s[:, None])
    qq, kk, gg = torch.cat(q_rows, 1), torch.cat(k_rows, 1), torch.cat(g_rows, 1)   # [B, P_sel, H, c]
    slots = slot_ids[:, None].expand_as(parts)
    S = f(state[slots, :, parts])                                   # [B, P_sel, H, c, d_v]
    S = gg.exp()[..., None] * S + kk[..., None] * f(v)[:, None, :, None, :]
    state[slots, :, parts] = S.to(state.dtype)
    o = scale * torch.einsum("bphc,bphcv->bhv", qq, S)
    return o.to(v.dtype)
