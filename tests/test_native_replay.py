"""The launchers' own CUDA-graph replay (:mod:`interop.native.replay`): its key, its switch, and where it stays
off. The replay itself (bytes, captures, faults) is pinned on CUDA in ``test_native_graphs.py``."""

from __future__ import annotations

import pytest
import torch

from interop import sglang
from interop.native import replay, triton_kernels


def test_max_graphs_reads_the_environment(monkeypatch):
    monkeypatch.delenv(replay.GRAPHS_ENV, raising=False)
    assert replay.max_graphs() == replay.DEFAULT_MAX_GRAPHS
    monkeypatch.setenv(replay.GRAPHS_ENV, "0")
    assert replay.max_graphs() == 0
    monkeypatch.setenv(replay.GRAPHS_ENV, " 7 ")
    assert replay.max_graphs() == 7
    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv(replay.GRAPHS_ENV, bad)
        with pytest.raises(ValueError, match=r"\$CANARY_JAX_NATIVE_GRAPHS must be a non-negative integer"):
            replay.max_graphs()


def test_the_key_names_memory_layout_and_values():
    base = torch.zeros(4, 6, dtype=torch.int64)
    same = base.view(4, 6)
    assert replay.sig(base) == replay.sig(same)  # another tensor object over the same memory and layout
    assert replay.sig(base) != replay.sig(base.t())  # same memory, other strides
    assert replay.sig(base) != replay.sig(base.view(24))  # same memory, other shape
    assert replay.sig(base) != replay.sig(base.view(torch.int32))  # same memory, other dtype
    assert replay.sig(base[1:]) != replay.sig(base[:3])  # other address
    with torch.inference_mode():
        inf = torch.zeros(3)
    assert replay.sig(inf)[-1] is True
    assert replay.sig((1, None, [True, "x"])) == (1, None, (True, "x"))
    with pytest.raises(replay.NotKeyable):
        replay.sig({"a": 1})


def test_fields_sig_marks_a_missing_field():
    class Ctx:
        canary_buf = torch.zeros(2, 32, dtype=torch.uint8)

    a = replay.fields_sig(Ctx(), ("canary_buf", "violation_ring"))
    assert a[0] is Ctx and a[2] == replay._MISSING


def test_no_key_for_cpu_tensors_or_the_dlpack_path():
    buf = torch.zeros(8, 32, dtype=torch.uint8)
    never = lambda: pytest.fail("parts() is only asked for where replay applies")  # noqa: E731
    assert sglang._replay_key("verify", None, None, buf, never) is None
    assert sglang._replay_key("verify", "dlpack", None, buf, never) is None
    assert sglang._replay_key("verify", None, None, object(), never) is None


def test_run_without_a_key_launches_each_time():
    graphs = replay.LaunchGraphs()
    calls = []
    for _ in range(3):
        graphs.run(None, lambda: calls.append(1) or (True, ()))
    assert len(calls) == 3 and len(graphs) == 0 and graphs.captures == 0
    assert graphs.replay(None) is False


@pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_kernels.triton_available()), reason="needs CUDA and triton"
)
def test_cuda_key_separates_what_the_checks_and_program_depend_on(monkeypatch):
    buf = torch.zeros(8, 32, dtype=torch.uint8, device="cuda")

    def key(flag, path=None):
        return sglang._replay_key("verify", path, None, buf, lambda: (replay.sig(buf), flag))

    k = key(True)
    assert k is not None
    assert k == key(True)
    assert k != key(False)
    assert k != key(True, path="native")
    monkeypatch.setenv("CANARY_JAX_BACKEND", "pallas")
    assert k != key(True)
    monkeypatch.delenv("CANARY_JAX_BACKEND")
    with torch.inference_mode():
        assert k != key(True)
    assert sglang._replay_key("verify", "dlpack", None, buf, lambda: ()) is None
    assert sglang._replay_key("verify", None, "reference", buf, lambda: ()) is None  # the jnp reference: DLPack
