from kernels.sse.chunk import sse_chunk_mask, sse_chunk_varlen
from kernels.sse.decode import (
    cache_rows,
    read_states_torch,
    sse_decode_torch,
    states_from_cache,
    states_to_cache,
    write_states_torch,
)
from kernels.sse.naive import sse_reference
from kernels.sse.routing import log_decay_from_logits, route, route_read_write, softmax_keys

__all__ = ["cache_rows", "sse_chunk_mask", "sse_chunk_varlen", "sse_decode_torch", "sse_reference",
           "log_decay_from_logits", "read_states_torch", "route", "route_read_write", "softmax_keys",
           "states_from_cache", "states_to_cache", "write_states_torch"]
