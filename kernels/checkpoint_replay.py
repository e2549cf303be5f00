"""Gradient checkpointing that does not run the SSE operator's forward twice.

torch.utils.checkpoint (non-reentrant) runs a checkpointed layer's forward again in the backward, to make the
tensors the first forward saved and dropped. For the indexed SSE operator that second forward would redo what the
first had already made -- the routing tables (three launches) and the output (`_output_kernel`, the largest kernel
of its forward, and the collect) -- and the chunk states, which its backward can make itself (as it does above
`KEPT_BYTES` of indexed_chunk.py). With a `CheckpointReplay` the first forward keeps each operator call's routing
tables and output, and the recomputation gets them back and only saves its inputs for the backward; the backward
makes the states. The host's launches are what this saves: a checkpointed SSE layer makes five launches fewer and
runs the output kernel once (`python -m bench.train_step` with gradient checkpointing measures the step).

How the operator learns that it is being recomputed, in one place: the caller makes one `CheckpointReplay` per
checkpointed call, passes its `contexts` as checkpoint's `context_fn` (which tells the object which pass is
running) and the object itself to the operator as its `replay` argument (`kernels.sse_attention(..., replay=)`):

    replay = CheckpointReplay()
    out = checkpoint(functools.partial(layer, replay=replay), x, use_reentrant=False, context_fn=replay.contexts)

Kept from the first forward to the layer's backward: the output and the tables, up to `KEPT_BYTES` a call; above
it, where memory counts more than the launches, the second forward runs as before. The same decision on both
passes, as it depends on the size alone.
"""
import functools

import torch.utils.checkpoint

# The output is T x heads x d_v values: 32 MiB holds 8k tokens of width 2048 in bf16, where the host's launches
# bound the checkpointed step, and not 32k, where the memory is what checkpointing is for.
KEPT_BYTES = 32 * 2**20


class _Pass:
    """One of a checkpointed call's two passes. Checkpoint enters the recomputation's context once per backward
    that needs it (a second backward of a retained graph recomputes again), so no generator context."""

    def __init__(self, replay: "CheckpointReplay", recomputing: bool):
        self.replay, self.recomputing = replay, recomputing

    def __enter__(self):
        if self.recomputing:
            self.replay._next = 0
        self.replay._passes.append(self.recomputing)

    def __exit__(self, *exc):
        self.replay._passes.pop()
        return False


class Slot:
    """One operator call under a `CheckpointReplay`: `kept` is what the first forward kept (in the recomputation),
    or None (in the first forward, which `keep`s it)."""

    def __init__(self, replay: "CheckpointReplay", kept):
        self.replay, self.kept = replay, kept

    def keep(self, *tensors):
        self.replay._kept.append(tensors)


class CheckpointReplay:
    """What the first forward of one checkpointed call kept for its recomputation, per operator call in call order.
    One object per checkpoint call: `contexts` is checkpoint's `context_fn`, the object the operator's `replay`."""

    def __init__(self):
        self._kept = []
        self._next = 0  # the recomputation's next operator call
        self._passes = []  # whether the entered pass recomputes, innermost last

    @staticmethod
    def applies_to(checkpoint_func) -> bool:
        """Whether `checkpoint_func` (transformers' `_gradient_checkpointing_func`) is torch's non-reentrant
        checkpoint with no `context_fn` of its caller's, the checkpoint a replay can ride on: reentrant checkpoint
        takes no `context_fn`, a caller's own (e.g. selective checkpointing) is kept, and transformers'
        `offload=True` wraps checkpoint in a function of its own that moves the saved activations off the GPU,
        where the kept outputs would stay on it."""
        keywords = getattr(checkpoint_func, "keywords", {})
        return (isinstance(checkpoint_func, functools.partial)
                and checkpoint_func.func is torch.utils.checkpoint.checkpoint
                and keywords.get("use_reentrant") is False and "context_fn" not in keywords)

    def contexts(self) -> tuple[_Pass, _Pass]:
        """torch.utils.checkpoint's `context_fn` (non-reentrant only): the first forward's and the
        recomputation's contexts, sharing what the first keeps."""
        return _Pass(self, False), _Pass(self, True)

    def slot(self, nbytes: int) -> Slot | None:
        """The current operator call's `Slot` when it runs inside one of `contexts` and its output takes at most
        KEPT_BYTES; otherwise None, and the call computes as without checkpointing."""
        if not self._passes or nbytes > KEPT_BYTES:
            return None
        if not self._passes[-1]:
            return Slot(self, None)
        if self._next >= len(self._kept):
            raise RuntimeError("checkpoint recomputation ran more SSE operator calls than its forward (the layer's "
                               "forward must make the same calls on both passes)")
        self._next += 1
        return Slot(self, self._kept[self._next - 1])
