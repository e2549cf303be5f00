"""SSE through one chunked GLA call: the two training-path layouts (docs/model.md, "Equivalences").

Partition i's contribution is GLA on the tokens that selected i with inputs (w q, w k, v, log a), so both paths
only rearrange tensors around a GLA core passed in as `gla` (torch on CPU, a Triton kernel on GPU).
- varlen: rows regrouped by (segment, partition) in time order with new cu_seqlens; work ~ (K + 1) tokens.
- mask: every partition sees every token, unselected ones zeroed (q, k and log-decay), partitions folded into the
  key dimension; work ~ (N + 1) key blocks, but plain dense tensors (paper Algorithm 1). The CPU pick at K = N.
With `read_top_k` != top_k (the authors' num_reader / num_writer) a token's rows cover the partitions it reads or
writes: a read-only row has k = 0 and log-decay 0 (its state untouched), a write-only row q = 0.
"""
import torch

from kernels.gla import chunk_gla_torch
from kernels.sse.routing import route_read_write, softmax_keys, written_and_read


def _segment_bounds(B, T, cu_seqlens, device):
    if cu_seqlens is None:
        return torch.arange(B + 1, device=device) * T
    if B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {B}")
    return cu_seqlens.to(device=device, dtype=torch.long)


def _prepare(q, k_logits, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk, log_decay_shared,
             read_top_k, route_index):
    routing = route_read_write(router_logits, top_k, read_top_k, route_index)
    keys, decay = softmax_keys(k_logits, log_decay, row_topk)
    shared = None
    if q_shared is not None:
        keys_s, decay_s = softmax_keys(k_shared_logits, log_decay if log_decay_shared is None else log_decay_shared,
                                       row_topk)
        shared = (q_shared.to(keys.dtype), keys_s, decay_s)
    return q.to(keys.dtype), keys, decay, routing, shared


def sse_chunk_varlen(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                     row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     log_decay_shared=None, read_top_k=None, route_index=None, gla=chunk_gla_torch):
    B, T, H, c = q.shape
    N, dv = router_logits.shape[-1], v.shape[-1]
    scale = c**-0.5 if scale is None else scale
    q, keys, decay, (_, index, topk_weight, writes, reads), shared = _prepare(
        q, k_logits, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk, log_decay_shared,
        read_top_k, route_index)
    J = index.shape[-1]  # rows per token (the partitions it reads or writes) before the shared one
    P = N + (shared is not None)
    L, device = B * T, q.device
    bounds = _segment_bounds(B, T, cu_seqlens, device)
    num_segments = bounds.numel() - 1
    segment_of_token = torch.searchsorted(bounds, torch.arange(L, device=device), right=True) - 1

    # One row per (token, selected partition), then one per token for the shared partition. Rows scale q by
    # w (0 where the partition is not read) and k by w (0 where it is not written), the latter's log-decay 0.
    row_token = torch.arange(L, device=device).repeat_interleave(J)
    row_part, row_w = index.reshape(-1), topk_weight.reshape(-1).to(q.dtype)
    row_written = writes.repeat(L)
    row_wq, row_wk = row_w * reads.repeat(L), row_w * row_written  # exact where every row is read and written
    if shared is not None:
        row_token = torch.cat([row_token, torch.arange(L, device=device)])
        row_part = torch.cat([row_part, torch.full((L,), N, device=device, dtype=torch.long)])
        row_wq, row_wk = (torch.cat([w, q.new_ones(L)]) for w in (row_wq, row_wk))
        row_written = torch.cat([row_written, row_written.new_ones(L)])
    group = segment_of_token[row_token] * P + row_part
    order = torch.argsort(group, stable=True)  # time order kept inside each (segment, partition) group
    new_bounds = torch.zeros(num_segments * P + 1, dtype=torch.long, device=device)
    new_bounds[1:] = torch.bincount(group, minlength=num_segments * P).cumsum(0)
    row_token, row_part = row_token[order], row_part[order]
    row_wq, row_wk, row_written = (x[order][None, :, None, None] for x in (row_wq, row_wk, row_written))
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

    rows_q, rows_k, rows_g = rows(q, q_s) * row_wq, rows(keys, keys_s) * row_wk, rows(decay, decay_s)
    if J > top_k:  # rows only read
        rows_g = rows_g * row_written
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
                   log_decay_shared=None, read_top_k=None, route_index=None, gla=chunk_gla_torch):
    B, T, H, c = q.shape
    N, dv = router_logits.shape[-1], v.shape[-1]
    scale = c**-0.5 if scale is None else scale
    q, keys, decay, (weights, index, _, writes, reads), shared = _prepare(
        q, k_logits, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk, log_decay_shared,
        read_top_k, route_index)
    P = N + (shared is not None)
    written, read = written_and_read(index, writes, reads, N)
    w_q, w_k = ((weights * m).to(q.dtype)[:, :, None, :, None] for m in (read, written))  # [B, T, 1, N, 1]
    on = written[:, :, None, :, None]
    parts_q, parts_k = [q[:, :, :, None] * w_q], [keys[:, :, :, None] * w_k]
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
