"""Partition routes from the engine: which partitions each token selected in every SSE layer, per request, for
the trainer to replay (partition replay, docs/vllm-backend.md) or to compare with its own (the route-flip rate).

On when the engine is built with `additional_config={"sse_record_routes": True}` (vLLM's config field for plugins,
`RECORD_ROUTES`). Each SSE layer writes its tokens' top-K of the router logits it routes with into one step buffer
[tokens, SSE layers, K] on the device (a copy of the choice the kernels make, from the same float32 logits, and no
host work: CUDA graphs replay the writes); after the step's forward the model runner hands the step's request ids,
token counts and positions to `end_step` (`seams.record_routes_per_request`), which keeps device copies without
waiting for the device. `take` assembles them per request, by position (a preempted request computed again
overwrites its rows), and forgets them: `seams.take_routes(llm)` calls it after generate.
"""
import numpy as np
import torch

RECORD_ROUTES = "sse_record_routes"
NO_ROUTE = -1  # a position the engine never computed (a completion's last token, a prefix-cache hit)


def records_routes(vllm_config) -> bool:
    extra = vllm_config.additional_config
    return isinstance(extra, dict) and bool(extra.get(RECORD_ROUTES, False))


class RouteRecorder:
    def __init__(self, num_layers: int, top_k: int, max_tokens: int):
        self.num_layers, self.top_k, self.max_tokens = num_layers, top_k, max_tokens
        self.step = None  # [max_tokens, layers, K] int16, on the forward's device from its first write
        self.steps = []   # (request ids, query start offsets [requests + 1], positions [T], routes [T, layers, K])

    def write(self, layer: int, router_logits: torch.Tensor) -> None:
        """The top-K partitions of a step's tokens [T, N] in SSE layer `layer` (its index among the SSE layers)."""
        if self.step is None:
            self.step = torch.full((self.max_tokens, self.num_layers, self.top_k), NO_ROUTE, dtype=torch.int16,
                                   device=router_logits.device)
        T = router_logits.shape[0]
        self.step[:T, layer] = router_logits.topk(self.top_k, -1).indices.to(torch.int16)

    def end_step(self, request_ids: list[str], query_start: np.ndarray, positions: torch.Tensor) -> None:
        T = int(query_start[-1])
        if T and self.step is not None:
            self.steps.append((list(request_ids), np.asarray(query_start).copy(), positions[:T].clone(),
                               self.step[:T].clone()))

    def take(self) -> dict[str, np.ndarray]:
        """{engine request id: routes [positions, layers, K] int16, NO_ROUTE where it computed none}; forgets all."""
        rows = {}
        for request_ids, query_start, positions, routes in self.steps:
            positions, routes = positions.cpu().numpy(), routes.cpu().numpy()
            for i, request in enumerate(request_ids):
                span = slice(query_start[i], query_start[i + 1])
                rows.setdefault(request, []).append((positions[span], routes[span]))
        self.steps = []
        out = {}
        for request, parts in rows.items():
            length = max(int(p.max()) + 1 for p, _ in parts if len(p))
            table = np.full((length, self.num_layers, self.top_k), NO_ROUTE, dtype=np.int16)
            for p, r in parts:
                table[p] = r
            out[request] = table
        return out
