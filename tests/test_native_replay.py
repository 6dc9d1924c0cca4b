"""The launchers' own CUDA-graph replay (:mod:`interop.native.replay`): its key, its switch, and where it stays
off. The replay itself (bytes, captures, faults) is pinned on CUDA in ``test_native_graphs.py``."""

from __future__ import annotations

import pytest
import torch

from interop import sglang
from interop.native import keys, replay, triton_kernels


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
    assert replay.sig(inf)[-2] is True
    assert replay.sig(torch.zeros(3, requires_grad=True))[-1] is True
    assert replay.sig((1, None, [True, "x"])) == (1, None, (True, "x"))
    with pytest.raises(replay.NotKeyable):
        replay.sig({"a": 1})


def test_the_lean_tensor_keys_name_what_each_torch_mode_needs():
    t = torch.zeros(4, 6, dtype=torch.int64)
    with torch.inference_mode():
        inf = torch.zeros(4, 6, dtype=torch.int64)
    full = replay.full_tensor_key
    lean = replay.tensor_key(True, False)  # inside inference mode every tensor may be updated in place
    assert lean(t) == (t.data_ptr(), (4, 6), (6, 1), torch.int64)
    assert lean(t.view(torch.int32)) != lean(t) and lean(t.t()) != lean(t) and lean(t[1:]) != lean(t)
    no_grad = replay.tensor_key(False, False)  # outside it an inference tensor is refused, so it is named
    assert no_grad(inf)[-1] is True and no_grad(t)[-1] is False
    assert replay.tensor_key(False, True) is full  # with grad mode, requires_grad too
    assert full(torch.zeros(3, requires_grad=True))[-1] is True
    assert replay.sig((t, None, 3), lean) == (lean(t), None, 3)
    holder = type("Holder", (), {"t": t, "n": 7})()
    assert replay.fields_sig(holder, ("t",), ("n",), lean)[1:] == (lean(t), (int, 7))


def test_a_tensor_field_keys_only_torch_tensors():
    """A tensor field holding anything but a torch tensor or None has no key (a DLPack capsule is imported afresh
    every launch; a wrong type is refused by the checks, which must then run)."""
    t = torch.zeros(3, dtype=torch.int64)
    assert replay.tensors_sig((t, None)) == (replay.full_tensor_key(t), None)
    for bad in (t.__dlpack__(), 3, "x", t.numpy()):
        with pytest.raises(replay.NotKeyable):
            replay.tensors_sig((bad,))
        with pytest.raises(replay.NotKeyable):
            replay.fields_sig(type("Plan", (), {"x": bad})(), ("x",))
    with pytest.raises(replay.NotKeyable):
        replay.sig(t.__dlpack__())  # hashable, but a capsule


def test_fields_sig_marks_a_missing_field():
    class Ctx:
        canary_buf = torch.zeros(2, 32, dtype=torch.uint8)

    a = replay.fields_sig(Ctx(), ("canary_buf", "violation_ring"))
    assert a[0] is Ctx and a[2] == keys._MISSING
    assert replay.fields_sig(Ctx(), ("violation_ring",)) == (Ctx, keys._MISSING)  # one name, missing


def test_no_key_for_cpu_tensors_or_the_dlpack_path():
    buf = torch.zeros(8, 32, dtype=torch.uint8)
    never = lambda k: pytest.fail("parts() is only asked for where replay applies")  # noqa: E731
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
        return sglang._replay_key("verify", path, None, buf, lambda k: (replay.sig(buf, k), flag))

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
    from canary_jax.ops import buckets

    old = buckets.default_buckets()
    try:
        buckets.set_default_buckets((64,))
        assert k != key(True)  # the bucket policy decides the staging a graph captured
    finally:
        buckets.set_default_buckets(old.sizes, minimum=old.minimum)
    assert k == key(True)
    assert sglang._replay_key("verify", "dlpack", None, buf, lambda k: ()) is None
    assert sglang._replay_key("verify", None, "reference", buf, lambda k: ()) is None  # the jnp reference: DLPack


def test_a_tensor_passed_as_a_scalar_is_not_keyed():
    with pytest.raises(replay.NotKeyable, match="scalar"):
        replay.value_sig(torch.tensor(True))
    assert replay.value_sig(3) == replay.value_sig(3) != replay.value_sig(3.0)  # the checks take only the int
    assert replay.value_sig(None) is None

    class Src:
        tensor = torch.zeros(2, 16, dtype=torch.uint8)
        page_size = torch.tensor(1)

    with pytest.raises(replay.NotKeyable):
        replay.fields_sig(Src(), ("tensor",), ("page_size",))


class _FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


@pytest.fixture
def graphs(monkeypatch):
    """A LaunchGraphs whose capture stores a fake graph (the bookkeeping, without CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv(replay.GRAPHS_ENV, "2")
    g = replay.LaunchGraphs()

    def capture(key, launch, limit):
        capturable, tensors = launch()
        if not capturable:
            g._note(key, replay._EAGER)
            return
        g._store(key, _FakeGraph(), tuple(tensors), limit).replays += 1

    monkeypatch.setattr(g, "_capture", capture)
    return g


def test_sightings_capture_and_replay(graphs):
    calls = []
    launch = lambda: calls.append(1) or (True, ())  # noqa: E731
    graphs.run("a", launch)  # first sighting: eager
    assert (len(calls), len(graphs)) == (1, 0)
    graphs.run("a", launch)  # second: captured (the fake records by running)
    assert (len(calls), len(graphs)) == (2, 1)
    assert graphs.replay("a") and graphs.replay("a")
    assert len(calls) == 2 and graphs._graphs["a"].graph.replays == 2


def test_a_launch_that_raises_is_not_a_sighting(graphs):
    def bad():
        raise ValueError("kv-canary: refused")

    for _ in range(3):
        with pytest.raises(ValueError, match="refused"):
            graphs.run("a", bad)
    assert graphs._seen.get("a") is None and len(graphs) == 0


def test_a_fallback_stays_eager(graphs):
    calls = []
    for _ in range(4):
        graphs.run("a", lambda: calls.append(1) or (False, ()))
    assert len(calls) == 4 and len(graphs) == 0 and graphs._seen["a"] == replay._EAGER


def test_eviction_before_min_replays_leaves_the_key_eager(graphs):
    ok = lambda: (True, ())  # noqa: E731
    for key in ("a", "b", "c"):  # the cap is 2: "c" evicts "a" after its one replay
        graphs.run(key, ok)
        graphs.run(key, ok)
    assert list(graphs._graphs) == ["b", "c"] and graphs._seen["a"] == replay._EAGER
    graphs.run("a", ok)
    graphs.run("a", ok)
    assert "a" not in graphs._graphs  # thrashing keys are not captured again
    for _ in range(replay.MIN_REPLAYS):
        assert graphs.replay("b")
    graphs.run("d", ok)
    graphs.run("d", ok)  # evicts "c" (1 replay): eager; then "b" would be next
    assert list(graphs._graphs) == ["b", "d"] and graphs._seen["c"] == replay._EAGER
    graphs.run("e", ok)
    graphs.run("e", ok)  # evicts "b", which replayed enough: it may be captured again
    assert graphs._seen["b"] == 0


def test_turning_replay_off_drops_the_graphs_at_once(graphs, monkeypatch):
    ok = lambda: (True, ())  # noqa: E731
    graphs.run("a", ok)
    graphs.run("a", ok)
    assert graphs.replay("a")
    monkeypatch.setenv(replay.GRAPHS_ENV, "0")
    assert not graphs.replay("a") and len(graphs) == 0


def test_seen_keys_are_capped(graphs, monkeypatch):
    monkeypatch.setattr(replay, "_MAX_SEEN", 5)
    for i in range(20):
        graphs.run(("k", i), lambda: (True, ()))
    assert len(graphs._seen) == 5 and ("k", 19) in graphs._seen


def test_plan_scalars_and_sources_are_named():
    from interop.sglang_types import CanaryDeviceState, RealKvSource, VerifyPlan, WritePlan

    vp = VerifyPlan.allocate(verify_capacity=8)
    wp = WritePlan.allocate(write_req_capacity=2)
    kw = dict(
        verify_plan_out=vp,
        write_plan_out=wp,
        req_pool_indices=torch.tensor([1, 2]),
        prefix_lens=torch.zeros(2, dtype=torch.int64),
        extend_seq_lens=torch.ones(2, dtype=torch.int64),
        req_to_token=torch.zeros(3, 4, dtype=torch.int32),
        swa_window_size=0,
        full_to_swa_index_mapping=None,
        verify_capacity=8,
        req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None,
        kv_token_id_vs_position_offset=0,
    )
    for name, bad in (("swa_window_size", None), ("verify_capacity", 8.0), ("kv_token_id_vs_position_offset", "0")):
        with pytest.raises(TypeError, match=rf"kv-canary: {name} must be an int, got"):
            sglang.launch_canary_plan_kernels(**{**kw, name: bad})
    sglang.launch_canary_plan_kernels(**{**kw, "verify_capacity": torch.tensor(8)})  # a 0-d integer tensor is an int
    assert int(vp.verify_num_valid[0]) == 0 and int(wp.write_offsets[2]) == 2

    state = CanaryDeviceState.allocate(ring_capacity=4)
    buf = torch.zeros(16, 32, dtype=torch.uint8)
    pool = torch.zeros(16, 16, dtype=torch.uint8)
    src = RealKvSource(tensor=pool, page_size=1, num_bytes_per_token=16, read_bytes=16)
    ctx = state.context(canary_buf=buf, kernel_kind=sglang.CanaryLaunchTag.TAIL_K_FULL)
    bad_ctx = type(ctx)(**{**{f: getattr(ctx, f) for f in ctx.__slots__}, "real_kv_sources": src})
    with pytest.raises(TypeError, match=r"real_kv_sources must be a tuple of RealKvSource .*got RealKvSource"):
        sglang.launch_canary_verify_kernel(context=bad_ctx, plan=vp, check_verify_expected_token=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_inside_a_callers_capture_outlives_the_callers_slice():
    """A graph runner passes a new slice every call; the staging copy its graph captured must stay allocated."""
    from interop import padding

    base = torch.arange(10, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        padding.pad_rows(base[:5], 16)  # warm-up, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = padding.pad_rows(base[:5], 16, fill=7)
    assert any(v[0] is out for v in padding._PINNED.values())
    del out
    base[:5] = torch.arange(100, 105, device="cuda")
    graph.replay()
    pinned = [v[0] for v in padding._PINNED.values() if v[0].shape == (16,)]
    assert pinned[-1].tolist() == [100, 101, 102, 103, 104] + [7] * 11
