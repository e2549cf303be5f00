"""bench/model_step_paths.py: two SSE paths' training steps compared per parameter, route and operator call
(interpreted on the CPU, in the TRITON_INTERPRET=1 process)."""
import pytest

from bench import model_step_paths
from kernels import dispatch

pytestmark = pytest.mark.triton_interpret
SMALL = dict(width=64, tokens=24, pads=5, seed=0, impl="triton_indexed", against="chunk_torch_varlen", device="cpu")


def test_the_indexed_and_torch_paths_agree_everywhere():
    report = model_step_paths.compare(**SMALL)
    assert report["loss"] < 1e-6 and report["grads"][0][0] < 1e-5, report["grads"][:3]
    assert len(report["calls"]) == 2  # one per SSE layer
    for call in report["calls"]:
        assert call["flips"] == 0 and call["tokens"] == 2 * 24 - 5
        assert set(call["replayed"]) == {"triton_indexed", "triton_indexed (contiguous)",
                                         "chunk_torch_varlen (contiguous)"}
        assert max(max(errors.values()) for errors in call["replayed"].values()) < 1e-5, call["replayed"]


def test_a_path_that_is_off_shows_in_the_gradients_and_its_replay(monkeypatch):
    torch_path = dispatch.IMPLEMENTATIONS["chunk_torch_varlen"]

    def off_by_one_percent(*args, **kwargs):
        o, final = torch_path(*args, **kwargs)
        return o * 1.01, final
    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "chunk_torch_varlen", off_by_one_percent)
    report = model_step_paths.compare(**SMALL)
    assert report["grads"][0][0] > 1e-3
    for call in report["calls"]:
        assert call["replayed"]["chunk_torch_varlen (contiguous)"]["o"] == pytest.approx(0.01, rel=1e-3)
        assert call["replayed"]["triton_indexed"]["o"] < 1e-5
