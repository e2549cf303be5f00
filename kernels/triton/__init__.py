"""SSE Triton kernels (GPU; also run on CPU under TRITON_INTERPRET=1 for tests).

- `routing.py`  top-K routing and the counting sort into (segment, partition) groups with new cu_seqlens
- `expand.py`   gather of token inputs into GLA rows (weights, softmax keys, row-sparse masking) and the scatter
                back, both with their backward
- `indexed_chunk.py`  the training path `sse_triton_indexed` (the GPU default): chunked GLA kernels of our own
                that read the routed rows by index, no materialised rows, no host synchronisation
- `chunk.py`    the training paths `sse_triton_varlen` / `sse_triton_mask`: the rows materialised by `expand.py`
                around flash-linear-attention's `chunk_gla` (kept as baselines)
- `decode.py`   the fused in-place decode step `sse_decode_triton`
- `state_cache.py` a prefill's states out of and back into a decode state cache, one pass each way
                (`read_states_triton`, `write_states_triton`)
- `norm_gate.py` RMSNorm and the layer's output step w * rmsnorm(o) * silu(gate), forward and backward
                (`rms_norm_triton`, `norm_gate_triton`)
`kernels.dispatch` imports this package only when a Triton path is asked for, so `import kernels` needs
neither a GPU nor flash-linear-attention.
"""
from kernels.triton.chunk import sse_triton_mask, sse_triton_varlen
from kernels.triton.decode import sse_decode_triton
from kernels.triton.indexed_chunk import sse_triton_indexed

__all__ = ["sse_decode_triton", "sse_triton_indexed", "sse_triton_mask", "sse_triton_varlen"]
