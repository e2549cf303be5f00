"""The SSE decode step's machine code for a Hopper GPU, compiled on any machine (no GPU needed): registers, stack
(spills) and the instruction mix per thread of its per-token kernel and of its state kernel for an int16 and a
bfloat16 state cache at their default launches (`kernels.triton.decode.default_launch`).

    python bench/sse_decode_sass.py [--out DIR]

Triton compiles `_token_kernel` and `_decode_kernel` for sm_90 with the specialisations a vLLM launch gets (pointers
and the strides of a partition-major cache divisible by 16, the column stride 1; H = 16, c = d_v = 128, N = 4, K = 1
+ shared, decay logits, the shared partition's low-rank terms), and the `nvdisasm` bundled with Triton lists the
SASS. The counts are static (each instruction once; the kernel has no loops over the tile, so a thread runs each
once) and say nothing of memory or latency: they show where one kernel does more work than another, e.g. int16's
quantisation against bfloat16 (kernels/NOTES.md). Without the specialisations the column stride is a runtime value,
every element gets its own address, and ptxas spills thousands of registers: those counts would be of another
kernel. Triton's version decides the code: the GPU nodes run Triton 3.6 (`PYTHONPATH` a `pip install --target DIR
triton==3.6.0` to match).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Arguments whose values a vLLM launch makes multiples of 16 (Triton specialises them so); the column stride is 1.
DIVISIBLE = {"token": ["q_ptr", "k_ptr", "g_ptr", "e_ptr", "qs_ptr", "ks_ptr", "vec_ptr", "part_ptr", "H", "C", "row_q",
                       "row_k", "row_g", "row_qs", "row_ks"],
             "decode": ["state_ptr", "slot_ptr", "vec_ptr", "part_ptr", "v_ptr", "o_ptr", "H", "C", "V",
                        "stride_slot", "stride_head", "stride_part", "stride_row", "row_v", "row_o"]}


def compile_kernel(kernel: str, state: str, block_v: int, num_warps: int):
    """`_token_kernel` (kernel "token") or `_decode_kernel` ("decode") for sm_90, as sse_decode_triton launches it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.triton import decode
    if kernel == "token":
        fn = decode._token_kernel
        signature = dict(q_ptr="*bf16", k_ptr="*bf16", g_ptr="*bf16", e_ptr="*fp32", qs_ptr="*bf16", ks_ptr="*bf16",
                         vec_ptr="*fp32", part_ptr="*i32", decay_normalizer="fp32", H="i32", C="i32", N="i32",
                         row_q="i64", row_k="i64", row_g="i64", row_e="i64", row_qs="i64", row_ks="i64")
        constants = dict(K=1, SHARED=True, SHARED_LORA=True, ROW_TOPK=0, DECAY_LOGITS=True, BLOCK_H=16, BLOCK_C=128,
                         BLOCK_N=4)
    else:
        fn = decode._decode_kernel
        signature = dict(state_ptr="*i16" if state == "int16" else "*bf16", slot_ptr="*i32", vec_ptr="*fp32",
                         part_ptr="*i32", v_ptr="*bf16", o_ptr="*bf16", scale="fp32", H="i32", C="i32", V="i32",
                         N="i32", stride_slot="i64", stride_head="i64", stride_part="i64", stride_row="i64",
                         row_v="i64", row_o="i64")
        constants = dict(stride_col=1, K=1, SHARED=True, FIXED=state == "int16", PTX=True, BLOCK_C=128,
                         BLOCK_V=block_v)
    signature.update(dict.fromkeys(constants, "constexpr"))
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE[kernel]}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def machine_code(kernel, out: Path, name: str) -> tuple[str, str]:
    """(cuobjdump's resource line, nvdisasm's SASS) of a compiled kernel; the cubin and SASS go to `out`."""
    import triton
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = out / f"{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    sass = subprocess.run([tools / "nvdisasm", "-c", cubin], capture_output=True, text=True).stdout
    (out / f"{name}.sass").write_text(sass)
    return next(line.strip() for line in usage.splitlines() if "REG:" in line), sass


def instruction_mix(sass: str) -> collections.Counter:
    """Opcodes (without modifiers or predicates) of the SASS listing."""
    opcode = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
    return collections.Counter(m.group(1) for line in sass.splitlines() if (m := opcode.search(line)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp()), help="where the cubins and SASS go")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton
    print(f"Triton {triton.__version__}, sm_90; H = 16, c = d_v = 128, N = 4, K = 1 + shared; per thread:")
    import torch

    from kernels.triton.decode import default_launch
    launches = [("token", "any", 0, 4)]  # one launch per step, whatever the cache (num_warps as launched)
    for state in ("int16", "bfloat16"):
        launches.append(("decode", state, *default_launch(128, 128, getattr(torch, state))))
    for kernel, state, block_v, num_warps in launches:
        name = f"{kernel}_{state}_{block_v}x{num_warps}"
        usage, sass = machine_code(compile_kernel(kernel, state, block_v, num_warps), args.out, name)
        mix = instruction_mix(sass)
        registers = usage.split(" SHARED")[0]
        print(f"\n{kernel} kernel, {state} state, BLOCK_V {block_v}, {num_warps} warps: {registers}, "
              f"{sum(mix.values())} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in mix.most_common(24)))
    print(f"\nSASS in {args.out}")


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret
    main()
