"""Cheap activations made again in the backward instead of kept: `recomputed_when_saved`, saved-tensor hooks that
store a recipe in place of a tensor autograd saves."""
import contextlib
from typing import Callable

import torch

# A block's recipes whose tensors take at most this many bytes together are kept instead: 96 MiB holds the SSE
# layer's three recipe inputs at 8k tokens of width 2048 in bf16 (and W_o's input, its own block, up to 24k
# tokens), where making them again costs launches and a Python hook on every tensor the operator saves in a step
# the host nearly bounds; at 32k tokens, where the memory counts, they are made again. `python -m bench.train_step`
# at 8k and 32k tokens measures both sides.
RECIPES_ABOVE_BYTES = 96 * 2**20


@contextlib.contextmanager
def recomputed_when_saved(recipes: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]]):
    """Within the block, autograd keeps a tensor it saves for the backward that is (a view of) one of `recipes`'
    tensors as that tensor's recipe, and the backward makes it again: the same ops on the same inputs, so bit for
    bit. For the SSE layer's cheap products of tensors the backward keeps anyway (its decay logits, the shared
    partition's q and key logits, W_o's input: 4 of the 10 [T, hidden] tensors it kept), which its operator and
    W_o would otherwise keep. Off where another saved-tensor hook is active: gradient checkpointing (which
    recomputes the whole layer) or offloading would lose theirs to ours; and where the recipes' tensors take at most
    RECIPES_ABOVE_BYTES."""
    if (not torch.is_grad_enabled() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
            or sum(t.numel() * t.element_size() for t, _ in recipes) <= RECIPES_ABOVE_BYTES):
        yield
        return
    # No tensor in here: the saved variables keep this hook, and through it what it holds, to the backward.
    by_storage = {t.untyped_storage().data_ptr(): (make, t.dtype, t.storage_offset())
                  for t, make in recipes if t.numel() and t.is_contiguous()}

    def pack(t):
        entry = by_storage.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if entry is None or t.dtype != entry[1]:
            return t
        make, _, offset = entry
        return make, t.shape, t.stride(), t.storage_offset() - offset

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        make, shape, stride, offset = packed
        with torch.no_grad():
            made = make()
        return made.as_strided(shape, stride, made.storage_offset() + offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        try:
            yield
        finally:  # the saved variables keep `pack`: only the recipes they took may keep their inputs alive
            by_storage.clear()
