"""SSE state diagnostics (sse_model/diagnostics.py) and the eval stage's state report (eval/state.py)."""
import json
import math

import pytest
import torch

from sse_model import SSEConfig, SSEForCausalLM
from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER
from sse_model.diagnostics import routed_partitions, singular_value_entropy, state_entropy
from tasks.tokenizer import train_tokenizer
from tiny_checkpoints import save_checkpoint

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
            sse_num_partitions=4, sse_top_k=1, sse_lora_rank=4, max_position_embeddings=512)


def test_singular_value_entropy_hand_worked():
    c = 8
    rank_one = torch.outer(torch.randn(c), torch.randn(c))
    spread = torch.linalg.qr(torch.randn(c, c)).Q * 3.0  # c equal singular values
    two = torch.diag(torch.tensor([3.0, 1.0] + [0.0] * (c - 2)))  # p = 3/4, 1/4
    h = singular_value_entropy(torch.stack([rank_one, spread, two, torch.zeros(c, c)]))
    expected = [0.0, math.log(c), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), 0.0]
    assert h.dtype == torch.float64 and torch.allclose(h, torch.tensor(expected, dtype=torch.float64), atol=1e-6)


def test_state_entropy_per_layer_and_partition():
    """After a sequence, every partition a token was routed to has a state with entropy in (0, ln c]; the shape
    is [SSE layers, N + shared]; a model without SSE layers is refused."""
    config = SSEConfig(**TINY, num_hidden_layers=3, layer_types=[SSE_LAYER, ATTENTION_LAYER, SSE_LAYER],
                       vocab_size=64)
    torch.manual_seed(0)
    model = SSEForCausalLM(config).eval()
    sequences = [torch.randint(0, 64, (n,)).tolist() for n in (40, 1, 97)]
    h = state_entropy(model, sequences)
    assert h.shape == (2, 5) and bool(torch.isfinite(h).all())
    assert bool((h >= 0).all() and (h <= math.log(32) + 1e-6).all())
    assert bool((h[:, -1] > 0).all()), "every token writes the shared partition"
    # one sequence's value is the mean over heads of the float64 entropy of the cache's final states
    from sse_model.modeling_sse import SSECache
    cache = SSECache(config)
    with torch.no_grad():
        model(input_ids=torch.tensor([sequences[0]]), past_key_values=cache, use_cache=True)
    direct = singular_value_entropy(cache.sse_state(2)[0]).mean(0).float()
    assert torch.allclose(state_entropy(model, sequences[:1])[1], direct)
    transformer = SSEForCausalLM(SSEConfig(**TINY, num_hidden_layers=1, layer_types=[ATTENTION_LAYER],
                                           vocab_size=64))
    with pytest.raises(ValueError, match="no SSE layer"):
        state_entropy(transformer, sequences)


def test_state_report_from_eval_samples(tmp_path):
    """eval/state.py: prompt + first sample of the first problems, a table per dataset in state.md; None for a
    model without SSE layers."""
    from eval.runner import samples_path
    from eval.state import state_report
    tokenizer = train_tokenizer(["What is 1+1? The answer is \\boxed{2}."] * 4, vocab_size=300)
    hybrid = save_checkpoint(tmp_path / "hybrid", SSEConfig(**TINY, num_hidden_layers=2,
                                                            layer_types=[SSE_LAYER, ATTENTION_LAYER]),
                             tokenizer=tokenizer)
    problems = tmp_path / "toy.jsonl"
    problems.write_text("".join(json.dumps({"id": f"q{i}", "problem": f"What is {i}+1?", "answer": str(i + 1)})
                                + "\n" for i in range(5)))
    out = tmp_path / "eval"
    out.mkdir()
    samples_path(out, "toy").write_text("".join(
        json.dumps({"id": f"q{i}", "sample": j, "completion": f"{i} plus 1 is \\boxed{{{i + j}}}"}) + "\n"
        for i in range(5) for j in range(2)))
    report = state_report(str(hybrid), [str(problems)], out, problems=3)
    assert list(report) == ["toy"] and len(report["toy"]) == 1 and len(report["toy"][0]) == 5
    more = state_report(str(hybrid), [str(problems)], out, problems=50)  # only the 5 problems with samples
    assert more["toy"] != report["toy"]
    table = (out / "state.md").read_text()
    assert "| toy: layer | p0 | p1 | p2 | p3 | shared |" in table and "\n| 0 | " in table
    transformer = save_checkpoint(tmp_path / "transformer", SSEConfig(**TINY, num_hidden_layers=1,
                                                                      layer_types=[ATTENTION_LAYER]),
                                  tokenizer=tokenizer)
    assert state_report(str(transformer), [str(problems)], out, problems=3) is None


def test_routed_partitions_are_the_routers_top_k():
    """Per SSE layer and token, the router's top-K partitions (the first layer's recomputed from its own router
    logits); the two layers route differently; a model without SSE layers is refused."""
    config = SSEConfig(**{**TINY, "sse_top_k": 2}, num_hidden_layers=3,
                       layer_types=[SSE_LAYER, ATTENTION_LAYER, SSE_LAYER], vocab_size=64)
    torch.manual_seed(0)
    model = SSEForCausalLM(config).eval()
    ids = torch.randint(0, 64, (30,)).tolist()
    picks = routed_partitions(model, ids)
    assert picks.shape == (2, 30, 2) and bool(((picks >= 0) & (picks < 4)).all())
    assert bool((picks[..., 0] != picks[..., 1]).all()), "top-2 picks must be two partitions"
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor([ids])))
    logits = x @ model.model.layers[0].linear_attn.router.weight.T
    assert torch.equal(picks[0], logits[0].topk(2, -1).indices)
    assert not torch.equal(picks[0], picks[1])
    dense = SSEForCausalLM(SSEConfig(**TINY, num_hidden_layers=1, layer_types=[ATTENTION_LAYER], vocab_size=64))
    with pytest.raises(ValueError, match="no SSE layer"):
        routed_partitions(dense, ids)
