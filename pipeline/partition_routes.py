"""Partition routes in GRPO: the engine's routes replayed in the trainer's forwards (`grpo.partition_replay`), the
route-flip rate between engine and trainer (`grpo.route_flip_rate`), and the routing-health statistics every
training forward logs (docs/pipeline.md, "Partition replay and routing health").

The engine records the routes of every token it computes (sse_model/vllm/routes.py); `pipeline.trl_seams` takes
them after each rollout, in the order of the completions, and aligns them with TRL's batch layout
(`aligned_routes`), where they travel with the batch as `partition_routes`. `RouteFeed` hands each of the trainer's
backbone forwards its rows: as the selection to replay (`SSEModel.forward(partition_routes=)`) and to count the
routes the trainer's own router would have chosen otherwise.
"""
import math

import numpy as np
import torch

NO_ROUTE = -1


def aligned_routes(routes: list[np.ndarray | None], attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T, SSE layers, K] routes in TRL's layout from each completion's routes [positions, layers, K] (position 0
    its prompt's first token): a row's tokens start at its first unmasked position (prompts are left-padded,
    completions follow them); NO_ROUTE wherever the engine recorded none (padding, a completion's last token)."""
    shape = next((r.shape[1:] for r in routes if r is not None), None)
    if shape is None:
        raise RuntimeError("the rollout engine recorded no partition routes for this batch (is it built with "
                           "additional_config={'sse_record_routes': True}?)")
    B, T = attention_mask.shape
    out = torch.full((B, T, *shape), NO_ROUTE, dtype=torch.long)
    starts = attention_mask.long().argmax(1).tolist()
    for i, (row, start) in enumerate(zip(routes, starts, strict=True)):
        if row is not None:
            n = min(len(row), T - start)
            out[i, start:start + n] = torch.from_numpy(row[:n].astype(np.int64))
    return out.to(attention_mask.device)


def route_flips(choices: torch.Tensor, routes: torch.Tensor, mask: torch.Tensor | None):
    """(flipped, counted) per SSE layer [L]: the tokens whose set of partitions in the trainer's own choice
    (`choices` [L, B, T, K], the top-K of its router logits) differs from the engine's (`routes` [B, T, L, K]),
    over the tokens the engine routed and `mask` [B, T] keeps."""
    routes = routes.permute(2, 0, 1, 3)
    valid = routes[..., 0] >= 0
    if mask is not None:
        valid = valid & mask.bool()[None]
    differ = (choices.sort(-1).values != routes.sort(-1).values).any(-1)
    return (differ & valid).sum((1, 2)), valid.sum((1, 2))


def partition_set_counts(choices: torch.Tensor, num_partitions: int, mask: torch.Tensor | None) -> torch.Tensor:
    """[L, N**K]: per SSE layer, how many tokens chose each set of K partitions (`choices` [L, B, T, K], the tokens
    `mask` [B, T] keeps), counted on the device without a host synchronisation, so it can run on every training
    forward and be read once per log."""
    L, K = choices.shape[0], choices.shape[-1]
    sets = num_partitions ** K
    powers = num_partitions ** torch.arange(K, device=choices.device)
    codes = (choices.sort(-1).values * powers).sum(-1)  # one integer per set of partitions: [L, B, T]
    codes = codes + sets * torch.arange(L, device=codes.device).view(L, 1, 1)
    if mask is not None:
        codes = codes[:, mask.bool()]
    counts = torch.zeros(L * sets, dtype=torch.long, device=codes.device)
    return counts.index_add_(0, codes.flatten(), torch.ones_like(codes.flatten())).view(L, sets)


def routing_health(usage: torch.Tensor, set_counts: torch.Tensor) -> dict[str, float]:
    """Per SSE layer: the entropy (nats) of partition usage (`usage` [L, N], fractions of tokens summing to K,
    normalised to a distribution: log N is uniform, 0 one partition for everything) and the share of tokens whose
    set of K partitions is the layer's most common set (`set_counts` from `partition_set_counts`; a router that
    collapses onto one set takes it to 1)."""
    p = usage.float() / usage.float().sum(-1, keepdim=True).clamp(min=1e-12)
    entropy = -(p * p.clamp(min=1e-12).log()).sum(-1)
    modal = set_counts.max(-1).values / set_counts.sum(-1).clamp(min=1)
    out = {}
    for layer in range(usage.shape[0]):
        out[f"routing/usage_entropy/{layer}"] = round(float(entropy[layer]), 4)
        out[f"routing/modal_set_share/{layer}"] = round(float(modal[layer]), 4)
    return out


class RouteFeed:
    """While entered: each forward of `backbone` (the SSEModel) gets the next rows of `source(offset, count,
    attention_mask)` ([count, T, layers, K] routes) as the selection to replay when `replay`, and `on_flips(flipped,
    counted)` is told how the trainer's own choices differ from them. Forwards take the rows in order, as TRL's
    log-probability passes walk their batch in slices; a forward for which the source has no routes yet (None: the
    parity probe after a weight push, before the rollout) runs as it would without the feed and takes none."""

    def __init__(self, backbone, source, *, replay: bool, on_flips=None):
        self.backbone, self.source, self.replay, self.on_flips = backbone, source, replay, on_flips
        self.offset, self.current, self.handles = 0, None, []

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(ids.shape[:2], dtype=torch.long, device=ids.device)
        rows = self.source(self.offset, ids.shape[0], mask)
        if rows is None:
            return args, kwargs
        self.current = (rows, mask)
        self.offset += ids.shape[0]
        if self.replay:
            kwargs["partition_routes"] = self.current[0]
        return args, kwargs

    def _after(self, module, args, output):
        choices = getattr(output, "partition_choices", None)
        if self.on_flips is not None and choices is not None and self.current is not None:
            routes, mask = self.current
            self.on_flips(*route_flips(choices, routes, mask))
        self.current = None

    def __enter__(self):
        self.handles = [self.backbone.register_forward_pre_hook(self._before, with_kwargs=True),
                        self.backbone.register_forward_hook(self._after)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


def flip_metrics(flipped: torch.Tensor, counted: torch.Tensor) -> dict[str, float]:
    """The route-flip rate of each SSE layer and of all together: the share of routed tokens whose set of partitions
    differs between engine and trainer."""
    total = int(counted.sum())
    out = {"routing/flip_rate": float(flipped.sum()) / total if total else math.nan}
    out.update({f"routing/flip_rate/{layer}": float(f) / int(c) for layer, (f, c) in
                enumerate(zip(flipped.tolist(), counted.tolist())) if c})
    return out
