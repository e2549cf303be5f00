"""GPU benchmarks of the SSE Triton paths, side by side in one run (needs CUDA and fla):

    python bench/sse_op.py [--lengths 1024,4096,16384,65536,131072] [--sections training,scaling_N,...]
                           [--no-fla-layouts] [--out bench/results]


Medians of `triton.testing.do_bench` (CUDA events), bf16 activations, H = 16, c = d_v = 128, batch 1:
1. training op forward+backward vs T: SSE (N = 4, K = 1 + shared) indexed (ours, the default), varlen and mask
   (around fla's `chunk_gla`; `--no-fla-layouts` leaves them out, fla autotunes them for minutes on a fresh
   node), plain GLA (fla `chunk_gla`, the linear-attention floor) and causal SDPA (FlashAttention backend);
2. SSE indexed and varlen vs N at K = 1 + shared (T = 16k): should stay flat (the mask path's work is N + 1 times
   GLA by construction; it is left out here because every head count N * H re-autotunes fla's kernels);
3. where the varlen time goes at T = 64k: routing, gather, the GLA core on the gathered rows, the rest;
   and where the indexed op's time goes at T = 8k, kernel by kernel (`indexed_kernels`);
4. decode step for batch 1..1024 (N = 4, K = 1 + shared): bytes = each touched state read and written once,
   as a fraction of the measured device copy bandwidth; next to it a softmax-attention decode step (SDPA, one
   query) over KV caches of 4k, 32k, 128k tokens.
Writes bench/results/sse_gpu_<date>.json and .md (or under --out) with the device name and date.
"""
import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import sse_attention
from kernels.sse import log_decay_from_logits
from kernels.triton import sse_decode_triton
from kernels.triton.expand import expand
from kernels.triton.routing import route_varlen

H, C, DV = 16, 128, 128
BF16 = torch.bfloat16


def median_ms(fn, grad_to_none=None):
    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def bf16(*shape):
    return torch.randn(*shape, device="cuda", dtype=BF16)


def bf16_leaf(*shape):
    return bf16(*shape).requires_grad_()


def sse_inputs(T, N):
    """What the model's SSE layer passes: bf16 activations, decay logits (with `decay_normalizer`) and float32
    router logits."""
    return dict(q=bf16_leaf(1, T, H, C), k_logits=bf16_leaf(1, T, H, C), v=bf16_leaf(1, T, H, DV),
                log_decay=bf16_leaf(1, T, H, C), router_logits=torch.randn(1, T, N, device="cuda").requires_grad_(),
                q_shared=bf16_leaf(1, T, H, C), k_shared_logits=bf16_leaf(1, T, H, C))


def sse_step(impl, T, N, K=1, backward=True):
    """(one call of an SSE path as the model makes it, its input leaves)."""
    ins = sse_inputs(T, N)
    do = torch.randn(1, T, H, DV, device="cuda", dtype=BF16)

    def step():
        o, _ = sse_attention(**ins, top_k=K, decay_normalizer=16.0, impl=impl)
        if backward:
            o.backward(do)
    return step, ins


def time_sse(impl, T, N, K=1, backward=True):
    """One SSE path as the model calls it (the paths that do not take decay logits get log a computed first,
    within the timing)."""
    step, ins = sse_step(impl, T, N, K, backward)
    ms = median_ms(step, grad_to_none=list(ins.values()))
    ins.clear()  # frees the inputs before the cache is emptied
    free()
    return ms


def time_gla(T, backward=True):
    from fla.ops.gla import chunk_gla
    q, k, v = bf16_leaf(1, T, H, C), bf16_leaf(1, T, H, C), bf16_leaf(1, T, H, DV)
    g = (F.logsigmoid(torch.randn(1, T, H, C, device="cuda")) / 16).requires_grad_()
    do = torch.randn(1, T, H, DV, device="cuda", dtype=BF16)

    def step():
        o, _ = chunk_gla(q, k, v, g)
        if backward:
            o.backward(do)
    ms = median_ms(step, grad_to_none=[q, k, v, g])
    free()
    return ms


def time_sdpa(T):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (bf16_leaf(1, H, T, C) for _ in range(3))
    do = torch.randn(1, H, T, C, device="cuda", dtype=BF16)

    def step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    ms = median_ms(step, grad_to_none=[q, k, v])
    free()
    return ms


def training_vs_T(lengths, fla_layouts=True):
    """fla_layouts=False leaves out the varlen and mask paths: on a fresh node fla autotunes their kernels for
    several minutes per head count."""
    rows = []
    for T in lengths:
        row = {"T": T, "sse_indexed_ms": time_sse("triton_indexed", T, 4), "gla_ms": time_gla(T),
               "sdpa_flash_ms": time_sdpa(T), "sse_indexed_fwd_ms": time_sse("triton_indexed", T, 4, backward=False),
               "gla_fwd_ms": time_gla(T, backward=False)}
        if fla_layouts:
            row |= {"sse_varlen_ms": time_sse("triton_varlen", T, 4), "sse_mask_ms": time_sse("triton_mask", T, 4)}
        row["indexed_over_gla"] = row["sse_indexed_ms"] / row["gla_ms"]
        row["sdpa_over_indexed"] = row["sdpa_flash_ms"] / row["sse_indexed_ms"]
        print(row, flush=True)
        rows.append(row)
    return rows


def scaling_with_N(T, partitions, fla_layouts=True):
    rows = []
    for N in partitions:
        row = {"N": N, "T": T, "sse_indexed_ms": time_sse("triton_indexed", T, N)}
        if fla_layouts:
            row["sse_varlen_ms"] = time_sse("triton_varlen", T, N)
        print(row, flush=True)
        rows.append(row)
    return rows


def varlen_breakdown(T, N=4, K=1):
    """Time of each stage of the varlen forward, and of the GLA core alone (fwd+bwd) on the gathered rows."""
    from fla.ops.gla import chunk_gla
    ins = sse_inputs(T, N)
    e = ins["router_logits"].reshape(T, N)
    bounds = torch.tensor([0, T], device="cuda")
    _, pos, cu, part, _ = route_varlen(e, bounds, K, True)
    flat = {n: x.reshape(T, H, -1) for n, x in ins.items() if n != "router_logits"}
    args = (flat["q"], flat["k_logits"], flat["v"], log_decay_from_logits(flat["log_decay"], 16.0), e, flat["q_shared"],
            flat["k_shared_logits"], part, pos, pos.numel(), None)
    with torch.no_grad():
        rows = [x.detach().view(1, pos.numel(), H, -1).requires_grad_() for x in expand(*args)]
    do = torch.randn(1, pos.numel(), H, DV, device="cuda", dtype=BF16)

    def core():
        o, _ = chunk_gla(*rows, cu_seqlens=cu)
        o.backward(do)
    out = {"T": T, "route_ms": median_ms(lambda: route_varlen(e, bounds, K, True)),
           "gather_fwd_ms": median_ms(lambda: expand(*args)),
           "gla_core_rows_fwd_bwd_ms": median_ms(core, grad_to_none=rows)}
    out["sse_varlen_fwd_bwd_ms"] = time_sse("triton_varlen", T, N, K)
    out["ours_ms"] = out["sse_varlen_fwd_bwd_ms"] - out["gla_core_rows_fwd_bwd_ms"]
    print(out, flush=True)
    del ins
    rows.clear()  # frees the rows before the cache is emptied
    free()
    return out


def indexed_kernels(T, N=4, K=1, steps=5):
    """GPU time of each kernel of the indexed op's forward+backward at T (torch profiler, per step): where to look
    before editing one (kernels/NOTES.md has the ones tried)."""
    step, ins = sse_step("triton_indexed", T, N, K)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = {e.key: e.self_device_time_total / steps / 1e3 for e in prof.key_averages()
               if e.self_device_time_total > 0}
    out = {"T": T, "kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}
    print(out, flush=True)
    ins.clear()  # frees the inputs before the cache is emptied
    free()
    return out


def copy_bandwidth():
    x = torch.empty(2 * 1024**3 // 4, device="cuda", dtype=torch.float32).normal_()
    y = torch.empty_like(x)
    ms = median_ms(functools.partial(y.copy_, x))
    del x, y
    free()
    return 2 * 2 * 1024**3 / (ms * 1e-3)  # bytes read + written per second


def decode(batches, copy_bw, N=4, K=1):
    rows = []
    for B in batches:
        step = dict(q=bf16(B, H, C), k_logits=bf16(B, H, C), v=bf16(B, H, DV),
                    log_decay=(F.logsigmoid(torch.randn(B, H, C, device="cuda")) / 16).to(BF16),
                    router_logits=torch.randn(B, N, device="cuda"), q_shared=bf16(B, H, C),
                    k_shared_logits=bf16(B, H, C))
        cache = torch.randn(B, H, N + 1, C, DV, device="cuda")
        slots = torch.randperm(B, device="cuda")
        ms = median_ms(functools.partial(sse_decode_triton, cache, slots, **step, top_k=K))
        moved = 2 * B * (K + 1) * H * C * DV * 4  # touched states, read + written
        row = {"batch": B, "sse_decode_ms": ms, "state_GB_per_s": moved / (ms * 1e-3) / 1e9,
               "fraction_of_copy_bw": moved / (ms * 1e-3) / copy_bw}
        del cache
        free()
        for L in (4096, 32768, 131072):
            if B * L * H * C * 2 * 2 > 40 * 1024**3:  # KV cache over 40 GB: skip
                continue
            attention = functools.partial(F.scaled_dot_product_attention, bf16(B, H, 1, C), bf16(B, H, L, C),
                                          bf16(B, H, L, C))
            row[f"attn_decode_kv{L // 1024}k_ms"] = median_ms(attention)
            del attention
            free()
        print(row, flush=True)
        rows.append(row)
    return rows


def ms(row, key):
    """A time of a table row, or "-" where it was not measured."""
    return f"{row[key]:.2f}" if key in row else "-"


def markdown(result):
    """The tables of the sections measured so far."""
    lines = [f"# SSE GPU benchmark, {result['device']}, {result['date']}", "",
             f"torch {result['torch']}, triton {result['triton']}, fla {result['fla']}; bf16, H = 16, "
             f"c = d_v = 128, batch 1; medians of triton.testing.do_bench. Copy bandwidth "
             f"{result['copy_bandwidth_GB_per_s']:.0f} GB/s (read + write)."]
    if "training" in result:
        lines += ["", "## Training op, forward + backward, N = 4, K = 1 + shared", "",
                  "SSE indexed = our chunk kernels (kernels/triton/indexed_chunk.py); varlen and mask = our routing "
                  "and gather around fla's `chunk_gla`; GLA = fla `chunk_gla` on T tokens; SDPA on contiguous "
                  "[B, H, T, D]. fwd = forward alone. SSE takes the model's inputs (bf16 decay logits, the "
                  "logsigmoid inside the timing); GLA gets float32 log-decays made outside it.", "",
                  "| T | SSE indexed ms | SSE varlen ms | SSE mask ms | GLA (fla) ms | SDPA flash ms | indexed / GLA | "
                  "varlen / GLA | SDPA / indexed | indexed fwd ms | GLA fwd ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        def varlen_over_gla(r):
            return f"{r['sse_varlen_ms'] / r['gla_ms']:.2f}" if "sse_varlen_ms" in r else "-"
        lines += [f"| {r['T']} | {r['sse_indexed_ms']:.2f} | {ms(r, 'sse_varlen_ms')} | {ms(r, 'sse_mask_ms')} | "
                  f"{r['gla_ms']:.2f} | {r['sdpa_flash_ms']:.2f} | {r['indexed_over_gla']:.2f} | "
                  f"{varlen_over_gla(r)} | {r['sdpa_over_indexed']:.1f} | {r['sse_indexed_fwd_ms']:.2f} | "
                  f"{r['gla_fwd_ms']:.2f} |" for r in result["training"]]
    if "scaling_N" in result:
        lines += ["", f"## SSE vs N, K = 1 + shared, T = {result['scaling_N'][0]['T']}", "",
                  "| N | SSE indexed ms | SSE varlen ms |", "| --- | --- | --- |"]
        lines += [f"| {r['N']} | {r['sse_indexed_ms']:.2f} | {ms(r, 'sse_varlen_ms')} |" for r in result["scaling_N"]]
    if "varlen_breakdown" in result:
        b = result["varlen_breakdown"]
        lines += ["", f"## Varlen breakdown, T = {b['T']}", "",
                  f"routing {b['route_ms']:.2f} ms, gather forward {b['gather_fwd_ms']:.2f} ms, GLA core on the "
                  f"gathered rows fwd+bwd {b['gla_core_rows_fwd_bwd_ms']:.2f} ms, whole op "
                  f"{b['sse_varlen_fwd_bwd_ms']:.2f} ms: ours (routing, gather/scatter, backward) "
                  f"{b['ours_ms']:.2f} ms."]
    if "indexed_kernels" in result:
        r = result["indexed_kernels"]
        lines += ["", f"## SSE indexed op by kernel, forward + backward, T = {r['T']} (torch profiler, per step)", "",
                  "| kernel | ms |", "| --- | ---: |"]
        lines += [f"| `{name[:80]}` | {t:.3f} |" for name, t in r["kernels_ms"].items() if t >= 0.001]
    if "decode" in result:
        kv = sorted({k for r in result["decode"] for k in r if k.startswith("attn_decode")},
                    key=lambda k: int(k.split("kv")[1].split("k")[0]))
        lines += ["", "## Decode step, N = 4, K = 1 + shared; softmax attention at the same batch", "",
                  "| batch | SSE ms | state GB/s | of copy bw | " + " | ".join(
                      f"attn KV {k.split('kv')[1].split('_')[0]} ms" for k in kv) + " |",
                  "| --- | --- | --- | --- |" + " --- |" * len(kv)]
        lines += [f"| {r['batch']} | {r['sse_decode_ms']:.3f} | {r['state_GB_per_s']:.0f} | "
                  f"{r['fraction_of_copy_bw']:.0%} | " + " | ".join(f"{r[k]:.3f}" if k in r else "-" for k in kv)
                  + " |" for r in result["decode"]]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--lengths", default="1024,4096,16384,65536,131072")
    parser.add_argument("--sections", default="training,scaling_N,varlen_breakdown,indexed_kernels,decode")
    parser.add_argument("--no-fla-layouts", action="store_true",
                        help="training and N rows without the varlen/mask paths")
    args = parser.parse_args()
    import fla
    torch.manual_seed(0)
    bw = copy_bandwidth()
    result = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "triton": triton.__version__, "fla": fla.__version__,
              "copy_bandwidth_GB_per_s": bw / 1e9}
    print(result, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"sse_gpu_{result['date']}"
    sections = [("training", lambda: training_vs_T([int(t) for t in args.lengths.split(",")],
                                                   fla_layouts=not args.no_fla_layouts)),
                ("scaling_N", lambda: scaling_with_N(16384, [1, 2, 4, 8, 16], fla_layouts=not args.no_fla_layouts)),
                ("varlen_breakdown", lambda: varlen_breakdown(65536)),
                ("indexed_kernels", lambda: indexed_kernels(8192)),
                ("decode", lambda: decode([1, 64, 256, 1024], bw))]
    for name, measure in sections:  # saved after each section, so a cut-off run keeps what it measured
        if name not in args.sections.split(","):
            continue
        result[name] = measure()
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
        stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
