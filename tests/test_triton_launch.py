"""kernels/triton/launch.py: which calls share a compiled kernel, what the fast path hands the launcher, and (GPU)
that the SSE operator gives the same bits through it as through Triton's own launch."""
import pytest
import torch
import triton
import triton.language as tl

from kernels.triton import launch


@triton.jit
def _kernel(x, y, n, flag, scale, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 3):
    i = tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i) * scale + SHIFT, mask=(i < n) & flag)


def key(*args, **meta):
    return launch._key_and_arguments(_kernel, launch._parameters(_kernel), args, meta)


def test_key_is_as_fine_as_triton_specialisation(monkeypatch):
    """Calls that Triton could compile differently get different keys (dtype, device type, 16-byte alignment of a
    tensor; an int's alignment to 16, being 1, its 32-bit range; bools and constexprs by value; launch options);
    calls Triton compiles alike share one."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    x, y = torch.zeros(64), torch.zeros(64)
    base = key(x, y, 32, True, 0.5, 16, num_warps=4)[0]
    assert key(torch.ones(64), torch.ones(64), 48, True, 2.0, 16, num_warps=4)[0] == base
    different = {"dtype": key(x.double(), y, 32, True, 0.5, 16, num_warps=4),
                 "misaligned tensor": key(x[1:], y, 32, True, 0.5, 16, num_warps=4),
                 "int not a multiple of 16": key(x, y, 33, True, 0.5, 16, num_warps=4),
                 "int 1": key(x, y, 1, True, 0.5, 16, num_warps=4),
                 "int past 32 bits": key(x, y, 2**32, True, 0.5, 16, num_warps=4),
                 "bool": key(x, y, 32, False, 0.5, 16, num_warps=4),
                 "constexpr": key(x, y, 32, True, 0.5, 32, num_warps=4),
                 "constexpr by keyword": key(x, y, 32, True, 0.5, 16, SHIFT=1, num_warps=4),
                 "launch option": key(x, y, 32, True, 0.5, 16, num_warps=8)}
    for name, found in different.items():
        assert found[0] != base, name


def test_arguments_reach_the_launcher_in_parameter_order(monkeypatch):
    """Tensors as their addresses, everything else as given, the constexprs not passed with their defaults."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    x, y = torch.zeros(64), torch.zeros(64)
    assert key(x, y, 32, True, 0.5, 16)[1] == [x.data_ptr(), y.data_ptr(), 32, True, 0.5, 16, 3]
    assert key(x, y, 32, True, 0.5, BLOCK=16, SHIFT=1)[1] == [x.data_ptr(), y.data_ptr(), 32, True, 0.5, 16, 1]


@pytest.mark.parametrize("args, meta", [((torch.zeros(4), torch.zeros(4)), dict(n=3, flag=True, scale=1.0, BLOCK=4)),
                                        ((torch.zeros(4), torch.zeros(4), 3, True, 1.0, 4), dict(unknown=1)),
                                        ((torch.zeros(4), [0.0], 3, True, 1.0, 4), {}),
                                        ((torch.zeros(4), torch.zeros(4), 3, True, 1.0), {}),
                                        ((torch.zeros(4),) * 8, {})],
                         ids=["runtime argument by keyword", "unknown keyword", "list argument", "constexpr missing",
                              "too many arguments"])
def test_calls_the_fast_path_cannot_key_take_tritons_path(monkeypatch, args, meta):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    assert key(*args, **meta) is None


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


def test_first_call_of_a_key_compiles_through_triton_later_calls_launch_it(monkeypatch):
    """Triton's path runs once per key (it compiles or finds the kernel); the key's later calls go to that compiled
    kernel's launcher with the grid made 3-D, the current stream, no launch metadata or hooks, and the arguments
    in parameter order."""
    through_triton = []

    def getitem(kernel, grid):
        def run(*args, **meta):
            through_triton.append((grid, args, meta))
            return compiled
        return run
    compiled = _Compiled()
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "_compiled", {})
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", triton.knobs.HookChain())  # no hook
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "__getitem__", getitem)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    x, y = torch.zeros(64), torch.zeros(64)
    launch.launch_kernel(_kernel, (2,), x, y, 32, True, 0.5, 16, num_warps=4)
    launch.launch_kernel(_kernel, (5, 3), x, y, 48, True, 0.25, 16, num_warps=4)
    assert len(through_triton) == 1
    assert compiled.launches == [(5, 3, 1, 1234, "function", "metadata", None, None, None,
                                  x.data_ptr(), y.data_ptr(), 48, True, 0.25, 16, 3)]
    launch.launch_kernel(_kernel, (2,), x, y, 33, True, 0.5, 16, num_warps=4)  # a new key
    assert len(through_triton) == 2 and len(compiled.launches) == 1
    triton.knobs.runtime.launch_enter_hook.add(lambda metadata: None)  # a profiler's hook
    launch.launch_kernel(_kernel, (5, 3), x, y, 48, True, 0.25, 16, num_warps=4)
    assert len(through_triton) == 3 and len(compiled.launches) == 1


def test_disabled_off_the_tested_triton_or_the_gpu(monkeypatch):
    """Without a GPU, under the interpreter or on a Triton version not checked, every call is Triton's own."""
    calls = []
    monkeypatch.setattr(launch, "ENABLED", False)
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "__getitem__",
                        lambda kernel, grid: lambda *a, **k: calls.append(grid))
    for _ in range(3):
        launch.launch_kernel(_kernel, (1,), torch.zeros(4), torch.zeros(4), 3, True, 1.0, 4)
    assert calls == [(1,)] * 3
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(triton, "__version__", "9.9.0")
    assert not launch.enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 8, 3], ids=["aligned", "16-byte offset", "misaligned"])
def test_operator_bits_match_tritons_own_launch(monkeypatch, offset):
    """The SSE operator's forward and backward through the fast path (after a first call per key) equal those
    through Triton's launch bit for bit, on q, k and v read in place from one wide tensor at `offset` bf16
    columns (misaligned pointers key kernels of their own)."""
    from kernels import sse_attention
    torch.manual_seed(0)
    B, T, H, c, N = 2, 200, 4, 64, 4
    wide = torch.randn(B, T, offset + 3 * H * c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rest = dict(log_decay=torch.randn(B, T, H, c, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                router_logits=torch.randn(B, T, N, device="cuda", requires_grad=True),
                q_shared=torch.randn(B, T, H, c, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                k_shared_logits=torch.randn(B, T, H, c, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    do = torch.randn(B, T, H, c, device="cuda", dtype=torch.bfloat16)

    def step():
        q, k, v = wide[..., offset:].split(H * c, -1)
        o, _ = sse_attention(q.view(B, T, H, c), k.view(B, T, H, c), v.view(B, T, H, c), **rest, top_k=1,
                             decay_normalizer=16.0, impl="triton_indexed")
        leaves = [wide, *rest.values()]
        return [o.detach(), *torch.autograd.grad((o * do).sum(), leaves)]
    monkeypatch.setattr(launch, "ENABLED", False)
    reference = step()
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "_compiled", {})
    step()  # the first call of each key goes through Triton
    calls = []
    original = triton.runtime.jit.JITFunction.__getitem__
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "__getitem__",
                        lambda kernel, grid: calls.append(kernel) or original(kernel, grid))
    fast = step()
    assert not calls, f"{len(calls)} launches took Triton's path"
    for got, want in zip(fast, reference):
        assert torch.equal(got, want)
