"""SSE through one chunked GLA call: the two training-path layouts (docs/model.md, "Equivalences").

Partition i's contribution is GLA on the tokens that selected i with inputs (w q, w k, v, log a), so both paths
only rearrange tensors around a GLA core passed in as `gla` (torch on CPU, a Triton kernel on GPU).
- varlen: rows regrouped by (segment, partition) in time order with new cu_seqlens; work ~ (K + 1) tokens.
- mask: every partition sees every token, unselected ones zeroed (q, k and log-decay); work ~ (N + 1) tokens,
  but plain dense tensors (paper Algorithm 1).
"""
import torch

from kernels.gla import chunk_gla_torch
from kernels.sse.routing import route, softmax_keys


def _segment_bounds(B, T, cu_seqlens, device):
    if cu_seqlens is None:
        return torch.arange(B + 1, device=device) * T
    if B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {B}")
    return cu_seqlens.to(device=device, dtype=torch.long)


def _prepare(q, k_logits, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk):
    weights, index, topk_weight = route(router_logits, top_k)
    keys, decay = softmax_keys(k_logits, log_decay, row_topk)
    shared = None
    if q_shared is not None:
        keys_s, decay_s = softmax_keys(k_shared_logits, log_decay, row_topk)
        shared = (q_shared.to(keys.dtype), keys_s, decay_s)
    return q.to(keys.dtype), keys, decay, weights, index, topk_weight, shared


def sse_chunk_varlen(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                     row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     gla=chunk_gla_torch):
    B, T, H, c = q.shape
    N, dv = router_logits.shape[-1], v.shape[-1]
    scale = c**-0.5 if scale is None else scale
    q, keys, decay, _, index, topk_weight, shared = _prepare(
        q, k_logits, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk)
    P = N + (shared is not None)
    L, device = B * T, q.device
    bounds = _segment_bounds(B, T, cu_seqlens, device)
    num_segments = bounds.numel() - 1
    segment_of_token = torch.searchsorted(bounds, torch.arange(L, device=device), right=True) - 1

    # One row per (token, selected partition), then one per token for the shared partition.
    w = topk_weight.reshape(L * top_k, 1, 1).to(q.dtype)

    def flat(x):
        return x.reshape(L, H, -1)

    def repeat(x):
        return flat(x).repeat_interleave(top_k, 0)

    rows_q, rows_k = [repeat(q) * w], [repeat(keys) * w]
    rows_v, rows_g = [repeat(v)], [repeat(decay)]
    rows_token = [torch.arange(L, device=device).repeat_interleave(top_k)]
    rows_part = [index.reshape(-1)]
    if shared is not None:
        q_s, keys_s, decay_s = shared
        rows_q.append(flat(q_s)), rows_k.append(flat(keys_s)), rows_v.append(flat(v)), rows_g.append(flat(decay_s))
        rows_token.append(torch.arange(L, device=device))
        rows_part.append(torch.full((L,), N, device=device, dtype=torch.long))
    token, part = torch.cat(rows_token), torch.cat(rows_part)
    group = segment_of_token[token] * P + part
    order = torch.argsort(group, stable=True)  # time order kept inside each (segment, partition) group
    new_bounds = torch.zeros(num_segments * P + 1, dtype=torch.long, device=device)
    new_bounds[1:] = torch.bincount(group, minlength=num_segments * P).cumsum(0)

    def gather(rows):
        return torch.cat(rows)[order][None]

    h0 = None
    if initial_state is not None:
        h0 = initial_state.transpose(1, 2).reshape(num_segments * P, H, c, dv)
    o_rows, final = gla(gather(rows_q), gather(rows_k), gather(rows_v).to(q.dtype), gather(rows_g), scale=scale,
                        initial_state=h0, output_final_state=output_final_state, cu_seqlens=new_bounds)
    o = o_rows.new_zeros(L, H, dv).index_add(0, token[order], o_rows[0])
    if final is not None:
        final = final.reshape(num_segments, P, H, c, dv).transpose(1, 2)
    return o.reshape(B, T, H, dv).to(v.dtype), final


def sse_chunk_mask(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                   row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                   gla=chunk_gla_torch):
    B, T, H, c = q.shape
    N, dv = router_logits.shape[-1], v.shape[-1]
    scale = c**-0.5 if scale is None else scale
    q, keys, decay, weights, index, _, shared = _prepare(
        q, k_logits, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk)
    P = N + (shared is not None)
    selected = torch.zeros_like(weights, dtype=torch.bool).scatter_(-1, index, True)
    w = (weights * selected).to(q.dtype)[..., None, None]  # [B, T, N, 1, 1]
    on = selected[..., None, None]
    parts_q, parts_k = [q[:, :, None] * w], [keys[:, :, None] * w]
    parts_g = [decay[:, :, None] * on]
    if shared is not None:
        q_s, keys_s, decay_s = shared
        parts_q.append(q_s[:, :, None]), parts_k.append(keys_s[:, :, None]), parts_g.append(decay_s[:, :, None])

    def fold(parts):  # partition-major heads
        return torch.cat(parts, 2).reshape(B, T, P * H, -1)

    v_all = v.to(q.dtype)[:, :, None].expand(B, T, P, H, dv).reshape(B, T, P * H, dv)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.transpose(1, 2).reshape(-1, P * H, c, dv)
    o, final = gla(fold(parts_q), fold(parts_k), v_all, fold(parts_g), scale=scale, initial_state=h0,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    o = o.reshape(B, T, P, H, dv).sum(2)
    if final is not None:
        final = final.reshape(-1, P, H, c, dv).transpose(1, 2)
    return o.to(v.dtype), final
