"""GPU correctness of every SSE Triton path at real shapes: `python -m kernels.tests_gpu` (needs CUDA and fla).

Training paths (triton_varlen, triton_mask), forward and every gradient, float32 and bfloat16 activations, for
H = 16, c = d_v = 128 and (N = 4, K = 1 + shared), (N = 8, K = 2 + shared):
- a varlen batch with T = 1, empty, short and ~1k-token segments with initial states, against the float64
  recurrent reference `sse_reference` on the GPU;
- one 32k-token sequence against the torch chunked path `chunk_torch_varlen` in float64 on the GPU (the token
  loop is too slow there); that path is itself tested against the reference in tests/test_sse_operator.py.
Decode (`sse_decode_triton`) against the reference for bf16/fp16/fp32 activations with skipped slots, plus a
CUDA-graph capture and replay. Router logits are float32 (bf16 ties would make top-K ambiguous).
Prints one line per check with relative errors ||x - ref|| / ||ref|| and exits non-zero if any check fails.
`--smoke` runs the same code on tiny shapes on CPU (TRITON_INTERPRET=1, torch GLA core) to test the script.
"""
import argparse
import functools
import os
import sys

import torch

TOL = {torch.float32: 1e-2, torch.bfloat16: 3e-2, torch.float16: 1e-2}  # fla computes float32 dots as tf32
failures = []


def rel(x, ref):
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def report(name, errors, tol):
    worst = max(errors.values())
    ok = worst < tol
    if not ok:
        failures.append(name)
    print(f"{'ok  ' if ok else 'FAIL'} {name:58s} max {worst:.1e}  " +
          " ".join(f"{k}={v:.1e}" for k, v in errors.items()), flush=True)


def make_inputs(T, H, c, dv, N, segments, device):
    """float32 inputs whose activations are exact in bf16, so one float64 reference serves every dtype.
    Key logits are distinct within each head (a permutation of a grid), so the row-sparse top-r has no ties."""
    bf16 = lambda *s: torch.randn(*s, device=device).bfloat16().float()  # noqa: E731
    keys = lambda: torch.rand(1, T, H, c, device=device).argsort(-1).float() * (4 / c) - 2  # noqa: E731
    log_decay = (torch.nn.functional.logsigmoid(torch.randn(1, T, H, c, device=device) * 2) / 16).bfloat16()
    return dict(q=bf16(1, T, H, c), k_logits=keys(), v=bf16(1, T, H, dv), log_decay=log_decay.float(),
                router_logits=torch.randn(1, T, N, device=device), q_shared=bf16(1, T, H, c),
                k_shared_logits=keys(), initial_state=torch.randn(segments, H, N + 1, c, dv, device=device))


def as_leaves(inputs, dtype):
    """The activations in `dtype` (router logits and states stay float32) as fresh leaves."""
    keep = ("router_logits", "initial_state")
    return {n: (x if n in keep else x.to(dtype)).detach().clone().requires_grad_() for n, x in inputs.items()}


def forward_backward(fn, ins, cotangents, **kw):
    """Outputs and gradients of sum(o * do) + sum(final * dfinal) w.r.t. every input."""
    o, final = fn(**ins, **kw, output_final_state=True)
    do, dfinal = cotangents
    loss = (o.double() * do).sum() + (final.double() * dfinal).sum()
    grads = torch.autograd.grad(loss, list(ins.values()))
    return {"o": o.detach(), "final": final.detach()} | {f"d_{n}": g for n, g in zip(ins, grads)}


def torch_f64_by_heads(ins, cotangents, head_group, **kw):
    """chunk_torch_varlen in float64, a few heads at a time to bound memory (heads only meet in the router)."""
    from kernels.sse import sse_chunk_varlen
    H = ins["q"].shape[2]
    leaves = {n: x.detach().double().requires_grad_() for n, x in ins.items()}
    outs = {"o": [], "final": []}
    for h in range(0, H, head_group):
        part = {n: x[:, :, h:h + head_group] if x.dim() == 4 and n != "router_logits" else x
                for n, x in leaves.items()}
        part["initial_state"] = leaves["initial_state"][:, h:h + head_group]
        o, final = sse_chunk_varlen(**part, **kw, output_final_state=True)
        do, dfinal = cotangents[0][:, :, h:h + head_group], cotangents[1][:, h:h + head_group]
        ((o * do).sum() + (final * dfinal).sum()).backward()
        outs["o"].append(o.detach())
        outs["final"].append(final.detach())
    return {"o": torch.cat(outs["o"], 2), "final": torch.cat(outs["final"], 1)} | {
        f"d_{n}": x.grad for n, x in leaves.items()}


def check_training(impls, dtypes, lengths_short, long_T, H, c, dv, device, head_group):
    from kernels.sse import sse_reference
    configs = [(4, 1, None, True), (8, 2, None, True), (4, 1, c // 4, False)]  # N, K, row_topk, also long T
    for N, K, row_topk, with_long in configs:
        cases = [("varlen batch", lengths_short)] + ([(f"T={long_T}", [long_T])] if with_long else [])
        for label, lens in cases:
            cu = torch.tensor([0] + lens, device=device).cumsum(0)
            T = int(cu[-1])
            inputs = make_inputs(T, H, c, dv, N, len(lens), device)
            kw = dict(top_k=K, cu_seqlens=cu, row_topk=row_topk)
            cot = (torch.randn(1, T, H, dv, device=device, dtype=torch.float64),
                   torch.randn(len(lens), H, N + 1, c, dv, device=device, dtype=torch.float64))
            if label == "varlen batch":
                ref = forward_backward(sse_reference, as_leaves(inputs, torch.float64), cot, **kw)
                against = "reference f64"
            else:
                ref = torch_f64_by_heads(inputs, cot, head_group, **kw)
                against = "chunk_torch_varlen f64"
            for dtype in dtypes:
                for impl_name, impl in impls.items():
                    got = forward_backward(impl, as_leaves(inputs, dtype), cot, **kw)
                    errors = {n: rel(got[n], ref[n]) for n in ref}
                    sparse = f" r={row_topk}" if row_topk else ""
                    report(f"{impl_name} N={N} K={K}+s{sparse} {str(dtype)[6:]} {label} vs {against}", errors,
                           TOL[dtype])
                    del got
            del ref, inputs
            if device == "cuda":
                torch.cuda.empty_cache()


def check_decode(H, c, dv, device, dtypes):
    from kernels.sse import sse_reference
    from kernels.triton import sse_decode_triton
    for N, K in ((4, 1), (8, 2)):
        for dtype in dtypes:
            for row_topk in (None, 16):
                slots = torch.tensor([5, -1, 0, 17, 9, -1, 31, 2], device=device)
                B, P = len(slots), N + 1
                inputs = make_inputs(B, H, c, dv, N, 1, device)
                step = {n: x[0].to(dtype if n != "router_logits" else torch.float32)
                        for n, x in inputs.items() if n != "initial_state"}
                state = torch.randn(32, H, P, c, dv, device=device)
                cache = state.clone()
                o = sse_decode_triton(cache, slots, **step, top_k=K, row_topk=row_topk)
                live = slots >= 0
                ref_o, ref_state = sse_reference(**{n: v[live][:, None] for n, v in step.items()}, top_k=K,
                                                 row_topk=row_topk, initial_state=state[slots[live]],
                                                 output_final_state=True)
                untouched = torch.ones(32, dtype=torch.bool, device=device)
                untouched[slots[live]] = False
                errors = {"o": rel(o[live], ref_o[:, 0]), "state": rel(cache[slots[live]], ref_state),
                          "skipped_o": float(o[~live].abs().max()),
                          "other_slots": float((cache[untouched] - state[untouched]).abs().max())}
                report(f"decode N={N} K={K}+s {str(dtype)[6:]} row_topk={row_topk}", errors,
                       TOL[dtype] if dtype != torch.float32 else 1e-5)
    if device == "cuda":
        check_decode_graph(H, c, dv)


def check_decode_graph(H, c, dv):
    """Capture one decode step in a CUDA graph, replay it on new inputs, compare with the torch step."""
    from kernels.sse import sse_decode_torch
    from kernels.triton import sse_decode_triton
    N, K, B = 4, 1, 64
    make = lambda: dict(q=torch.randn(B, H, c, device="cuda", dtype=torch.bfloat16),  # noqa: E731
                        k_logits=torch.randn(B, H, c, device="cuda", dtype=torch.bfloat16),
                        v=torch.randn(B, H, dv, device="cuda", dtype=torch.bfloat16),
                        log_decay=-torch.rand(B, H, c, device="cuda", dtype=torch.bfloat16) / 16,
                        router_logits=torch.randn(B, N, device="cuda"),
                        q_shared=torch.randn(B, H, c, device="cuda", dtype=torch.bfloat16),
                        k_shared_logits=torch.randn(B, H, c, device="cuda", dtype=torch.bfloat16))
    static, slots = make(), torch.randperm(2 * B, device="cuda")[:B]
    slots[::7] = -1
    cache = torch.randn(2 * B, H, N + 1, c, dv, device="cuda")
    step = functools.partial(sse_decode_triton, top_k=K)
    step(cache.clone(), slots, **static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(cache, slots, **static)
    fresh = make()
    for n in static:
        static[n].copy_(fresh[n])
    expect_cache = cache.clone()
    expect = sse_decode_torch(expect_cache, slots, **fresh, top_k=K)
    graph.replay()
    torch.cuda.synchronize()
    report("decode CUDA graph replay vs torch step (bf16)",
           {"o": rel(out, expect), "state": rel(cache, expect_cache)}, 1e-2)


def check_model_step(device):
    """A small SSE-H training step (loss + backward): "auto" must dispatch to a Triton path on GPU (mask or
    varlen by the token count) and give the torch path's loss and gradients (float32 model)."""
    from kernels import dispatch
    from sse_model import SSEConfig, SSEForCausalLM
    config = SSEConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                       layer_types=["linear_attention", "linear_attention", "full_attention"],
                       num_attention_heads=2, head_dim=128, sse_num_partitions=4, sse_top_k=1, sse_lora_rank=16)
    torch.manual_seed(0)
    model = SSEForCausalLM(config).to(device)
    ids = torch.randint(0, config.vocab_size, (2, 200), device=device)
    used, originals = [], dict(dispatch.IMPLEMENTATIONS)

    def counted(name):
        def call(*args, **kwargs):
            used.append(name)
            return originals[name](*args, **kwargs)
        return call
    dispatch.IMPLEMENTATIONS.update({name: counted(name) for name in originals})
    results = {}
    for sse_impl in ("auto", "chunk_torch_varlen"):
        model.config.sse_impl = sse_impl
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[sse_impl] = (loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    dispatch.IMPLEMENTATIONS.update(originals)
    (loss_t, grads_t), (loss_ref, grads_ref) = results["auto"], results["chunk_torch_varlen"]
    print(f"model step: auto dispatched to {sorted(set(used[:2]))}, loss {loss_t.item():.6f} (triton) vs "
          f"{loss_ref.item():.6f} (torch)")
    if not all(name.startswith("triton_") for name in used[:2]):
        failures.append("model step did not take the Triton path")
    report("model step loss and parameter gradients, auto vs torch",
           {"loss": rel(loss_t, loss_ref), "grads": max(rel(a, b) for a, b in zip(grads_t, grads_ref))}, 1e-2)


def one_config_per_autotuned_kernel():
    """Correctness does not depend on fla's tuning, and autotuning every kernel for every dtype and head count
    costs minutes of compilation: run each autotuned kernel with one config (the first with 4 warps)."""
    from triton.runtime.autotuner import Autotuner
    prune = Autotuner.prune_configs

    def first_config(self, *args, **kwargs):
        configs = prune(self, *args, **kwargs)
        return [next((c for c in configs if c.num_warps == 4), configs[0])]
    Autotuner.prune_configs = first_config


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        from kernels.gla import chunk_gla_torch
        from kernels.triton import chunk
        gla = dict(gla=chunk_gla_torch)
        shapes = dict(H=2, c=16, dv=16, device="cpu")
        lengths_short, long_T, dtypes, head_group = [1, 0, 5, 9], 40, [torch.float32], 1
    else:
        from kernels.triton import chunk
        one_config_per_autotuned_kernel()
        gla = {}
        shapes = dict(H=16, c=128, dv=128, device="cuda")
        lengths_short, long_T, head_group = [1, 0, 37, 64, 300, 1000], 32768, 4
        dtypes = [torch.float32, torch.bfloat16]
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
        from kernels.dispatch import pick_implementation
        print(f"auto picks: {pick_implementation(torch.device('cuda'), 1 << 16)} at 64k tokens, "
              f"{pick_implementation(torch.device('cuda'), 1 << 10)} at 1k tokens")
    impls = {"triton_varlen": functools.partial(chunk.sse_triton_varlen, **gla),
             "triton_mask": functools.partial(chunk.sse_triton_mask, **gla)}
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    torch.manual_seed(seed)
    check_training(impls, dtypes, lengths_short, long_T, head_group=head_group, **shapes)
    check_decode(shapes["H"], shapes["c"], shapes["dv"], shapes["device"],
                 [torch.float32, torch.bfloat16, torch.float16])
    if not args.smoke:
        check_model_step(shapes["device"])
    print(f"{len(failures)} failed: {failures}" if failures else "all checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
