"""`launch_kernel(kernel, grid, *args, **meta)`: `kernel[grid](*args, **meta)` at less host cost per call.

Why: the SSE layer's training step is bound by the host where its GPU work is short (8k tokens with gradient
checkpointing on an H200, kernels/NOTES.md), and Triton 3.6's `JITFunction.run` costs the host ~20 us a launch
plus ~1.3 us per tensor argument (binding, specialisation, cache key, launch metadata, and in the launcher a
`cuPointerGetAttribute` per tensor): 21 / 30 / 46 us for 2 / 8 / 20 tensors on the GPU node, against ~9 us for
the compiled kernel's own launcher given pointers as integers (`bench/triton_launch.py`). The SSE layer makes 30
launches per checkpointed step; through this its checkpointed 8k step ran 4.5 % faster on an H200
(bench/results/train_step_launch_ab_20261129.md).

How it stays exact: each call is keyed by what Triton specialises a compiled kernel on, or something finer
(per tensor its dtype, device type and 16-byte alignment; per int its alignment to 16, whether it is 1 and its
32-bit range; bools, None and constexpr parameters by value; the launch options; the current device). The first
call of a key runs Triton's own path, which compiles or finds the kernel; later calls of the key reuse that
compiled kernel with the same arguments. Only plain `@triton.jit` kernels with the arguments above take the fast
path, on the Triton versions in `TESTED`; anything else (the interpreter, torch.compile tracing, launch hooks,
other argument types) goes through `kernel[grid]` itself.
"""
import inspect
import os

import torch
import triton

# Triton versions whose CompiledKernel.run(grid x3, stream, function, packed_metadata, launch_metadata, enter hook,
# exit hook, *every parameter) this was checked against (tests/test_triton_launch.py, GPU cases).
TESTED = ("3.6.",)
OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})
_compiled: dict = {}
_layout: dict = {}


def enabled() -> bool:
    return (triton.__version__.startswith(TESTED) and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and torch.cuda.is_available())


ENABLED = enabled()


def _parameters(kernel):
    """(constexpr flag per parameter, names, defaults) of a plain @triton.jit kernel, else None."""
    if kernel not in _layout:
        params = getattr(kernel, "params", None)
        plain = isinstance(kernel, triton.runtime.jit.JITFunction) and params is not None
        _layout[kernel] = (tuple(p.is_constexpr for p in params), tuple(p.name for p in params),
                           tuple(p.default for p in params)) if plain else None
    return _layout[kernel]


def _key_and_arguments(kernel, layout, args, meta):
    """(cache key, every parameter's value as the launcher takes it: tensors as their addresses), or None where
    Triton's own path must run."""
    constexpr, names, defaults = layout
    if len(args) > len(names):
        return None
    spec, values = [], []
    for a, const in zip(args, constexpr):
        if const or a is None or type(a) is bool:
            spec.append(a)
            values.append(a)
        elif isinstance(a, torch.Tensor):
            p = a.data_ptr()
            spec.append((a.dtype, a.is_cuda, p % 16 == 0))
            values.append(p)
        elif type(a) is int:
            spec.append((a % 16 == 0, a == 1, -2**31 <= a < 2**31, a < 2**63))
            values.append(a)
        elif type(a) is float:
            spec.append(float)
            values.append(a)
        else:
            return None
    for name, const, default in zip(names[len(args):], constexpr[len(args):], defaults[len(args):]):
        if not const or (name not in meta and default is inspect.Parameter.empty):
            return None  # a runtime argument by keyword or a missing one: Triton's path says what it does with it
        values.append(meta.get(name, default))
    if any(name not in OPTIONS and name not in names for name in meta):
        return None
    key = (kernel, torch.cuda.current_device(), tuple(spec), tuple(sorted(meta.items())))
    return key, values


def _hooked() -> bool:
    """Whether a launch hook (a profiler's) is set: Triton keeps them in a HookChain, empty when there is none."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_kernel(kernel, grid, *args, **meta):
    """`kernel[grid](*args, **meta)`, grid a tuple of ints (see the module's docstring)."""
    layout = _parameters(kernel) if ENABLED else None
    if layout is None or _hooked() or torch.compiler.is_compiling():
        return kernel[grid](*args, **meta)
    found = _key_and_arguments(kernel, layout, args, meta)
    if found is None:
        return kernel[grid](*args, **meta)
    key, values = found
    compiled = _compiled.get(key)
    if compiled is None:
        _compiled[key] = kernel[grid](*args, **meta)
        return _compiled[key]
    device = key[1]
    g = tuple(grid) + (1, 1)
    compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *values)
    return compiled
