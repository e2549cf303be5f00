"""The one place that picks an SSE implementation. The model and the vLLM backend call only these two."""
import functools
import importlib
import importlib.util

import torch

from kernels.norm_gate import norm_gate_torch, rms_norm_torch
from kernels.sse import (
    log_decay_from_logits,
    read_states_torch,
    sse_chunk_mask,
    sse_chunk_varlen,
    sse_decode_torch,
    sse_reference,
    write_states_torch,
)

# The Triton kernels' package, `kernels.triton`. The model code saved beside a checkpoint (sse_model/hub_code.py)
# leaves it out: there it does not exist, and every "auto" picks a torch path.
TRITON_KERNELS = f"{__package__}.triton"


def _lazy(module, name):
    """The Triton path `name` of `TRITON_KERNELS.<module>`, imported on first call, so `import kernels` needs
    neither a GPU nor fla."""
    def call(*args, **kwargs):
        return getattr(importlib.import_module(f"{TRITON_KERNELS}.{module}"), name)(*args, **kwargs)
    call.__name__ = name
    return call


IMPLEMENTATIONS = {
    "reference": sse_reference,
    "chunk_torch_varlen": sse_chunk_varlen,
    "chunk_torch_mask": sse_chunk_mask,
    "triton_varlen": _lazy("chunk", "sse_triton_varlen"),
    "triton_mask": _lazy("chunk", "sse_triton_mask"),
    "triton_indexed": _lazy("indexed_chunk", "sse_triton_indexed"),
}
# The paths that take decay logits and `decay_normalizer` themselves; sse_attention computes log a for the others.
TAKES_DECAY_LOGITS = {"triton_indexed"}
# The paths whose checkpoint recomputation can replay the first forward (`replay`); the others compute again.
TAKES_REPLAY = {"triton_indexed"}
# The paths that take a `read_top_k` other than top_k (the authors' num_reader != num_writer); the Triton kernels
# read and write the same K partitions.
TAKES_READ_TOP_K = {"reference", "chunk_torch_varlen", "chunk_torch_mask"}
DECODE_IMPLEMENTATIONS = {"torch": sse_decode_torch, "triton": _lazy("decode", "sse_decode_triton")}
READ_STATES_IMPLEMENTATIONS = {"torch": read_states_torch,
                               "triton": _lazy("state_cache", "read_states_triton")}
WRITE_STATES_IMPLEMENTATIONS = {"torch": write_states_torch,
                                "triton": _lazy("state_cache", "write_states_triton")}
NORM_GATE_IMPLEMENTATIONS = {"torch": norm_gate_torch, "triton": _lazy("norm_gate", "norm_gate_triton")}
RMS_NORM_IMPLEMENTATIONS = {"torch": rms_norm_torch, "triton": _lazy("norm_gate", "rms_norm_triton")}


def _check_shapes(q, k_logits, v, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk,
                  initial_state, cu_seqlens, log_decay_shared=None, read_top_k=None, route_index=None):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, c], got shape {tuple(q.shape)}")
    B, T, H, c = q.shape
    for name, x in (("k_logits", k_logits), ("log_decay", log_decay), ("q_shared", q_shared),
                    ("k_shared_logits", k_shared_logits), ("log_decay_shared", log_decay_shared)):
        if x is not None and x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
    if (q_shared is None) != (k_shared_logits is None):
        raise ValueError("q_shared and k_shared_logits go together: pass both or neither")
    if log_decay_shared is not None and q_shared is None:
        raise ValueError("log_decay_shared is the shared partition's: it needs q_shared and k_shared_logits")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, d_v] with B, T, H = {B, T, H}, got {tuple(v.shape)}")
    if router_logits.dim() != 3 or router_logits.shape[:2] != q.shape[:2]:
        raise ValueError(f"router_logits must be [B, T, N] with B, T = {B, T}, got {tuple(router_logits.shape)}")
    N = router_logits.shape[-1]
    if not 1 <= top_k <= N:
        raise ValueError(f"top_k must be in [1, N={N}], got {top_k}")
    if read_top_k is not None and not 1 <= read_top_k <= N:
        raise ValueError(f"read_top_k must be in [1, N={N}] or None, got {read_top_k}")
    if route_index is not None and (tuple(route_index.shape) != (B, T, top_k) or route_index.is_floating_point()):
        raise ValueError(f"route_index must be integer [B, T, top_k] = {(B, T, top_k)}, got {route_index.dtype} "
                         f"{tuple(route_index.shape)}")
    # Like cu_seqlens, its values are checked only where reading them is free: a partition out of range would be
    # read past the state (the same partition twice is only a wrong selection).
    if route_index is not None and route_index.device.type == "cpu" and route_index.numel() and not (
            0 <= int(route_index.min()) and int(route_index.max()) < N):
        raise ValueError(f"route_index holds partitions outside [0, N={N})")
    if route_index is not None and read_top_k not in (None, top_k):
        raise ValueError("route_index (partition replay) replays the top_k partitions a token writes; it cannot be "
                         "combined with read_top_k != top_k")
    if row_topk is not None and not 1 <= row_topk <= c:
        raise ValueError(f"row_topk must be in [1, c={c}], got {row_topk}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs B = 1, got B = {B}")
    # Its last value is checked only where reading it is free: on a GPU that read would stop the host on every
    # call (the vLLM step and CUDA-graph capture must never wait on the device).
    if cu_seqlens is not None and cu_seqlens.device.type == "cpu" and int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seqlens[-1] must be T = {T}, got {int(cu_seqlens[-1])}")
    if initial_state is not None:
        S = B if cu_seqlens is None else cu_seqlens.numel() - 1
        want = (S, H, N + (q_shared is not None), c, v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [segments, H, N + shared, c, d_v] = {want}, "
                             f"got {tuple(initial_state.shape)}")


@functools.cache
def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def pick_implementation(device: torch.device, top_k: int | None = None, num_partitions: int | None = None) -> str:
    # On GPU our indexed chunk kernels: no materialised rows, and no host synchronisation, so no fixed cost at short
    # lengths, where the varlen and mask layouts around fla's chunk_gla pay both (`python -m bench.op` times all three
    # against chunk_gla itself).
    if device.type == "cuda" and _installed("triton", TRITON_KERNELS):
        return "triton_indexed"
    # On CPU the varlen layout's work grows with K + 1 rows per token, the mask's with N + 1 key blocks. At K = N the
    # mask layout does less (one score matrix per head, not K + 1) and needs no routing sort or row gathers; below it
    # the varlen layout's K + 1 rows are the fewer (`python -m bench.op --device cpu` times both).
    if top_k is not None and top_k == num_partitions:
        return "chunk_torch_mask"
    return "chunk_torch_varlen"


def sse_attention(q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None, k_shared_logits=None,
                  row_topk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  decay_normalizer=None, replay=None, log_decay_shared=None, read_top_k=None, route_index=None,
                  impl="auto"):
    """SSE over whole sequences (docs/model.md).

    q, k_logits, log_decay, q_shared, k_shared_logits: [B, T, H, c]; v: [B, T, H, d_v]; router_logits: [B, T, N].
    With `cu_seqlens` (B = 1), each segment starts from its own initial state and returns its own final state.
    With `decay_normalizer`, `log_decay` holds the decay logits x and log a = logsigmoid(x) / decay_normalizer, as
    in `sse_decode`: the indexed Triton path takes it inside its kernels and keeps only x (bf16 in training) for
    its backward; the others get log a computed here.
    With `replay` (a `kernels.CheckpointReplay`, for a call inside torch's checkpoint with the replay's contexts),
    the indexed Triton path's recomputation takes the first forward's routing and output instead of computing them
    again; the others compute again, as without it.
    With `route_index` [B, T, K] (integer), each token's selected partitions are those instead of the top-K of its
    router logits (partition replay, docs/pipeline.md): only the discrete choice is replayed, the selected
    partitions are still weighted by the softmax of `router_logits`, so the router keeps its gradient.
    The SSE authors' layer (docs/model.md, "The authors' layer"): `log_decay_shared` [B, T, H, c] is the shared
    partition's own log-decay (decay logits with `decay_normalizer`; None: it decays as the routed ones), and
    `read_top_k` the partitions each token reads when they are not the `top_k` it writes (torch paths only,
    TAKES_READ_TOP_K).
    Returns (o [B, T, H, d_v], final_state [B or segments, H, N + shared, c, d_v] or None), shared partition last.
    """
    _check_shapes(q, k_logits, v, log_decay, router_logits, top_k, q_shared, k_shared_logits, row_topk,
                  initial_state, cu_seqlens, log_decay_shared, read_top_k, route_index)
    reads_differ = read_top_k is not None and read_top_k != top_k
    if impl == "auto":
        impl = pick_implementation(q.device, top_k, router_logits.shape[-1])
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown SSE implementation {impl!r}; known: {sorted(IMPLEMENTATIONS)} or 'auto'")
    if reads_differ and impl not in TAKES_READ_TOP_K:
        raise ValueError(f"SSE implementation {impl!r} reads the partitions it writes: read_top_k={read_top_k} != "
                         f"top_k={top_k} (the authors' num_reader != num_writer) needs one of "
                         f"{sorted(TAKES_READ_TOP_K)}")
    fused = {}
    if decay_normalizer is not None and impl in TAKES_DECAY_LOGITS:
        fused["decay_normalizer"] = decay_normalizer
    elif decay_normalizer is not None:
        log_decay = log_decay_from_logits(log_decay, decay_normalizer)
        if log_decay_shared is not None:
            log_decay_shared = log_decay_from_logits(log_decay_shared, decay_normalizer)
    if replay is not None and impl in TAKES_REPLAY:
        fused["replay"] = replay
    if log_decay_shared is not None:
        fused["log_decay_shared"] = log_decay_shared
    if reads_differ:
        fused["read_top_k"] = read_top_k
    if route_index is not None:
        fused["route_index"] = route_index
    return IMPLEMENTATIONS[impl](q, k_logits, v, log_decay, router_logits, top_k=top_k, q_shared=q_shared,
                                 k_shared_logits=k_shared_logits, row_topk=row_topk, scale=scale,
                                 initial_state=initial_state, output_final_state=output_final_state,
                                 cu_seqlens=cu_seqlens, **fused)


def sse_decode(state, slot_ids, q, k_logits, v, log_decay, router_logits, *, top_k, q_shared=None,
               k_shared_logits=None, row_topk=None, scale=None, out=None, decay_normalizer=None, shared_lora=False,
               log_decay_shared=None, read_top_k=None, impl="auto"):
    """One token per sequence; updates rows `slot_ids` of `state` [num_slots, H, N + shared, c, d_v] in place.
    Returns o [B, H, d_v], written into `out` [B, H, d_v] when given (the Triton kernel writes it directly).
    With `decay_normalizer`, `log_decay` holds the decay logits x and log a = logsigmoid(x) / decay_normalizer.
    With `shared_lora`, q_shared and k_shared_logits are low-rank terms added to q and k_logits (sse_decode_torch).
    `log_decay_shared` and `read_top_k` as in `sse_attention` (a read_top_k other than top_k: torch only)."""
    decode = _triton_or_torch(DECODE_IMPLEMENTATIONS, impl, state.device, "SSE decode")
    extra = {} if log_decay_shared is None else {"log_decay_shared": log_decay_shared}
    if read_top_k is not None and read_top_k != top_k:
        if decode is not sse_decode_torch:
            raise ValueError(f"the Triton SSE decode reads the partitions it writes: read_top_k={read_top_k} != "
                             f"top_k={top_k} (the authors' num_reader != num_writer) needs impl='torch'")
        extra["read_top_k"] = read_top_k
    return decode(state, slot_ids, q, k_logits, v, log_decay, router_logits, top_k=top_k, q_shared=q_shared,
                  k_shared_logits=k_shared_logits, row_topk=row_topk, scale=scale, out=out,
                  decay_normalizer=decay_normalizer, shared_lora=shared_lora, **extra)


def read_states(cache, slots, has_state=None, *, impl="auto"):
    """The states of rows `slots` [S] of a state cache [num_slots, H, N + shared, c (+ 4 for int16), d_v] as float32
    [S, H, N + shared, c, d_v] (a prefill's initial states); zeros where `has_state` [S] is False, whose slots are
    not read. The Triton kernel on CUDA: one pass, where torch gathers and converts in three."""
    return _triton_or_torch(READ_STATES_IMPLEMENTATIONS, impl, cache.device, "state read")(cache, slots, has_state)


def write_states(cache, slots, states, *, impl="auto"):
    """Store float32 states [S, H, N + shared, c, d_v] (a prefill's final states) into rows `slots` [S] of a state
    cache, rounded once to its dtype (`states_to_cache`). The Triton kernel on CUDA: one pass, where torch makes
    a dozen."""
    _triton_or_torch(WRITE_STATES_IMPLEMENTATIONS, impl, cache.device, "state write")(cache, slots, states)


def norm_gate(o, weight, gate, *, eps, impl="auto"):
    """w * rmsnorm(o) * silu(gate) over the last dimension (the SSE layer's output step, kernels/norm_gate.py).
    The Triton kernels on CUDA: one launch each way and no float32 copies kept for the backward."""
    return _triton_or_torch(NORM_GATE_IMPLEMENTATIONS, impl, o.device, "norm-gate")(o, weight, gate, eps)


def rms_norm(x, weight, *, eps, impl="auto"):
    """w * rmsnorm(x) over the last dimension (every RMSNorm of the HF model). The Triton kernels on CUDA: one
    launch each way, keeping x and a float32 scale per row for the backward instead of x in float32 and the
    normalised x (4 bytes an element less; kernels/triton/norm_gate.py)."""
    return _triton_or_torch(RMS_NORM_IMPLEMENTATIONS, impl, x.device, "RMSNorm")(x, weight, eps)


def _triton_or_torch(implementations: dict, impl: str, device: torch.device, what: str):
    """The implementation `impl` names; "auto" is the Triton kernel on CUDA, the torch twin elsewhere and under
    torch.compile, where inductor makes its own kernel of the twin's ops, fused with those around it, and the
    compiled graph holds none of our autograd Functions."""
    if impl == "auto":
        triton = device.type == "cuda" and _installed("triton", TRITON_KERNELS) and not torch.compiler.is_compiling()
        impl = "triton" if triton else "torch"
    if impl not in implementations:
        raise ValueError(f"unknown {what} implementation {impl!r}; known: {sorted(implementations)}")
    return implementations[impl]
