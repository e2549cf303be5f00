"""How much an SSE state holds: the singular-value entropy of each partition's state after a sequence; and where
each token was routed (to tell two models of one checkpoint apart, e.g. a float32 and a bfloat16 trainer).

The SSE paper measures how discriminative a state is by the entropy of its normalised singular values: a state
whose spectrum is spread over many directions (high entropy, up to log min(c, d_v)) can hold more key-value
associations apart than one dominated by a few directions. Partition usage (how many tokens each partition gets)
is logged during training; this is its counterpart for what the partitions end up storing.
"""
import torch

from kernels.sse.routing import route
from sse_model.configuration_sse import SSE_LAYER


def singular_value_entropy(states: torch.Tensor) -> torch.Tensor:
    """states [..., c, d_v] -> [...]: -sum_i p_i log p_i (nats) with p_i = s_i / sum_j s_j over the singular values
    s of each state, in float64. An all-zero state (a partition no token was routed to) has entropy 0."""
    s = torch.linalg.svdvals(states.double())
    total = s.sum(-1, keepdim=True)
    p = s / total.clamp_min(torch.finfo(torch.float64).tiny)
    return -torch.xlogy(p, p).sum(-1)


@torch.no_grad()
def state_entropy(model, sequences: list[list[int]]) -> torch.Tensor:
    """[SSE layers, N + shared] singular-value entropy of each partition's state (shared partition last) after
    each whole sequence, averaged over heads and sequences. `model`: an `SSEForCausalLM` with SSE layers."""
    from sse_model.modeling_sse import SSECache
    layers = [i for i, kind in enumerate(model.config.layer_types) if kind == SSE_LAYER]
    if not layers:
        raise ValueError("the model has no SSE layer, so no SSE state to measure")
    device = next(model.parameters()).device
    per_sequence = []
    for ids in sequences:
        cache = SSECache(model.config)
        model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True)
        per_sequence.append(torch.stack([singular_value_entropy(cache.sse_state(i)[0]).mean(0) for i in layers]))
    return torch.stack(per_sequence).mean(0).float().cpu()


@torch.no_grad()
def routed_partitions(model, ids: list[int]) -> torch.Tensor:
    """[SSE layers, T, K] the top-K partitions each token of one sequence is routed to, layer by layer, as the
    operators choose them (`kernels.sse.routing.route`). `model`: an `SSEForCausalLM` with SSE layers; it runs
    under whatever autocast the caller has on."""
    if SSE_LAYER not in model.config.layer_types:
        raise ValueError("the model has no SSE layer, so no routing to report")
    picks = []

    def keep(layer, args, out):  # a decoder layer returns (x, router logits or None)
        if out[1] is not None:
            picks.append(route(out[1][0], model.config.sse_top_k)[1])
    hooks = [layer.register_forward_hook(keep) for layer in model.model.layers]
    try:
        model(input_ids=torch.tensor([ids], device=next(model.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(picks).cpu()
