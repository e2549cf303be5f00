"""The pieces of SSE that every implementation shares: the log-decay, router weights, top-K selection and softmax
keys.

Kept in one place so the reference, the chunked paths, the decode path and the kernels agree on tie-breaking
(`torch.topk`) and on the row-sparse rule.
"""
import torch
import torch.nn.functional as F


def log_decay_from_logits(decay_logits: torch.Tensor, normalizer: float) -> torch.Tensor:
    """log a = logsigmoid(x) / normalizer, in float32 at least (it is summed over many tokens). The model keeps
    the decay logits x and the operators take them with `decay_normalizer` (the Triton ones fuse this step)."""
    return F.logsigmoid(decay_logits.to(torch.promote_types(decay_logits.dtype, torch.float32))) / normalizer


def route(router_logits: torch.Tensor, top_k: int, route_index: torch.Tensor | None = None):
    """Router weights softmax-ed over all N partitions, and the top-K partitions with their weights.

    The selected weights are not renormalised (docs/model.md), so the router gets gradients even at K = 1.
    With `route_index` [..., K] the selection is those partitions (partition replay: another engine's choice)
    instead of the top-K of the logits; the weights are still the softmax of these logits, so the router keeps
    its gradient.
    Returns (weights [..., N], topk_index [..., K], topk_weight [..., K]).
    """
    weights = torch.softmax(router_logits.float() if router_logits.dtype != torch.float64 else router_logits, -1)
    index = torch.topk(router_logits, top_k, dim=-1).indices if route_index is None else route_index.long()
    return weights, index, weights.gather(-1, index)


def selection_scores(route_index: torch.Tensor, num_partitions: int) -> torch.Tensor:
    """Scores [..., N] whose top-K, in order, is `route_index` [..., K]: K, K - 1, ..., 1 at the chosen partitions
    and 0 elsewhere. For the kernels that take their top-K of a score tensor themselves (the Triton routing):
    given these in place of the router logits, they select the replayed partitions."""
    K = route_index.shape[-1]
    ranks = torch.arange(K, 0, -1, dtype=torch.float32, device=route_index.device).expand(route_index.shape)
    scores = torch.zeros(*route_index.shape[:-1], num_partitions, dtype=torch.float32, device=route_index.device)
    return scores.scatter_(-1, route_index.long(), ranks)


def route_read_write(router_logits: torch.Tensor, top_k: int, read_top_k: int | None = None,
                     route_index: torch.Tensor | None = None):
    """`route` for a token that writes its top `top_k` partitions and reads its top `read_top_k` (None: top_k),
    the authors' num_writer / num_reader (flash-linear-attention PR #882 at 741fbbf, fla/ops/sse/mask.py).
    Both are prefixes of one top-J ranking (J = the larger), so they agree on ties. Returns (weights [..., N],
    index [..., J], their weights [..., J], writes [J] bool, reads [J] bool): which of the J are written / read.
    `route_index` [..., top_k] (partition replay; only where the reads are the writes) is the choice instead."""
    read_top_k = top_k if read_top_k is None else read_top_k
    J = max(top_k, read_top_k)
    weights, index, topk_weight = route(router_logits, J, route_index)
    j = torch.arange(J, device=router_logits.device)
    return weights, index, topk_weight, j < top_k, j < read_top_k


def written_and_read(index: torch.Tensor, writes: torch.Tensor, reads: torch.Tensor, N: int):
    """`route_read_write`'s choice as masks over all N partitions: (written [..., N], read [..., N]) bool."""
    def over_n(chosen):
        return index.new_zeros(*index.shape[:-1], N, dtype=torch.bool).scatter_(-1, index, chosen.expand_as(index))
    return over_n(writes), over_n(reads)


def softmax_keys(k_logits: torch.Tensor, log_decay: torch.Tensor, row_topk: int | None):
    """Keys as a softmax over the c rows of each head, and the log-decay that goes with them.

    Row-sparse mode keeps the top `row_topk` rows of the key logits, softmaxes over those (zeros elsewhere) and
    zeroes the log-decay of the other rows, so rows that are not written are not decayed either.
    """
    dtype = torch.promote_types(k_logits.dtype, torch.float32)
    k_logits = k_logits.to(dtype)
    if row_topk is None:
        return torch.softmax(k_logits, -1), log_decay.to(dtype)
    rows = torch.topk(k_logits, row_topk, dim=-1).indices
    keep = torch.zeros_like(k_logits, dtype=torch.bool).scatter_(-1, rows, True)
    keys = torch.softmax(k_logits.masked_fill(~keep, float("-inf")), -1)
    return keys, log_decay.to(dtype) * keep


def replayed_selection(routes: torch.Tensor, router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The partitions [B, T, K] each token selects under partition replay: `routes` [B, T, K], the rollout
    engine's choice, where it has one, and the top-K of the layer's own router logits where it has none (-1: a
    token the engine never computed, such as a completion's last, or padding)."""
    own = router_logits.topk(top_k, -1).indices
    return torch.where(routes[..., :1] >= 0, routes.to(own.dtype), own)


def balance_loss(router_logits: torch.Tensor, top_k: int, token_mask: torch.Tensor | None,
                 chosen_index: torch.Tensor | None = None, norm: str = "mean_over_layers"):
    """The alpha-free balance term N * sum_i f_i P_i over non-pad tokens, averaged over layers ("mean_over_layers")
    or summed over layers and divided by K ("sum_over_layers_div_k": the SSE authors' aux loss, flash-linear-attention
    PR #882 at 741fbbf, fla/layers/sse.py and fla/models/sse/modeling_sse.py), and the usage f [layers, N] for
    logging, from the SSE layers' router logits stacked [layers, B, T, N] (all layers in one go: per layer, these
    ~15 small ops each way were a visible share of the training step's host time).

    f_i is the fraction of tokens routed to partition i (sums to K, the partitions written), P_i the mean router
    probability; the choice is the top-K of the logits, or `chosen_index` [layers, B, T, K] where the caller has it
    already."""
    N = router_logits.shape[-1]
    logits = router_logits.reshape(router_logits.shape[0], -1, N)
    probs = torch.softmax(logits.float(), -1)
    index = logits.topk(top_k, -1).indices if chosen_index is None else chosen_index.reshape(*logits.shape[:2], -1)
    chosen = torch.zeros_like(probs).scatter_(-1, index, 1.0)
    if token_mask is None:
        usage, mean_prob = chosen.mean(1), probs.mean(1)
    else:
        weight = token_mask.reshape(1, -1, 1).float()
        count = weight.sum().clamp(min=1)
        usage, mean_prob = (chosen * weight).sum(1) / count, (probs * weight).sum(1) / count
    per_layer = N * (usage * mean_prob).sum(-1)
    total = per_layer.mean() if norm == "mean_over_layers" else per_layer.sum() / top_k
    return total, usage.detach()
