"""Does the GPU itself slow down under a sustained decode-like load? (clocks, power cap, temperature)

    python bench/gpu_sustained_load.py [--seconds 120]

One "step" is a CUDA graph of a 1.5B SSE-H decode step's GPU work at batch 256 without vLLM: 20 SSE decode layers
(int16 states, H = 16, c = d_v = 128, as bench/sse_decode_launch.py) and 24 x 3 bf16 GEMMs of its projections and
MLP shapes. The graph is replayed without pause; every ~5 s a row gives the mean step time of the last 1,000
replays and nvidia-smi's SM / memory clocks, power draw, GPU / memory temperature and whether the software power
cap or a hardware slowdown is holding the clocks. A flat step time while the engines' tokens/s fall says the drift
is on the host or in the engine, not in the GPU (bench/results/vllm_attention_zeroing_20261129.md).
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMI = ["nvidia-smi", "--format=csv,noheader", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,"
       "temperature.memory,clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120)
    args = p.parse_args()
    import kernels
    from sse_decode_launch import decode_case

    batch = 256
    state, slots, x = decode_case(batch, 16, 4, 128, 128, torch.int16)
    h = torch.randn(batch, 2048, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(2048, 12288, device="cuda", dtype=torch.bfloat16)
    down = torch.randn(6144, 2048, device="cuda", dtype=torch.bfloat16)

    def step():
        for layer in range(24):
            if layer < 20:
                kernels.sse_decode(state, slots, **x, top_k=1)
            h @ qkv
            (h @ up)[:, :6144] @ down

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    print(f"{torch.cuda.get_device_name()}: seconds | step ms | SM MHz, memory MHz, W, GPU C, memory C, "
          "software power cap, hardware slowdown", flush=True)
    t0 = time.time()
    while time.time() - t0 < args.seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(1000):
            graph.replay()
        end.record()
        end.synchronize()
        for _ in range(100):  # keep the GPU busy while nvidia-smi samples it
            graph.replay()
        sample = subprocess.run(SMI, capture_output=True, text=True).stdout.strip()
        torch.cuda.synchronize()
        print(f"{time.time() - t0:6.1f} | {start.elapsed_time(end) / 1000:.3f} | {sample}", flush=True)


if __name__ == "__main__":
    main()
