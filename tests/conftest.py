"""Shared test helpers: random SSE inputs, relative error that never lets NaN pass, and the shared data folder."""
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SHARED_DATA = Path(os.environ.get("SSE_RL_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def shared_data_file(name: str) -> Path:
    """A file of ../shared/data. Outside CI a missing folder skips the test; under CI (CI=true) it fails."""
    path = SHARED_DATA / name
    if not path.exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{path} is missing: CI must have ../shared/data next to the checkout")
        pytest.skip(f"{path} not present (../shared/data is needed for this test)")
    return path


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e||, computed in float64; NaN or inf anywhere gives inf so no comparison can pass on it."""
    a, e = actual.double(), expected.double()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("inf")
    return float((a - e).norm() / e.norm().clamp(min=1e-300))


def sse_inputs(B, T, H, c, dv, N, *, shared=True, dtype=torch.float64, seed=0, requires_grad=False,
               never_route=()):
    """Fresh random inputs for `kernels.sse_attention`. `never_route` partitions get a large negative router bias
    so no token selects them (empty partitions)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    router = r(B, T, N)
    for p in never_route:
        router[..., p] -= 50.0
    x = dict(q=r(B, T, H, c), k_logits=r(B, T, H, c), v=r(B, T, H, dv),
             log_decay=F.logsigmoid(r(B, T, H, c) + 2) / 4, router_logits=router)
    if shared:
        x.update(q_shared=r(B, T, H, c), k_shared_logits=r(B, T, H, c))
    return {k: v.to(dtype).requires_grad_(requires_grad) for k, v in x.items()}
