"""SSE through one chunked GLA call: the two training-path layouts (docs/model.md, "Equivalences").

Partition i's contribution is GLA on the tokens that selected i with inputs (w q, w k, v, log a), so both paths
only rearrange tensors around a GLA core passed in as `gla` (torch on CPU, a Triton kernel on GPU).
- varlen: rows regrouped by (segment, partition) in time order with new cu_seqlens; work ~ (K + 1) tokens.
- mask: every partition sees every token, unselected ones zeroed (q, k and log-decay), partitions folded into the
  key dimension; work ~ (N + 1) key blocks, but plain dense tensors (paper Algorithm 1). The CPU pick at K = N.
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


def _prepare(q, k_logits, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk, route_index):
    weights, index, topk_weight = route(router_logits, top_k, route_index)
    keys, decay = softmax_keys(k_logits, log_decay, row_topk)
    shared = None
    if q_shared is not None:
        keys_s, decay_s = softmax_keys(k_shared_logits, log_decay, row_topk)
        shared = (q_shared.to(keys.dtype), keys_s, decay_s)
    return q.to(keys.dtype), keys, decay, weights, index, topk_weight, shared


def sse_chunk_varlen(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                     row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     route_index=None, gla=chunk_gla_torch):
    B, T, H, c = q.shape
    N, dv = router_logits.shape[-1], v.shape[-1]
    scale = c**-0.5 if scale is None else scale
    q, keys, decay, _, index, topk_weight, shared = _prepare(
        q, k_logits, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk, route_index)
    P = N + (shared is not None)
    L, device = B * T, q.device
    bounds = _segment_bounds(B, T, cu_seqlens, device)
    num_segments = bounds.numel() - 1
    segment_of_token = torch.searchsorted(bounds, torch.arange(L, device=device), right=True) - 1

    # One row per (token, selected partition), then one per token for the shared partition.
    row_token = torch.arange(L, device=device).repeat_interleave(top_k)
    row_part, row_w = index.reshape(-1), topk_weight.reshape(-1).to(q.dtype)
    if shared is not None:
        row_token = torch.cat([row_token, torch.arange(L, device=device)])
        row_part = torch.cat([row_part, torch.full((L,), N, device=device, dtype=torch.long)])
        row_w = torch.cat([row_w, q.new_ones(L)])
    group = segment_of_token[row_token] * P + row_part
    order = torch.argsort(group, stable=True)  # time order kept inside each (segment, partition) group
    new_bounds = torch.zeros(num_segments * P + 1, dtype=torch.long, device=device)
    new_bounds[1:] = torch.bincount(group, minlength=num_segments * P).cumsum(0)
    row_token, row_part, row_w = row_token[order], row_part[order], row_w[order][None, :, None, None]
    # Rows are read by index_select, whose backward is an index_add: advanced indexing's (index_put with
    # accumulate) is a large share of the CPU op's time (`python -m bench.op --device cpu`). Shared rows read the
    # shared tensors, stacked after the others.
    row_src = row_token + L * (row_part == N) if shared is not None else row_token
    q_s, keys_s, decay_s = shared if shared is not None else (None, None, None)

    def rows(x, x_shared):
        x = x.reshape(L, H, -1)
        if x_shared is not None:
            x = torch.cat([x, x_shared.reshape(L, H, -1)])
        return x.index_select(0, row_src)[None]

    rows_q, rows_k, rows_g = rows(q, q_s) * row_w, rows(keys, keys_s) * row_w, rows(decay, decay_s)
    rows_v = v.reshape(L, H, dv).index_select(0, row_token)[None].to(q.dtype)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.transpose(1, 2).reshape(num_segments * P, H, c, dv)
    o_rows, final = gla(rows_q, rows_k, rows_v, rows_g, scale=scale, initial_state=h0,
                        output_final_state=output_final_state, cu_seqlens=new_bounds)
    o = o_rows.new_zeros(L, H, dv).index_add(0, row_token, o_rows[0])
    if final is not None:
        final = final.reshape(num_segments, P, H, c, dv).transpose(1, 2)
    return o.reshape(B, T, H, dv).to(v.dtype), final


def sse_chunk_mask(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                   row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                   route_index=None, gla=chunk_gla_torch):
    B, T, H, c = q.shape
    N, dv = router_logits.shape[-1], v.shape[-1]
    scale = c**-0.5 if scale is None else scale
    q, keys, decay, weights, index, _, shared = _prepare(
        q, k_logits, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk, route_index)
    P = N + (shared is not None)
    selected = torch.zeros_like(weights, dtype=torch.bool).scatter_(-1, index, True)
    w = (weights * selected).to(q.dtype)[:, :, None, :, None]  # [B, T, 1, N, 1]
    on = selected[:, :, None, :, None]
    parts_q, parts_k = [q[:, :, :, None] * w], [keys[:, :, :, None] * w]
    parts_g = [decay[:, :, :, None] * on]
    if shared is not None:
        q_s, keys_s, decay_s = shared
        parts_q.append(q_s[:, :, :, None]), parts_k.append(keys_s[:, :, :, None])
        parts_g.append(decay_s[:, :, :, None])

    # Partitions folded into the key dimension (P * c rows per head, partition-major): GLA decays every key row by
    # its own log-decay, so each partition's rows form its own state, and o = q' S sums the partitions' outputs.
    # One C x C score matrix per head and chunk instead of one per partition, and v is not repeated.
    def fold(parts):
        return torch.cat(parts, 3).reshape(B, T, H, P * c)

    h0 = None if initial_state is None else initial_state.reshape(-1, H, P * c, dv)
    o, final = gla(fold(parts_q), fold(parts_k), v.to(q.dtype), fold(parts_g), scale=scale, initial_state=h0,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if final is not None:
        final = final.reshape(-1, H, P, c, dv)
    return o.to(v.dtype), final
