"""Chunkwise GLA in plain torch: the CPU training path, differentiable with autograd.

Every segment is cut into chunks of `chunk_size` tokens (the last one zero-padded: zero k/v and zero log-decay
leave the state untouched). With b the in-chunk cumulative log-decay (b <= 0), the decayed scores are
sum_k q_tk k_sk exp(b_tk - b_sk). They are computed as a matmul of q exp(b) and k exp(-b) where exp(-b) cannot
overflow (the usual case: decays near 1), and for the (chunk, head) pairs where it could, block by block with
exponents that are all <= 0 (`_strong_decay_scores`), exact for any decay. Across chunks the state is carried by
a loop over the chunk position inside a segment, vectorised over all segments, so the loop length is the longest
segment / C.
"""
import torch

# Largest in-chunk cumulative decay |b| for which exp(|b|) and the products built from it stay finite.
FACTORISED_LIMIT = {torch.float32: 60.0, torch.float64: 600.0}


def _strong_decay_scores(qc, kc, b, block=8):
    """sum_k q_tk k_sk exp(b_tk - b_sk) for chunks whose decays would overflow the factorised form, with no factor
    above 1. For s in an earlier block than t, exp(b_t - b_s) = exp(b_t - b_r) exp(b_r - b_s) with r the last token
    before t's block (b falls with time, so both exponents are <= 0): one matmul per block of t. Within a block the
    pairwise exp(b_t - b_s), exact for any decay, on block x block pairs only (the whole chunk's pairwise tensor,
    C x C x K per head, took a tiny model's CPU step from 0.7 s to 4.4 s once it learned sharp decays)."""
    NC, C, H, K = qc.shape
    if C % block:
        block = C
    nb = C // block
    qb, bb = qc.view(NC, nb, block, H, K), b.view(NC, nb, block, H, K)
    # r for block i is token i * block - 1; block 0 has no earlier tokens (its reference is never used).
    ref = torch.cat([torch.zeros_like(b[:, :1]), b[:, block - 1:C - 1:block]], 1)  # [NC, nb, H, K]
    earlier = torch.arange(C, device=qc.device)[None, :] < (torch.arange(nb, device=qc.device) * block)[:, None]
    k_rel = (ref[:, :, None] - b[:, None]).masked_fill(~earlier[None, :, :, None, None], float("-inf")).exp()
    inter = torch.einsum("nithk,nishk->nhits", qb * (bb - ref[:, :, None]).exp(), kc[:, None] * k_rel)
    inside = torch.ones(block, block, dtype=torch.bool, device=qc.device).tril()
    pair = (bb[:, :, :, None] - bb[:, :, None]).masked_fill(~inside[None, None, :, :, None, None], float("-inf"))
    intra = torch.einsum("nithk,nishk,nitshk->nhits", qb, kc.view(NC, nb, block, H, K), pair.exp())
    blocks = torch.eye(nb, dtype=qc.dtype, device=qc.device)  # intra on the block diagonal, inter everywhere else
    return inter.reshape(NC, H, C, C) + torch.einsum("nhits,ij->nhitjs", intra, blocks).reshape(NC, H, C, C)


def chunk_gla_torch(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    chunk_size=32):
    """Same contract as `recurrent_gla_reference` (and flash-linear-attention's `chunk_gla`).

    Computes in float32 (float64 for float64 inputs); returns o in v's dtype and the final state in float32/64.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    dtype = torch.promote_types(q.dtype, torch.float32)
    device = q.device
    if cu_seqlens is None:
        cu_seqlens = torch.arange(B + 1, device=device) * T
    elif B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {B}")
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.long)
    L = B * T
    q, k, v, g = (x.reshape(L, H, -1).to(dtype) for x in (q, k, v, g))
    q = q * scale

    C = chunk_size
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    num_segments = lens.numel()
    n_chunks = (lens + C - 1) // C
    first_chunk = torch.cumsum(n_chunks, 0) - n_chunks
    chunk_seg = torch.repeat_interleave(torch.arange(num_segments, device=device), n_chunks)
    NC = chunk_seg.numel()
    offset = (torch.arange(NC, device=device) - first_chunk[chunk_seg])[:, None] * C + torch.arange(C, device=device)
    valid = offset < lens[chunk_seg][:, None]
    src = torch.where(valid, cu_seqlens[chunk_seg][:, None] + offset, L)  # row L is an appended zero row

    def chunked(x):
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[src]  # [NC, C, H, d]

    qc, kc, vc, gc = chunked(q), chunked(k), chunked(v), chunked(g)
    b = gc.cumsum(1)
    causal = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    q_decayed = qc * b.exp()
    # (chunk, head) pairs whose decay would overflow exp(-b): the block-relative form for those alone (a model that
    # learned sharp decays has them in a few heads: 12 % of the pairs in a trained MQAR SSE-H), the factorised form
    # for the rest, with b = 0 standing in where it would overflow so that nothing in the graph is inf.
    strong = b.detach().amin(dim=(1, 3)) <= -FACTORISED_LIMIT[dtype]  # [NC, H]
    any_strong = bool(strong.any())
    b_safe = b.masked_fill(strong[:, None, :, None], 0.0) if any_strong else b
    q_scores = qc * b_safe.exp() if any_strong else q_decayed
    scores = torch.einsum("nthk,nshk->nhts", q_scores, kc * (-b_safe).exp()).masked_fill(~causal, 0)
    if any_strong:
        n, h = strong.nonzero(as_tuple=True)
        pairs = [x[n, :, h][:, :, None] for x in (qc, kc, b)]  # [pairs, C, 1, K]
        scores = scores.index_put((n, h), _strong_decay_scores(*pairs)[:, 0])
    o = torch.einsum("nhts,nshv->nthv", scores, vc)

    b_last = b[:, -1]
    chunk_update = torch.einsum("nshk,nshv->nhkv", kc * (b_last[:, None] - b).exp(), vc)
    chunk_decay = b_last.exp()[..., None]

    state = q.new_zeros(num_segments, H, K, V) if initial_state is None else initial_state.to(dtype)
    before, before_ids = [], []
    for j in range(int(n_chunks.max()) if num_segments else 0):
        active = n_chunks > j
        ids = (first_chunk + j).clamp(max=NC - 1)
        before.append(state[active])
        before_ids.append(ids[active])
        state = torch.where(active[:, None, None, None], chunk_decay[ids] * state + chunk_update[ids], state)
    if NC:
        state_before = torch.cat(before)[torch.argsort(torch.cat(before_ids))]
        o = o + torch.einsum("nthk,nhkv->nthv", q_decayed, state_before)
    # Chunks are in (segment, time) order, so the valid rows are exactly tokens 0..L-1 in order.
    o = o.reshape(NC * C, H, V)[valid.reshape(-1)].reshape(B, T, H, V)
    return o.to(out_dtype), (state if output_final_state else None)
