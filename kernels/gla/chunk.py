"""Chunkwise GLA in plain torch: the CPU training path, differentiable with autograd.

Every segment is cut into chunks of `chunk_size` tokens (the last one zero-padded: zero k/v and zero log-decay
leave the state untouched). With b the in-chunk cumulative log-decay (b <= 0), the decayed scores are
sum_k q_tk k_sk exp(b_tk - b_sk). They are computed as a matmul of q exp(b) and k exp(-b) where exp(-b) cannot
overflow (the usual case: decays near 1), and for the (chunk, head) pairs where it could, block by block with
exponents that are all <= 0 (`_strong_decay_scores`), exact for any decay. Across chunks the state is carried by
a loop over the chunk position inside a segment, vectorised over all segments, so the loop length is the longest
segment / C. Only the strong-decay pairs are read by advanced indexing: its backward (a zero-filled copy of the whole
tensor and an accumulating index_put) would be most of the CPU op's work if every chunk were placed that way
(`python -m bench.op --device cpu`).
"""
import torch

# Largest in-chunk cumulative decay |b| for which exp(|b|) and the products built from it stay finite.
FACTORISED_LIMIT = {torch.float32: 60.0, torch.float64: 600.0}


def _strong_decay_scores(qc, kc, b, block=8):
    """sum_k q_tk k_sk exp(b_tk - b_sk) for chunks whose decays would overflow the factorised form, with no factor
    above 1. For s in an earlier block than t, exp(b_t - b_s) = exp(b_t - b_r) exp(b_r - b_s) with r the last token
    before t's block (b falls with time, so both exponents are <= 0): one matmul per block of t. Within a block the
    pairwise exp(b_t - b_s), exact for any decay, on block x block pairs only: the whole chunk's pairwise tensor,
    C x C x K per head, is C / block times the work and memory, which a model that learned sharp decays pays in
    every step."""
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
    packed = cu_seqlens is not None
    if packed and B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got {B}")
    bounds = cu_seqlens.to(device=device, dtype=torch.long) if packed else torch.arange(B + 1, device=device) * T
    L = B * T
    C = chunk_size
    lens = bounds[1:] - bounds[:-1]
    num_segments = lens.numel()
    # Chunks in (position in segment, segment) order, segments by decreasing chunk count: the segments still running
    # at position j are then a prefix, and their chunks j one contiguous block, so the state loop below slices
    # instead of indexing (each indexed read cost a zero-filled gradient of the whole tensor in the backward).
    n_chunks = (lens + C - 1) // C
    by_count = torch.argsort(n_chunks, descending=True, stable=True)
    running = (n_chunks[by_count][None] > torch.arange(int(n_chunks.max()) if num_segments else 0,
                                                       device=device)[:, None]).sum(1).tolist()
    NC = sum(running)
    rank = torch.argsort(by_count)  # a segment's place in by_count
    if not packed:
        # B segments of T tokens: the chunk layout is a reshape of the batch padded to whole chunks (placing rows by
        # index is a large share of the mask layout's op time, `python -m bench.op --device cpu`).
        pad = len(running) * C - T

        def chunked(x):  # [B, T, H, d] -> [NC, H, C, d]
            x = x.to(dtype)
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
            return x.view(B, -1, C, H, x.shape[-1]).permute(1, 0, 3, 2, 4).reshape(NC, H, C, -1)

        def unchunked(o):  # [NC, H, C, V] -> [B, T, H, V]
            return o.view(-1, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, -1, H, V)[:, :T]
    else:
        first_of_position = torch.tensor([0, *running[:-1]], device=device, dtype=torch.long).cumsum(0)
        # Every token's row in the chunk layout; the rows no token takes (the end of a segment's last chunk) stay
        # zero, and zero k, v and log-decay leave the state untouched.
        segment = torch.repeat_interleave(torch.arange(num_segments, device=device), lens, output_size=L)
        offset = torch.arange(L, device=device) - bounds[segment]
        slot = (first_of_position[offset // C] + rank[segment]) * C + offset % C

        def chunked(x):  # [1, L, H, d] -> [NC, H, C, d]
            x = x.reshape(L, H, -1).to(dtype)
            rows = x.new_zeros(NC * C, *x.shape[1:]).index_copy(0, slot, x)
            return rows.view(NC, C, H, -1).transpose(1, 2).contiguous()

        def unchunked(o):  # [NC, H, C, V] -> [1, L, H, V]
            return o.transpose(1, 2).reshape(NC * C, H, V).index_select(0, slot).view(B, T, H, V)

    qc, kc, vc, gc = chunked(q.to(dtype) * scale), chunked(k), chunked(v), chunked(g)
    b = gc.cumsum(2)
    q_decayed = qc * b.exp()
    # (chunk, head) pairs whose decay would overflow exp(-b): the block-relative form for those alone (a model that
    # learned sharp decays has them in a few heads: 12 % of the pairs in a trained MQAR SSE-H), the factorised form
    # for the rest, with b = 0 standing in where it would overflow so that nothing in the graph is inf.
    strong = b.detach().amin(dim=(2, 3)) <= -FACTORISED_LIMIT[dtype]  # [NC, H]
    any_strong = bool(strong.any())
    b_safe = b.masked_fill(strong[:, :, None, None], 0.0) if any_strong else b
    q_scores = qc * b_safe.exp() if any_strong else q_decayed
    causal = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    scores = (q_scores @ (kc * (-b_safe).exp()).transpose(-1, -2)).masked_fill(~causal, 0)
    if any_strong:
        n, h = strong.nonzero(as_tuple=True)
        pairs = [x[n, h][:, :, None] for x in (qc, kc, b)]  # [pairs, C, 1, K]
        scores = scores.index_put((n, h), _strong_decay_scores(*pairs)[:, 0])
    o = scores @ vc

    b_last = b[:, :, -1:]
    chunk_update = (kc * (b_last - b).exp()).transpose(-1, -2) @ vc  # [NC, H, K, V]
    chunk_decay = b_last.exp().transpose(-1, -2)  # [NC, H, K, 1]
    state = q.new_zeros(num_segments, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    state = state.index_select(0, by_count)
    before, finished = [], []
    for n_running, decay, update in zip(running, chunk_decay.split(running), chunk_update.split(running)):
        finished.append(state[n_running:])
        state = state[:n_running]
        before.append(state)
        state = decay * state + update
    if NC:
        o = o + q_decayed @ torch.cat(before)
    o = unchunked(o)
    final = None
    if output_final_state:  # finished holds the segments that ended before each position, longest last
        final = torch.cat([state, *finished[::-1]]).index_select(0, rank)
    return o.to(out_dtype), final
