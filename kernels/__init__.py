"""SSE compute: one functional operator, several implementations behind one dispatch point, and the fused modules
the SSE layer is built from.

    o, final_state = sse_attention(q, k_logits, v, log_decay, router_logits, top_k=K, ...)
    o = sse_decode(state_cache, slot_ids, q, k_logits, v, log_decay, router_logits, top_k=K, ...)
    states = read_states(state_cache, slots)          # float32, whatever the cache's dtype (int16: fixed point)
    write_states(state_cache, slots, states)          # rounded to the cache's dtype
    states = states_from_cache(cached)                # the same conversions on cache rows already gathered
    cached = states_to_cache(states, dtype)
    y = norm_gate(o, weight, gate, eps=eps)          # the layer's output step: w * rmsnorm(o) * silu(gate)
    y = rms_norm(x, weight, eps=eps)                 # every RMSNorm of the HF model

    p = sse_input_projections(x, heads, ProjectionWeights(...), pad=pad, recipes=recipes)  # kernels/modules/
    with recomputed_when_saved(recipes): ...          # cheap saved activations made again in the backward
    aux, usage = balance_loss(stacked_router_logits, K, token_mask)   # the routers' balance term
    replay = CheckpointReplay()                       # the operator's recomputation under checkpoint, replayed:
    checkpoint(partial(layer, replay=replay), x, use_reentrant=False, context_fn=replay.contexts)

Layout: `gla/` is the gated-linear-attention core, `sse/` the SSE operator (`naive.py` the float64 reference,
`chunk.py` the chunked training paths, `decode.py` the one-token step, `routing.py` what they share),
`norm_gate.py` the torch twins of RMSNorm and the layer's fused output step, `triton/` the GPU kernels (their
launch settings per device in `triton/configs.py`), `modules/` the SSE layer's fused projections and
recomputation, `checkpoint_replay.py` the operator's replay under checkpointing, `kept_weights.py` and
`saved_views.py` how the autograd Functions keep what their backward needs.
"""
from kernels.checkpoint_replay import CheckpointReplay
from kernels.dispatch import (
    IMPLEMENTATIONS,
    norm_gate,
    read_states,
    rms_norm,
    sse_attention,
    sse_decode,
    write_states,
)
from kernels.modules import (
    ProjectionWeights,
    SSEProjections,
    float32_router,
    recomputed_when_saved,
    sse_input_projections,
)
from kernels.sse.decode import cache_rows, states_from_cache, states_to_cache
from kernels.sse.routing import balance_loss, replayed_selection

__all__ = ["CheckpointReplay", "IMPLEMENTATIONS", "ProjectionWeights", "SSEProjections", "balance_loss", "cache_rows",
           "float32_router", "norm_gate", "read_states", "recomputed_when_saved", "replayed_selection", "rms_norm",
           "sse_attention", "sse_decode", "sse_input_projections", "states_from_cache", "states_to_cache",
           "write_states"]
