from kernels.sse.chunk import sse_chunk_mask, sse_chunk_varlen
from kernels.sse.decode import sse_decode_torch
from kernels.sse.naive import sse_reference
from kernels.sse.routing import log_decay_from_logits, route, softmax_keys

__all__ = ["sse_chunk_mask", "sse_chunk_varlen", "sse_decode_torch", "sse_reference", "log_decay_from_logits", "route",
           "softmax_keys"]
