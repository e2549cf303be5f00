"""SSE compute: one functional operator, several implementations behind one dispatch point.

    o, final_state = sse_attention(q, k_logits, v, log_decay, router_logits, top_k=K, ...)
    o = sse_decode(state_cache, slot_ids, q, k_logits, v, log_decay, router_logits, top_k=K, ...)
    states = read_states(state_cache, slots)          # float32, whatever the cache's dtype (int16: fixed point)
    write_states(state_cache, slots, states)          # rounded to the cache's dtype
    states = states_from_cache(cached)                # the same conversions on cache rows already gathered
    cached = states_to_cache(states, dtype)
    y = norm_gate(o, weight, gate, eps=eps)          # the layer's output step: w * rmsnorm(o) * silu(gate)
    y = rms_norm(x, weight, eps=eps)                 # every RMSNorm of the HF model

Layout: `gla/` is the gated-linear-attention core, `sse/` the SSE operator (`naive.py` the float64 reference,
`chunk.py` the chunked training paths, `decode.py` the one-token step, `routing.py` what they share),
`norm_gate.py` the torch twins of RMSNorm and the layer's fused output step, `triton/` the GPU kernels.
"""
from kernels.dispatch import (
    IMPLEMENTATIONS,
    norm_gate,
    read_states,
    rms_norm,
    sse_attention,
    sse_decode,
    write_states,
)
from kernels.sse.decode import cache_rows, states_from_cache, states_to_cache

__all__ = ["IMPLEMENTATIONS", "cache_rows", "norm_gate", "read_states", "rms_norm", "sse_attention", "sse_decode",
           "states_from_cache", "states_to_cache", "write_states"]
