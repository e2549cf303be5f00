"""The SSE authors' model in plain torch, and tiny checkpoints in their format, for the conversion tests.

A transcription of flash-linear-attention pull request #882 at commit 741fbbf (not merged): the GLA-flavoured SSE
layer `SSEGLA` of fla/layers/sse.py on its mask path (`sse_linear_attention_mask` with fla/ops/sse/mask.py
`softmax_and_mask`), the block and model of fla/models/sse/modeling_sse.py (`SSEBlock`, `SSEModel`,
`SSEForCausalLM`), fla's `Attention` (fla/layers/attn.py, its RoPE fla/modules/rotary.py non-interleaved),
`GatedMLP` (fla/modules/mlp.py), `RMSNorm` and `FusedRMSNormGated` (swish gate). fla itself is not imported (it
needs a GPU); the GLA recurrence is written as its definition, o_t = K^-1/2 q_t S_t with
S_t = diag(exp(g_t)) S_(t-1) + k_t^T v_t, as fla's chunk_gla / fused_recurrent_gla compute it. Nothing here
comes from the project's kernels, so the conversion is checked against an independent computation.
"""
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

# A config.json as fla's SSEConfig.to_json_string writes it (fla/models/sse/configuration_sse.py at 741fbbf), tiny.
AUTHORS_CONFIG = {
    "architectures": ["SSEForCausalLM"], "model_type": "sse", "attn_mode": "chunk", "hidden_size": 64,
    "expand_v": 1.0, "use_output_gate": True, "use_short_conv": False, "allow_neg_eigval": False, "conv_size": 4,
    "head_dim": 16, "num_heads": 4, "num_v_heads": None, "num_sparse_partition": 4, "num_writer": 2,
    "num_reader": 2, "linear_attn_type": "gla", "sse_implementation": "varlen", "aux_loss_coef": 0.01,
    "max_position_embeddings": 2048, "hidden_ratio": 4, "intermediate_size": None, "hidden_act": "swish",
    "num_hidden_layers": 3, "norm_eps": 1e-6,
    "attn": {"layers": [1], "num_heads": 2, "num_kv_heads": 1, "qkv_bias": False, "window_size": None,
             "rope_theta": 10000.0},
    "use_cache": True, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "initializer_range": 0.02, "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": True,
    "fuse_linear_cross_entropy": False, "use_l2warp": False, "vocab_size": 97, "torch_dtype": "float32",
    "transformers_version": "4.53.2",
}
GATE_RANK, NORMALIZER = 16, 16.0  # SSEGLA's gate_low_rank_dim and gate_logit_normalizer defaults


def intermediate_size(cfg):
    if cfg["intermediate_size"] is not None:
        return cfg["intermediate_size"]
    return 256 * math.ceil(int(cfg["hidden_size"] * cfg["hidden_ratio"] * 2 / 3) / 256)


def authors_weights(cfg, seed=0, scale=0.3):
    """Random weights under the names fla's SSEForCausalLM saves (std `scale`, norms around 1, biases random)."""
    g = torch.Generator().manual_seed(seed)
    D, H, c = cfg["hidden_size"], cfg["num_heads"], cfg["head_dim"]
    dv = int(c * cfg["expand_v"])
    N, V, width = cfg["num_sparse_partition"], cfg["vocab_size"], intermediate_size(cfg)

    def r(*shape, std=scale):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embeddings.weight": r(V, D, std=1.0), "model.norm.weight": 1 + r(D, std=0.1),
         "lm_head.weight": r(V, D)}
    attn = cfg["attn"] or {"layers": []}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "attn_norm.weight": 1 + r(D, std=0.1), p + "mlp_norm.weight": 1 + r(D, std=0.1),
              p + "mlp.gate_proj.weight": r(width, D), p + "mlp.up_proj.weight": r(width, D),
              p + "mlp.down_proj.weight": r(D, width)}
        if i in attn["layers"]:
            hd = D // attn["num_heads"]
            kv = attn["num_kv_heads"] * hd
            w |= {p + "attn.q_proj.weight": r(D, D), p + "attn.k_proj.weight": r(kv, D),
                  p + "attn.v_proj.weight": r(kv, D), p + "attn.o_proj.weight": r(D, D)}
            if attn["qkv_bias"]:
                w |= {p + "attn.q_proj.bias": r(D), p + "attn.k_proj.bias": r(kv), p + "attn.v_proj.bias": r(kv)}
            continue
        a = p + "attn."
        w |= {a + "q_proj.weight": r(H * c, D), a + "k_proj.weight": r(H * c, D), a + "v_proj.weight": r(H * dv, D),
              a + "lora_q_proj.0.weight": r(dv, D), a + "lora_q_proj.1.weight": r(H * c, dv),
              a + "lora_k_proj.0.weight": r(dv, D), a + "lora_k_proj.1.weight": r(H * c, dv),
              a + "e_proj.weight": r(N, D, std=1.0),
              a + "g_proj.0.weight": r(dv, D), a + "g_proj.1.weight": r(H * dv, dv),
              a + "o_norm.weight": 1 + r(dv, std=0.1), a + "o_proj.weight": r(D, H * dv)}
        for j in range(2):  # gk_proj[0]: the shared partition's decay, gk_proj[1]: the routed partitions'
            w |= {a + f"gk_proj.{j}.0.weight": r(GATE_RANK, D), a + f"gk_proj.{j}.1.weight": r(H * c, GATE_RANK),
                  a + f"gk_proj.{j}.1.bias": r(H * c, std=2.0) + 2.0}
    return w


def save_authors_checkpoint(path, cfg=None, seed=0, dtype=torch.float32):
    """A tiny checkpoint in the authors' save_pretrained layout: config.json and model.safetensors."""
    cfg = dict(AUTHORS_CONFIG if cfg is None else cfg)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = authors_weights(cfg, seed)
    if cfg["tie_word_embeddings"]:
        weights.pop("lm_head.weight")
    save_file({n: t.to(dtype).contiguous() for n, t in weights.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg, weights


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(x, w, name):
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def gla(q, k, v, g):
    """fla's GLA: [B, T, H, K] q, k, g (log-decay), [B, T, H, V] v -> o [B, T, H, V], zero initial state."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        S = g[:, t].exp()[..., None] * S + k[:, t][..., None] * v[:, t][..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K**-0.5, S))
    return torch.stack(out, 1)


def sse_gla_layer(x, w, a, cfg):
    """fla/layers/sse.py SSEGLA.forward (mask path), no cache, no padding."""
    H = cfg["num_heads"]
    N, writers, readers = cfg["num_sparse_partition"], cfg["num_writer"], cfg["num_reader"]

    def heads(t):
        return t.unflatten(-1, (H, -1))
    q1, k1 = linear(x, w, a + "q_proj"), linear(x, w, a + "k_proj")
    q2 = q1 + linear(linear(x, w, a + "lora_q_proj.0"), w, a + "lora_q_proj.1")
    k2 = k1 + linear(linear(x, w, a + "lora_k_proj.0"), w, a + "lora_k_proj.1")
    v = linear(x, w, a + "v_proj")
    gk1, gk2 = (linear(linear(x, w, a + f"gk_proj.{j}.0"), w, a + f"gk_proj.{j}.1") for j in range(2))
    eta = linear(x, w, a + "e_proj")
    q1, q2, k1, k2, gk1, gk2 = map(heads, (q1, q2, k1, k2, gk1, gk2))
    v = F.silu(heads(v))
    q1, q2 = F.silu(q1), F.silu(q2)
    k1, k2 = k1.softmax(-1), k2.softmax(-1)
    gk1, gk2 = F.logsigmoid(gk1) / NORMALIZER, F.logsigmoid(gk2) / NORMALIZER
    # softmax_and_mask: routed partition n gets q e_n [read], k e_n [written], v [written], g [written]
    e = eta.float().softmax(-1)
    order = e.argsort(-1, descending=True).argsort(-1)  # rank of each partition
    mask_w, mask_r = (order < writers).to(x.dtype), (order < readers).to(x.dtype)
    o = gla(q1, k1, v, gk1)
    for n in range(N):
        ew, er = (e[..., n] * mask_w[..., n])[..., None, None], (e[..., n] * mask_r[..., n])[..., None, None]
        wn = mask_w[..., n, None, None]
        o = o + gla(q2 * er, k2 * ew, v * wn, gk2 * wn)
    gate = heads(linear(linear(x, w, a + "g_proj.0"), w, a + "g_proj.1"))
    o = rms_norm(o, w[a + "o_norm.weight"], cfg["norm_eps"]) * F.silu(gate)  # FusedRMSNormGated, swish
    return linear(o.flatten(-2), w, a + "o_proj")


def rotary(x, theta):
    """fla's RotaryEmbedding (non-interleaved) at positions 0 ... T-1: x [B, T, heads, d]."""
    d, T = x.shape[-1], x.shape[1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos()[None, :, None].to(x.dtype), freqs.sin()[None, :, None].to(x.dtype)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def attention_layer(x, w, a, attn, D):
    """fla/layers/attn.py Attention.forward (causal flash attention, GQA), no cache, no padding."""
    hd = D // attn["num_heads"]
    q, k, v = (linear(x, w, a + n).unflatten(-1, (-1, hd)) for n in ("q_proj", "k_proj", "v_proj"))
    q, k = rotary(q, attn["rope_theta"]), rotary(k, attn["rope_theta"])
    groups = attn["num_heads"] // attn["num_kv_heads"]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return linear(o.transpose(1, 2).flatten(-2), w, a + "o_proj")


def authors_forward(ids, cfg, w):
    """fla/models/sse/modeling_sse.py SSEForCausalLM.forward(ids): (logits, the aux loss before aux_loss_coef).
    The aux loss as SSEGLA makes it in training, sum_n(mean p_n * mean mask_w_n) * N / num_writer per SSE layer,
    summed over the layers."""
    eps, D = cfg["norm_eps"], cfg["hidden_size"]
    attn = cfg["attn"] or {"layers": []}
    N, writers = cfg["num_sparse_partition"], cfg["num_writer"]
    x = F.embedding(ids, w["model.embeddings.weight"])
    aux = x.new_zeros(())
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        if i in attn["layers"]:
            h = attention_layer(h, w, p + "attn.", attn, D)
        else:
            e = linear(h, w, p + "attn.e_proj").float().softmax(-1)
            mask_w = torch.zeros_like(e).scatter_(-1, e.topk(writers, -1).indices, 1.0)
            aux = aux + (e.mean((0, 1)) * mask_w.mean((0, 1))).sum() * N / writers
            h = sse_gla_layer(h, w, p + "attn.", cfg)
        x = x + h
        h = rms_norm(x, w[p + "mlp_norm.weight"], eps)
        x = x + linear(F.silu(linear(h, w, p + "mlp.gate_proj")) * linear(h, w, p + "mlp.up_proj"), w,
                       p + "mlp.down_proj")
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embeddings.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return F.linear(x, head), aux
