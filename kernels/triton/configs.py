"""Launch settings of the SSE Triton kernels per device, as data, read at one point (`launch_settings`).

Keys are device names as `torch.cuda.get_device_name()` gives them, normalised (`device_key`): "NVIDIA H100 80GB
HBM3" is "nvidia_h100_80gb_hbm3". An entry applies to the device whose key it is or begins (up to a "_"), the longest
such entry, so "nvidia_h100" covers the H100's SXM, PCIe and NVL parts; a device with no entry, and the CPU under
Triton's interpreter, takes "default". Launch settings split the same work among programs differently, and what
is fastest is the device's own: an entry records the settings found fastest on its device, with outputs and
gradients checked against the previous settings' (`python -m bench.op --base REV` times a changed entry against the
revision before it); a device tuned later gets an entry of its own.
"""
import functools
import re

import torch

# One entry for the Hopper parts below: `python -m bench.op --sections indexed_kernels decode` finds the same
# settings fastest on each of them, so they share it until a device's own run says otherwise.
_HOPPER = {
    # The chunk kernels of indexed_chunk.py (`_launch`): value columns a program (BLOCK_V; key columns, BLOCK_C, for
    # dq_dk_dg) and Triton's num_warps / num_stages. Every program of a chunk rebuilds the chunk's rows (and the
    # output kernels its scores), so fewer, wider programs rebuild them fewer times, at the cost of registers.
    # dq_dk_dg takes half the key columns a program: twice the programs, each with half the accumulators and the
    # state tiles' reads, dA computed by both.
    "indexed_chunk": {"chunk_sums": dict(BLOCK_V=128, num_warps=4, num_stages=3),
                      "scan": dict(BLOCK_V=64, num_warps=4, num_stages=2),
                      "output": dict(BLOCK_V=128, num_warps=8, num_stages=3),
                      "dv": dict(BLOCK_V=128, num_warps=8, num_stages=3),
                      "dq_dk_dg": dict(BLOCK_C=64, BLOCK_V=64, num_warps=4, num_stages=2)},
    # The decode kernel (decode.py): bytes of state tile a program, and warps. A tile sized in bytes, not columns,
    # gives a bfloat16 cache's programs as much to move as a float32 cache's (with a fixed column count a bfloat16
    # cache gains little from moving half the bytes); an int16 cache converts every value on the way in and out and
    # keeps more programs in flight with smaller tiles and fewer warps.
    "decode": dict(tile_bytes=32768, num_warps=4),
    "decode_int16": dict(tile_bytes=16384, num_warps=2),
}

CONFIGS: dict[str, dict[str, dict]] = {"default": _HOPPER, "nvidia_h100": _HOPPER, "nvidia_h200": _HOPPER}


def device_key(name: str) -> str:
    """A device name normalised: lower case, every run of characters other than letters and digits one "_"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def entry_for(name: str | None) -> str:
    """The key of CONFIGS' entry for the device named `name` (None: no GPU): the longest key that is the name's
    normalised key or begins it up to a "_", else "default"."""
    key = device_key(name) if name else ""
    matches = [k for k in CONFIGS if k != "default" and (key == k or key.startswith(k + "_"))]
    return max(matches, key=len, default="default")


@functools.cache
def _entry_of(device: torch.device) -> str:
    return entry_for(torch.cuda.get_device_name(device) if device.type == "cuda" else None)


def launch_settings(kernel: str, device: torch.device) -> dict:
    """The launch settings of `kernel` ("indexed_chunk", "decode", "decode_int16") on `device`, from its entry of
    CONFIGS (the device's name is read once per device). The dict is the table's own: read it, do not modify it
    but to sweep."""
    return CONFIGS[_entry_of(device)][kernel]
