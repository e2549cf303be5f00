"""Tensors an autograd Function saves for its backward, each view saved as its base, once per base.

Every saved tensor costs the host a saved-variable pack, and under gradient checkpointing Python hooks three times
a step (packed in the forward, packed again in the recomputation, unpacked in the backward); the host's time bounds
short checkpointed training steps (`python -m bench.train_step`). Of the 19 tensors the SSE operator saves a call in
training, 13 are views of four allocations (q, k and v: column blocks of the projections' GEMM output; the six
routing tables: carved from two; the keys and log-decays of `_keys_kernel`: from one), so it saves 10. A view keeps
its base's storage alive anyway, so saving the base keeps the same memory, and autograd's check of in-place changes
sees the same version counter (a view shares its base's).
"""


def save(ctx, *tensors):
    """ctx.save_for_backward of `tensors` (tensors or None), each view as its base (`saved` rebuilds the views)."""
    bases, index, layout = [], {}, []
    for t in tensors:
        if t is None:
            layout.append(None)
            continue
        base = t._base
        if base is None:
            base = t
        i = index.get(id(base))
        if i is None:
            i = index[id(base)] = len(bases)
            bases.append(base)
        layout.append(i if base is t else (i, t.shape, t.stride(), t.storage_offset()))
    ctx.save_for_backward(*bases)
    ctx.saved_layout = layout


def saved(ctx) -> list:
    """The tensors `save` saved, in order: views rebuilt on their saved bases (data only, as ctx.saved_tensors)."""
    bases = ctx.saved_tensors
    return [None if entry is None else bases[entry] if isinstance(entry, int) else
            bases[entry[0]].as_strided(*entry[1:]) for entry in ctx.saved_layout]
