"""Host us per Triton launch for kernels taking 2, 8 and 20 tensors, with the GPU held by a sleep kernel so that
only the host's time counts: Triton's path (`kernel[grid](...)`: binding and specialising the arguments, the cache
key, launch metadata, then the compiled kernel's launcher, which asks the driver about every tensor's pointer), and
that launcher alone given the tensors' addresses as integers (what is left once Triton's Python is skipped; a
diagnostic that calls Triton 3.6's `CompiledKernel.run` directly, not a launch path of the project).

    python bench/triton_launch.py [--out bench/results]

Writes triton_launch_cost_<date>.json with the device, Triton's version and the medians (kernels/NOTES.md has
what came of it: a launch path of our own saved too little to keep).
"""
import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from layer_host import held_us  # noqa: E402  (host us per call with the GPU held by a sleep kernel)


@triton.jit
def _two(a, out, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out + i, tl.load(a + i, mask=i < n), mask=i < n)


@triton.jit
def _eight(a, b, c, d, e, f, g, out, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(a + i, mask=m) + tl.load(b + i, mask=m) + tl.load(c + i, mask=m) + tl.load(d + i, mask=m)
    tl.store(out + i, x + tl.load(e + i, mask=m) + tl.load(f + i, mask=m) + tl.load(g + i, mask=m), mask=m)


@triton.jit
def _twenty(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, out, n,
            BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(a0 + i, mask=m) + tl.load(a1 + i, mask=m) + tl.load(a2 + i, mask=m) + tl.load(a3 + i, mask=m)
    x += tl.load(a4 + i, mask=m) + tl.load(a5 + i, mask=m) + tl.load(a6 + i, mask=m) + tl.load(a7 + i, mask=m)
    x += tl.load(a8 + i, mask=m) + tl.load(a9 + i, mask=m) + tl.load(a10 + i, mask=m) + tl.load(a11 + i, mask=m)
    x += tl.load(a12 + i, mask=m) + tl.load(a13 + i, mask=m) + tl.load(a14 + i, mask=m) + tl.load(a15 + i, mask=m)
    tl.store(out + i, x + tl.load(a16 + i, mask=m) + tl.load(a17 + i, mask=m) + tl.load(a18 + i, mask=m), mask=m)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    ts = [torch.randn(1024, device="cuda") for _ in range(20)]
    kernels = {2: (_two, ts[:2]), 8: (_eight, ts[:8]), 20: (_twenty, ts)}
    rows = {}
    stream = torch.cuda.current_stream().cuda_stream
    for tensors, (kernel, tensor_args) in kernels.items():
        call = (*tensor_args, 1024)
        compiled = kernel[(1,)](*call, BLOCK=1024)
        addresses = [t.data_ptr() for t in tensor_args] + [1024, 1024]  # every parameter, the constexpr too

        def launcher(c=compiled, a=addresses):
            c.run(1, 1, 1, stream, c.function, c.packed_metadata, None, None, None, *a)
        # 150 launches a loop stay within CUDA's launch queue
        rows[tensors] = dict(triton_us=held_us(lambda k=kernel, c=call: k[(1,)](*c, BLOCK=1024), calls=150),
                             launcher_us=held_us(launcher, calls=150))
    now = datetime.now(timezone.utc)
    print(f"Host us per launch, {torch.cuda.get_device_name()}, Triton {triton.__version__}, {now:%Y-%m-%d %H:%M} UTC"
          "\n\n| tensor arguments | kernel[grid](...) | its compiled launcher, addresses given |"
          "\n| ---: | ---: | ---: |")
    for tensors, r in rows.items():
        print(f"| {tensors} | {r['triton_us']:.1f} | {r['launcher_us']:.1f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(date=now.isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
                  triton=triton.__version__, torch=torch.__version__, rows=rows)
    (args.out / f"triton_launch_cost_{now:%Y%m%d-%H%M}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
