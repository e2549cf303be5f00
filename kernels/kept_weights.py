"""Weights an autograd Function keeps for its backward as references on ctx instead of saved tensors.

Under gradient checkpointing every saved tensor runs Python hooks three times a step (packed in the forward,
packed again in the recomputation, unpacked in the backward), and the SSE layer has 17 weights and biases, in a
step whose host time bounds it at short lengths (`python -m bench.train_step` with checkpointing). Weights are not
activations: checkpointing frees none of them, so they need no hook. What saving them gave besides is kept here:
the backward refuses weights modified in place after the forward, as autograd does for saved tensors.
"""


def keep(ctx, *weights):
    """Keeps `weights` (tensors or None) for `kept`."""
    ctx.kept_weights = weights
    ctx.kept_versions = [None if w is None else w._version for w in weights]


def kept(ctx) -> tuple:
    """The weights `keep` kept, after checking that none was modified in place since."""
    for i, (w, version) in enumerate(zip(ctx.kept_weights, ctx.kept_versions)):
        if w is not None and w._version != version:
            raise RuntimeError(f"weight {i} of {type(ctx).__name__} (shape {tuple(w.shape)}) was modified by an "
                               f"in-place operation between the forward and the backward (version {version} -> "
                               f"{w._version}); its gradient would be wrong")
    return ctx.kept_weights
