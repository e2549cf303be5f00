"""Host work of a decoder layer counted, not timed: torch (aten) ops and Triton launches per call of the SSE
decoder layer on its GPU path and of Qwen3's, on the CPU.

    python bench/layer_ops.py [--out bench/results]

Where the host bounds the training step (8k tokens on an H200, kernels/NOTES.md), each aten op costs it ~4-11 us
and each Triton launch ~20-30 us on the GPU node, but timing them there moves with the host by as much as a change
does (bench/results/train_step_8k_host_20261129b.md). Counts do not: this runs the layers of bench/train_step.py's
models at a tiny width on the CPU with the GPU path's Python (the indexed SSE operator and the fused norms, whose
Triton launches are recorded and skipped, so their outputs are garbage) and counts, per forward, backward and
checkpointed forward + backward, the aten ops (a TorchDispatchMode) and the launches by kernel, and the tensors a
forward saves for the backward. Writes layer_ops_<date>.json with the torch version (op counts differ a little
between versions and devices).
"""
import argparse
import collections
import contextlib
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from layer_host import CHECKPOINT, SSE_CHECKPOINT, layers  # noqa: E402
from train_step import SHAPE  # noqa: E402

TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2, head_dim=128)


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def gpu_path_on_cpu(launches: collections.Counter):
    """Triton launches recorded in `launches` (by kernel) and skipped; the norms dispatched to their Triton path as
    on a GPU."""
    import triton

    import kernels.dispatch as dispatch
    getitem, pick = triton.runtime.jit.JITFunction.__getitem__, dispatch._triton_or_torch

    def record(fn, grid):
        def launch(*args, **kwargs):
            launches[fn.fn.__name__] += 1
        return launch

    def triton_path(implementations, impl, device, what):
        return implementations["triton"] if impl == "auto" else pick(implementations, impl, device, what)
    triton.runtime.jit.JITFunction.__getitem__ = record
    dispatch._triton_or_torch = triton_path
    try:
        yield
    finally:
        triton.runtime.jit.JITFunction.__getitem__ = getitem
        dispatch._triton_or_torch = pick


def measure() -> dict:
    """{layer: {"forward" | "backward" | "checkpointed forward + backward": {"aten_ops", "launches",
    "by_kernel"}, the forward's also "saved_tensors"}}."""
    sse, sse_fn, qwen, qwen_fn, x = layers(64, "cpu", {**SHAPE, **TINY}, sse_impl="triton_indexed")
    calls, modules = {"SSE": sse_fn, "Qwen3": qwen_fn}, (sse, qwen)
    launches = collections.Counter()
    saved = []  # the tensors a forward saves for the backward

    def save(t):
        saved.append(t)
        return t
    results = {}
    with gpu_path_on_cpu(launches):
        for name, fn in calls.items():
            fn(x).float().sum().backward()  # first-call work (lazy imports, cached bounds) outside the counts
            for module in modules:
                module.zero_grad(set_to_none=True)
            x.grad = None
            rows = {}
            for part in ("forward", "backward", "checkpointed forward + backward"):
                launches.clear()
                saved.clear()
                with _AtenOps() as ops:
                    if part == "forward":
                        with torch.autograd.graph.saved_tensors_hooks(save, lambda t: t):
                            out = fn(x)
                    elif part == "backward":
                        out.float().sum().backward()
                    else:
                        checkpointing = SSE_CHECKPOINT if name == "SSE" else CHECKPOINT
                        checkpoint(fn, x, **checkpointing).float().sum().backward()
                rows[part] = dict(aten_ops=ops.count, launches=sum(launches.values()), by_kernel=dict(launches))
                if part == "forward":  # each runs checkpoint's Python hooks three times a checkpointed step
                    rows[part]["saved_tensors"] = len(saved)
                if part != "forward":  # each pass starts with no gradients, as a training step's does
                    for module in modules:
                        module.zero_grad(set_to_none=True)
                    x.grad = None
            results[name] = rows
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    results = measure()
    now = datetime.now(timezone.utc)
    print(f"Host work per decoder-layer call, counted on the CPU (torch {torch.__version__}): aten ops / Triton "
          "launches\n\n| call | SSE | Qwen3 |\n| --- | ---: | ---: |")
    for part in results["SSE"]:
        cells = [f"{results[m][part]['aten_ops']} / {results[m][part]['launches']}" for m in ("SSE", "Qwen3")]
        print(f"| {part} | " + " | ".join(cells) + " |")
    print("| tensors saved for the backward, forward | " +
          " | ".join(str(results[m]["forward"]["saved_tensors"]) for m in ("SSE", "Qwen3")) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"layer_ops_{now:%Y%m%d-%H%M}.json"
    path.write_text(json.dumps(dict(date=now.isoformat(timespec="seconds"), torch=torch.__version__,
                                    shape={**SHAPE, **TINY}, results=results), indent=1))
    print(f"\n{path}")


if __name__ == "__main__":
    main()
