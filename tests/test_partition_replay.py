"""Partition replay (issue 75, item 4): the SSE operator and the HF model select the partitions they are given,
while the router's softmax stays in the graph."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import rel_err, sse_inputs
from kernels import sse_attention
from kernels.sse import route
from kernels.sse.routing import selection_scores
from sse_model import SSEConfig, SSEForCausalLM
from sse_model.configuration_sse import ATTENTION_LAYER, SSE_LAYER

H, C, DV = 2, 8, 4


def other_routes(router_logits, top_k, seed=0):
    """Partitions [B, T, K] that differ from the top-K of `router_logits` at most tokens: a random K-subset."""
    g = torch.Generator().manual_seed(seed)
    N = router_logits.shape[-1]
    return torch.rand(*router_logits.shape[:-1], N, generator=g).argsort(-1)[..., :top_k]


def test_selection_scores_top_k_is_the_index_in_order():
    index = torch.tensor([[[3, 0], [1, 2]]])
    assert torch.equal(torch.topk(selection_scores(index, 5), 2, -1).indices, index)


@pytest.mark.parametrize("impl", ["reference", "chunk_torch_varlen", "chunk_torch_mask"])
@pytest.mark.parametrize("N,K,shared,cu", [(4, 1, True, None), (8, 2, True, [0, 5, 5, 23]), (3, 3, False, None)])
def test_operator_selects_the_replayed_partitions(impl, N, K, shared, cu):
    B = 1 if cu else 2
    x = sse_inputs(B, 23, H, C, DV, N, shared=shared, seed=N * 10 + K, requires_grad=True)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    routes = other_routes(x["router_logits"], K)
    o, final = sse_attention(**x, top_k=K, route_index=routes, output_final_state=True, cu_seqlens=cu_seqlens,
                             impl=impl)
    # every path agrees with the float64 reference on the replayed selection
    o_ref, final_ref = sse_attention(**x, top_k=K, route_index=routes, output_final_state=True,
                                     cu_seqlens=cu_seqlens, impl="reference")
    assert rel_err(o, o_ref) < 1e-10 and rel_err(final, final_ref) < 1e-10
    selected = torch.zeros_like(x["router_logits"], dtype=torch.bool).scatter_(-1, routes, True)
    # partitions no token selects keep a zero state (no initial state): the selection is the replayed one
    P = final.shape[2]
    used = torch.zeros(P, dtype=torch.bool)
    used[:N] = selected.reshape(-1, N).any(0)
    if shared:
        used[N] = True
    assert (final[:, :, ~used] == 0).all()
    if K < N:  # the replay changes the output, so it is not the router's own top-K
        o_own, _ = sse_attention(**x, top_k=K, cu_seqlens=cu_seqlens, impl=impl)
        assert rel_err(o_own, o) > 1e-3
    # the router still gets its gradient, through the selected partitions' softmax weights
    grad, = torch.autograd.grad(o.sum(), x["router_logits"])
    assert grad.abs().sum() > 0


def test_operator_replaying_its_own_choice_changes_nothing():
    x = sse_inputs(2, 19, H, C, DV, 4, seed=3)
    own = route(x["router_logits"], 2)[1]
    for impl in ("reference", "chunk_torch_varlen", "chunk_torch_mask"):
        a, _ = sse_attention(**x, top_k=2, impl=impl)
        b, _ = sse_attention(**x, top_k=2, route_index=own, impl=impl)
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad,message", [(lambda r: r[..., :1], "route_index must be"),
                                         (lambda r: r.float(), "route_index must be"),
                                         (lambda r: r + 4, "outside")])
def test_bad_route_index_is_named(bad, message):
    x = sse_inputs(1, 5, H, C, DV, 4, seed=1)
    with pytest.raises(ValueError, match=message):
        sse_attention(**x, top_k=2, route_index=bad(route(x["router_logits"], 2)[1]))


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    config = SSEConfig(**{**dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                 layer_types=[SSE_LAYER, ATTENTION_LAYER, SSE_LAYER], num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=32, sse_num_heads=2, sse_key_dim=8,
                                 sse_value_dim=8, sse_num_partitions=4, sse_top_k=2, sse_lora_rank=4,
                                 pad_token_id=0), **overrides})
    return SSEForCausalLM(config).eval()


def test_model_replays_routes_and_keeps_its_own_where_none_is_given():
    model = tiny_model()
    ids = torch.randint(1, 61, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    own = model(ids, attention_mask=mask)
    choices = own.partition_choices  # [SSE layers, B, T, K]
    assert choices.shape == (2, 2, 13, 2)
    # its own choices given back: the same forward
    same = model(ids, attention_mask=mask, partition_routes=choices.permute(1, 2, 0, 3))
    assert torch.equal(same.logits, own.logits)
    # other routes: the forward follows them, and -1 rows keep the model's own choice
    routes = other_routes(torch.zeros(2, 13, 4), 2, seed=1)[:, :, None].expand(-1, -1, 2, -1).clone()
    replayed = model(ids, attention_mask=mask, partition_routes=routes)
    assert (replayed.logits - own.logits).abs().max() > 1e-4
    routes[:, 7:] = -1
    partial = model(ids, attention_mask=mask, partition_routes=routes)
    assert torch.allclose(partial.logits[:, :7], replayed.logits[:, :7], atol=1e-6)
    assert (partial.logits[:, 7:] - replayed.logits[:, 7:]).abs().max() > 1e-4


def test_replayed_router_gets_its_gradient():
    model = tiny_model().train()
    ids = torch.randint(1, 61, (2, 9))
    routes = other_routes(torch.zeros(2, 9, 4), 2)[:, :, None].expand(-1, -1, 2, -1)
    model(ids, partition_routes=routes).logits.sum().backward()
    for layer in (model.model.layers[0], model.model.layers[2]):
        assert layer.linear_attn.router.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- GRPO's side
def test_aligned_routes_follow_left_padded_prompts():
    from pipeline.partition_routes import aligned_routes
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    first = np.arange(3 * 2).reshape(3, 2, 1).astype(np.int16)   # 2 prompt tokens + completion, last one missing
    second = np.arange(6 * 2).reshape(6, 2, 1).astype(np.int16)
    out = aligned_routes([first, second], mask)
    assert out.shape == (2, 7, 2, 1)
    assert (out[0, :2] == -1).all() and torch.equal(out[0, 2:5], torch.from_numpy(first).long())
    assert (out[0, 5:] == -1).all()
    assert torch.equal(out[1, :6], torch.from_numpy(second).long()) and (out[1, 6] == -1).all()
    with pytest.raises(RuntimeError, match="recorded no partition routes"):
        aligned_routes([None, None], mask)


def test_route_flips_compare_sets_over_routed_kept_tokens():
    from pipeline.partition_routes import flip_metrics, route_flips
    choices = torch.tensor([[[[0, 1], [2, 3], [1, 0]]]])            # [L=1, B=1, T=3, K=2]
    routes = torch.tensor([[[[1, 0]], [[2, 1]], [[-1, -1]]]])       # same set, flipped, not routed
    flipped, counted = route_flips(choices, routes, None)
    assert flipped.tolist() == [1] and counted.tolist() == [2]
    flipped, counted = route_flips(choices, routes, torch.tensor([[1, 0, 1]]))
    assert flipped.tolist() == [0] and counted.tolist() == [1]
    assert flip_metrics(torch.tensor([1, 0]), torch.tensor([2, 2])) == {
        "routing/flip_rate": 0.25, "routing/flip_rate/0": 0.5, "routing/flip_rate/1": 0.0}


def test_routing_health_entropy_and_modal_set_share():
    from pipeline.partition_routes import partition_set_counts, routing_health
    usage = torch.tensor([[0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 0.0, 0.0]])  # K = 2: uniform; one pair
    choices = torch.tensor([[[[0, 1], [1, 0], [2, 3], [0, 1]]], [[[0, 1]] * 4]])  # [L=2, B=1, T=4, K=2]
    counts = partition_set_counts(choices, 4, torch.tensor([[1, 1, 1, 0]]))
    assert counts.shape == (2, 16) and counts.sum(-1).tolist() == [3, 3]
    # counts add up over forwards: a second forward of the same choices keeps the shares
    health = routing_health(usage, counts + partition_set_counts(choices, 4, torch.tensor([[1, 1, 1, 0]])))
    assert health["routing/usage_entropy/0"] == pytest.approx(math.log(4), abs=1e-4)
    assert health["routing/usage_entropy/1"] == pytest.approx(math.log(2), abs=1e-4)
    assert health["routing/modal_set_share/0"] == pytest.approx(2 / 3, abs=1e-4)  # {0, 1} twice of 3 kept
    assert health["routing/modal_set_share/1"] == 1.0


def test_route_feed_hands_each_sliced_forward_its_rows():
    """TRL scores a batch in slices; each backbone call gets the next rows of the routes, replayed, and the flips
    against the trainer's own choice are counted."""
    from pipeline.partition_routes import RouteFeed
    model = tiny_model()
    ids = torch.randint(1, 61, (4, 11))
    mask = torch.ones_like(ids)
    routes = other_routes(torch.zeros(4, 11, 4), 2, seed=2)[:, :, None].expand(-1, -1, 2, -1)
    whole = model(ids, attention_mask=mask, partition_routes=routes).logits
    seen = []
    with RouteFeed(model.model, lambda offset, count, m: routes[offset:offset + count], replay=True,
                   on_flips=lambda f, c: seen.append((f, c))):
        sliced = torch.cat([model(ids[i:i + 2], attention_mask=mask[i:i + 2]).logits for i in (0, 2)])
    assert torch.allclose(sliced, whole, atol=1e-6)
    assert len(seen) == 2 and all(int(c.sum()) == 2 * 2 * 11 for _, c in seen)
    assert sum(int(f.sum()) for f, _ in seen) > 0
    unreplayed = model(ids, attention_mask=mask).logits  # hooks removed on exit
    assert (unreplayed - whole).abs().max() > 1e-4


def test_partition_replay_bench_samples_past_the_checkpoints_positions(tmp_path):
    """bench.partition_replay end to end on CPU (float32: sampler and trainer agree, so replay changes nothing and
    neither mode flips a route), with --positions taking rollouts past the checkpoint's max_position_embeddings."""
    import os
    import subprocess
    import sys

    from tiny_checkpoints import save_checkpoint

    config = SSEConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       layer_types=[SSE_LAYER, ATTENTION_LAYER], num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32, sse_num_heads=2, sse_key_dim=16, sse_value_dim=16, sse_num_partitions=4,
                       sse_top_k=1, sse_shared_partition=True, sse_lora_rank=4, max_position_embeddings=64)
    path = save_checkpoint(tmp_path / "ckpt", config)
    run = subprocess.run([sys.executable, "-m", "bench.partition_replay", str(path), "--positions", "256",
                          "--max-tokens", "100", "--prompts", "2", "--dtype", "float32",
                          "--gpu-memory-utilization", "0.1"], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ, "PYTHONPATH": "."})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    title = next(line for line in lines if "rollouts," in line)
    assert "2 rollouts, 200 sampled tokens, float32" in title
    rows = {cells[0]: cells[1:] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| own routes")
             or line.startswith("| replayed"))}
    assert set(rows) == {"own routes", "replayed"}
    for flips_used, flips_own, kl, delta in rows.values():
        assert float(flips_used) == 0 and float(flips_own) == 0 and abs(float(kl)) < 1e-6 and float(delta) < 1e-3
