"""SSE compute: one functional operator, several implementations behind one dispatch point.

    o, final_state = sse_attention(q, k_logits, v, log_decay, router_logits, top_k=K, ...)
    o = sse_decode(state_cache, slot_ids, q, k_logits, v, log_decay, router_logits, top_k=K, ...)

Layout: `gla/` is the gated-linear-attention core, `sse/` the SSE operator (`naive.py` the float64 reference,
`chunk.py` the chunked training paths, `decode.py` the one-token step, `routing.py` what they share).
"""
from kernels.dispatch import IMPLEMENTATIONS, sse_attention, sse_decode

__all__ = ["IMPLEMENTATIONS", "sse_attention", "sse_decode"]
