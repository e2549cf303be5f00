"""bench/route_flips.py: bf16 against float32 logprobs and routes of one checkpoint."""
import copy

import torch

from bench import route_flips
from sse_model import SSEConfig, SSEForCausalLM
from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER
from sse_model.modeling_sse import SSELayer

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
            sse_num_partitions=4, sse_top_k=1, sse_lora_rank=4, max_position_embeddings=512, vocab_size=64,
            num_hidden_layers=3, layer_types=[SSE_LAYER, ATTENTION_LAYER, SSE_LAYER])


def test_tokens_since_flip_counts_from_the_predicting_token():
    flipped = torch.tensor([False, True, False, False, True, False])
    since = route_flips.tokens_since_flip(flipped).tolist()
    assert since[0] > 1000  # token 1 is predicted by token 0, which did not flip and has none before it
    assert since[1:] == [1, 2, 3, 1]


def test_a_model_against_itself_has_no_flips_and_the_router_patch_is_undone():
    torch.manual_seed(0)
    model = SSEForCausalLM(SSEConfig(**TINY)).eval()
    sequences = [torch.randint(0, 64, (40,)).tolist() for _ in range(2)]
    same = route_flips.compare(model, copy.deepcopy(model), sequences)
    assert same["route_flip_rate"] == 0.0 and same["max"] == 0.0 and same["tokens"] == 2 * 39
    assert same["top 1%"]["share with a flip within 16"] == 0.0
    original = SSELayer.project
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    x = torch.randn(1, 5, 64, dtype=torch.bfloat16)
    assert bf16.model.layers[0].linear_attn.project(x)[0]["router_logits"].dtype == torch.float32
    undo = route_flips.router_rounded_to_model_dtype(SSELayer)
    try:
        assert bf16.model.layers[0].linear_attn.project(x)[0]["router_logits"].dtype == torch.bfloat16
        patched = route_flips.compare(model, bf16, sequences)
        assert 0.0 < patched["max"] and torch.isfinite(torch.tensor(patched["mean"]))
    finally:
        undo()
    assert SSELayer.project is original
