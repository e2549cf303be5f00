"""Gradient checkpointing that does not run the SSE operator's forward twice.

torch.utils.checkpoint (non-reentrant) runs a checkpointed layer's forward again in the backward, to make the
tensors the first forward saved and dropped. For the indexed SSE operator that second forward redoes what the first
one had already made -- the routing tables (three launches) and the output (`_output_kernel`, the largest kernel of
its forward, and the collect) -- and the chunk states, which its backward can make itself (as it does above
`KEPT_BYTES` of indexed_chunk.py). Passed as checkpoint's `context_fn` (`contexts`; the SSE model does so under
torch's non-reentrant checkpoint, `SSEModel._checkpoint_replay`), the first forward keeps each operator call's
routing tables and output, and the second gets them back and only saves its inputs for the backward; the backward
makes the states. Per SSE layer and checkpointed step: five launches fewer and the output kernel once instead of
twice; the checkpointed 8k step of bench/train_step.py 1.00-1.02x Qwen3's against 0.97-0.99x before (H200,
kernels/NOTES.md), for ~165 MiB kept across its five SSE layers.

Kept from the first forward to the layer's backward: the output and the tables, up to `KEPT_BYTES` a call (the
output is T x heads x d_v values: 32 MiB at 8k tokens of width 2048 in bf16, 128 MiB at 32k, where memory counts
and the second forward runs as before). The same decision on both passes, as it depends on the size alone.
"""
import contextvars

KEPT_BYTES = 32 * 2**20

# (the checkpointed call's `_Calls`, whether this is its recomputation) while one of `contexts` is entered
_active = contextvars.ContextVar("sse_checkpoint_replay", default=None)


class _Calls:
    """What the first forward of one checkpointed call kept, per operator call in call order."""

    def __init__(self):
        self.kept = []
        self.next = 0  # the recomputation's next call


class _Context:
    """Checkpoint enters the recomputation's context once per backward that needs it, so no generator context."""

    def __init__(self, calls: _Calls, recomputing: bool):
        self.calls, self.recomputing, self.tokens = calls, recomputing, []

    def __enter__(self):
        if self.recomputing:
            self.calls.next = 0
        self.tokens.append(_active.set((self.calls, self.recomputing)))

    def __exit__(self, *exc):
        _active.reset(self.tokens.pop())
        return False


def contexts():
    """torch.utils.checkpoint's `context_fn` (non-reentrant only): a first forward and its recomputation that share
    what the first keeps."""
    calls = _Calls()
    return _Context(calls, False), _Context(calls, True)


class Slot:
    """One operator call under `contexts`: `kept` is what the first forward kept (in the recomputation), or None
    (in the first forward, which `keep`s it)."""

    def __init__(self, calls: _Calls, kept):
        self.calls, self.kept = calls, kept

    def keep(self, *tensors):
        self.calls.kept.append(tensors)


def slot(nbytes: int) -> Slot | None:
    """The current operator call's `Slot` when it runs under `contexts` and its output takes at most KEPT_BYTES;
    otherwise None, and the call computes as without checkpointing."""
    active = _active.get()
    if active is None or nbytes > KEPT_BYTES:
        return None
    calls, recomputing = active
    if not recomputing:
        return Slot(calls, None)
    if calls.next >= len(calls.kept):
        raise RuntimeError("checkpoint recomputation ran more SSE operator calls than its forward (the layer's forward "
                           "must make the same calls on both passes)")
    calls.next += 1
    return Slot(calls, calls.kept[calls.next - 1])
