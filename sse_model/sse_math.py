"""The SSE layer's elementwise math around the operator (docs/model.md, "The layer"), written once for the HF model
(`modeling_sse.SSELayer`) and the vLLM model (`sse_model.vllm.model.SSELinearAttention`), whose projections differ
(`nn.Linear` against vLLM's parallel linear layers) but must feed the operator and the output the same values.
The decay's log a = logsigmoid(x) / normaliser is the operators' own step (`kernels.sse.log_decay_from_logits`,
fused in the Triton paths): both models pass x."""
import torch
import torch.nn.functional as F


def shared_partition(routed: torch.Tensor, low_rank: torch.Tensor | None) -> torch.Tensor:
    """The shared partition's q (or key logits): the routed one plus a low-rank term (none when the rank is 0)."""
    return routed if low_rank is None else routed + low_rank


def qv_activation(kind: str):
    """The activation on q (both partitions' q, after the shared partition's low-rank term) and v: identity, or
    SiLU as the SSE authors' layer (`SSEConfig.sse_qv_activation`)."""
    return F.silu if kind == "silu" else _identity


def _identity(x):
    return x


def gated_output(o_normed: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """The per-head-normalised operator output times the swish output gate (before W_o). The HF model's training
    runs this step fused with the norm (`kernels.norm_gate`, tested against this math in tests/test_model.py)."""
    return o_normed * F.silu(gate_logits)
