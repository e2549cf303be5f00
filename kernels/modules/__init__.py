"""The SSE layer's fused pieces around the operator, as flash-linear-attention keeps its fused modules apart from
its layers: the model file composes these, and what they do to autograd stays here.

    p = sse_input_projections(x, heads, ProjectionWeights(...), pad=pad, recipes=recipes)   # one autograd node
    logits = float32_router(x, weight)                # the router's logits in float32 (vLLM computes the same)
    with recomputed_when_saved(recipes): ...          # cheap saved activations made again in the backward

- `projections.py`  every projection the SSE layer makes of its input as one autograd node with a hand-written
                    backward, and the float32 router
- `recompute.py`    saved-tensor hooks that keep a recipe instead of a tensor
"""
from kernels.modules.projections import ProjectionWeights, SSEProjections, float32_router, sse_input_projections
from kernels.modules.recompute import recomputed_when_saved

__all__ = ["ProjectionWeights", "SSEProjections", "float32_router", "recomputed_when_saved", "sse_input_projections"]
