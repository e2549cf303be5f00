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
_tails: dict = {}


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


def _tail(kernel, layout, count: int, meta_names: tuple):
    """(name, default) of each parameter after the `count` positional arguments, each a constexpr given by keyword
    or defaulted, when the keywords are such constexprs or launch options; else None. Once per call site's shape."""
    cache_key = (kernel, count, meta_names)
    if cache_key not in _tails:
        constexpr, names, defaults = layout
        rest = list(zip(names[count:], constexpr[count:], defaults[count:]))
        valid = count <= len(names) and all(
            const and (name in meta_names or default is not inspect.Parameter.empty) for name, const, default in rest)
        valid = valid and all(name in OPTIONS or name in names[count:] for name in meta_names)
        _tails[cache_key] = [(name, default) for name, _, default in rest] if valid else None
    return _tails[cache_key]


def _key_and_arguments(kernel, layout, args, meta):
    """(cache key, every parameter's value as the launcher takes it: tensors as their addresses), or None where
    Triton's own path must run. Runs at every launch, hence the plain loop."""
    tail = _tail(kernel, layout, len(args), tuple(meta))
    if tail is None:
        return None
    constexpr = layout[0]
    spec, values = [], list(args)
    for i, a in enumerate(args):
        if constexpr[i] or a is None or a is True or a is False:
            spec.append(a)
        elif isinstance(a, torch.Tensor):
            values[i] = p = a.data_ptr()
            spec.append((a.dtype, a.is_cuda, not p & 15))
        elif type(a) is int:
            spec.append((not a & 15, a == 1, -0x80000000 <= a < 0x80000000, a < 0x8000000000000000))
        elif type(a) is float:
            spec.append(float)
        else:
            return None
    values.extend(meta[name] if name in meta else default for name, default in tail)
    return (kernel, torch._C._cuda_getDevice(), tuple(spec), tuple(meta.items())), values


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
