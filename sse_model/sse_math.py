"""The SSE layer's elementwise math around the operator (docs/model.md, "The layer"), written once for the HF model
(`modeling_sse.SSELayer`) and the vLLM model (`vllm_model.SSELinearAttention`), whose projections differ
(`nn.Linear` against vLLM's parallel linear layers) but must feed the operator and the output the same values.
The decay's log a = logsigmoid(x) / normaliser is the operators' own step (`kernels.sse.log_decay_from_logits`,
fused in the Triton paths): both models pass x."""
import torch
import torch.nn.functional as F


def shared_partition_qk(q: torch.Tensor, k_logits: torch.Tensor, q_lora: torch.Tensor | None,
                        k_lora: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared partition's q and key logits: the routed ones plus a low-rank term (none when the rank is 0)."""
    if q_lora is None:
        return q, k_logits
    return q + q_lora, k_logits + k_lora


def gated_output(o_normed: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """The per-head-normalised operator output times the swish output gate (before W_o). The HF model's training
    runs this step fused with the norm (`kernels.norm_gate`, tested against this math in tests/test_model.py)."""
    return o_normed * F.silu(gate_logits)
