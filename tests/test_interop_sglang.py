"""interop.sglang on CPU tensors: SGLang's calls, SGLang's bytes, SGLang's errors.

Every launch runs on one copy of an SGLang-shaped torch state through the drop-in launchers and on another
through the independent re-implementation of SGLang's torch references (helpers/torch_reference.py); all tensors
(canary buffer, ring, write index, both per-tag counter arrays, plan outputs) must be byte-identical after
every call. Error cases check the message names the argument and that no tensor changed.
"""

from __future__ import annotations

import random
import types
import zlib

import pytest
import torch

from helpers.interop_world import World, assert_same_bytes, random_verify_plan, random_write_args
from helpers.torch_reference import ref_plan, ref_verify, ref_write
from interop import buffers, runner, sglang

BACKENDS = ["reference"]
try:  # the Pallas kernels land separately; run them interpreted on CPU when present
    import pallas_kernels.verify  # noqa: F401
    import pallas_kernels.write  # noqa: F401

    BACKENDS.append("pallas")
except ImportError:
    pass


def _clone_plan(p):
    return type(p)(**{f: getattr(p, f).clone() for f in p.__dataclass_fields__})


def _run_pair(rng, w_ours, w_ref, op, tag, backend):
    """One random launch on both worlds; returns a label."""
    if op == "write":
        plan, kw = random_write_args(rng, w_ours)
        sglang.launch_canary_write_kernel(context=w_ours.context(tag), plan=plan, backend=backend, **kw)
        ref_write(context=w_ref.context(tag), plan=_clone_plan(plan), **kw)
    else:
        plan = random_verify_plan(rng, w_ours)
        check = rng.random() < 0.5
        sglang.launch_canary_verify_kernel(
            context=w_ours.context(tag), plan=plan, check_verify_expected_token=check, backend=backend
        )
        ref_verify(context=w_ref.context(tag), plan=_clone_plan(plan), check_verify_expected_token=check)
    return op


CONFIGS = {
    # name: (sources, mode, stride)
    "none": ((), 0, 32),
    "partial_2src": (((torch.bfloat16, 1, 64, 32, 0), (torch.float32, 4, 32, 32, 16)), 1, 32),
    "all_4src_stride48": (
        (
            (torch.uint8, 1, 16, 16, 0),
            (torch.int64, 2, 32, 16, 0),
            (torch.float16, 1, 48, 32, 16),
            (torch.uint8, 16, 16, 16, 0),
        ),
        2,
        48,
    ),
}


CASES = [(c, "reference") for c in CONFIGS] + [("partial_2src", b) for b in BACKENDS if b != "reference"]


@pytest.mark.parametrize("config,backend", CASES)
def test_random_launches_match_sglang_reference_bytes(config, backend):
    rng = random.Random(zlib.crc32(config.encode()))  # stable across processes (hash() of a str is not)
    sources, mode, stride = CONFIGS[config]
    ours = World.make(rng, sources=sources, mode=mode, stride=stride)
    ref = ours.clone()
    ops = ["write"] * 6 + ["verify"] * 6 + ["write", "verify"] * 3
    if backend == "pallas":  # interpreted on CPU: slow, so a short smoke run
        ops = ["write", "write", "verify"]
    tags = [int(sglang.CanaryLaunchTag.TAIL_K_FULL), int(sglang.CanaryLaunchTag.HEAD_V_SWA)]
    for step, op in enumerate(ops):
        if step % 5 == 4:  # corrupt a KV byte and a canary field on both sides
            kv_byte, slot, byte = rng.randrange(16), rng.randrange(1, ours.buf.shape[0]), rng.randrange(32)
            for w in (ours, ref):
                if w.kv:
                    w.kv[0].view(torch.uint8).view(-1)[kv_byte] ^= 0x5A
                w.buf[slot, byte] ^= 0x01
        _run_pair(rng, ours, ref, op, tags[op == "verify"], backend)
        assert_same_bytes(ours.tensors(), ref.tensors(), f"{config} step {step} ({op})")
    if backend == "reference":  # the scenario must have overflowed the ring and written plenty
        assert int(ours.state.violation_write_index.item()) > ours.state.violation_ring.shape[0]
        assert int(ours.state.slot_run_counters.sum()) > 10


@pytest.mark.skipif("pallas" not in BACKENDS, reason="no Pallas kernels")
def test_cpu_tensors_on_a_gpu_host_run_the_pallas_kernels_interpreted(monkeypatch):
    """Interpret mode follows the tensors' device, not JAX's default backend: on a GPU host, CPU tensors with
    backend="pallas" run the kernels interpreted (compiled for the GPU they cannot run on CPU data). Simulated
    by making JAX's default backend report a GPU."""
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    rng = random.Random(21)
    ours = World.make(rng)
    ref = ours.clone()
    tag = int(sglang.CanaryLaunchTag.TAIL_K_FULL)
    for step in range(2):
        ours.buf[rng.randrange(1, 61), rng.randrange(32)] ^= 0x10  # something for verify to find
        ref.buf.copy_(ours.buf)
        _run_pair(rng, ours, ref, "verify", tag, "pallas")
        assert_same_bytes(ours.tensors(), ref.tensors(), f"verify {step}")
    assert int(ours.state.violation_write_index.item()) > 0


def test_tensors_are_updated_in_place():
    rng = random.Random(3)
    w = World.make(rng)
    ptrs = {k: t.data_ptr() for k, t in w.tensors().items()}
    ids = {k: id(t) for k, t in w.tensors().items()}
    plan = sglang.WritePlan.allocate(write_req_capacity=2)
    plan.write_offsets.copy_(torch.tensor([0, 3, 3]))
    plan.write_seed_slot_indices.copy_(torch.tensor([-1, -1]))
    plan.write_num_valid_reqs.fill_(1)
    ctx = w.context(int(sglang.CanaryLaunchTag.TAIL_K_FULL))
    sglang.launch_canary_write_kernel(
        context=ctx,
        plan=plan,
        input_ids=torch.tensor([101, 202, 303]),
        positions=torch.tensor([0, 1, 2]),
        out_cache_loc=torch.tensor([5, 6, 7]),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    assert {k: t.data_ptr() for k, t in w.tensors().items()} == ptrs
    assert {k: id(t) for k, t in w.tensors().items()} == ids
    rows = w.buf.view(torch.int64)[5:8, :3].tolist()
    assert rows[0] == [101, 0, -2414019407054260458]  # SPEC 2.6 chain head
    assert [r[2] & (2**64 - 1) for r in rows[1:]] == [0x542FE5061275A6AB, 0x9890D56BDE53142E]
    assert w.state.slot_run_counters.tolist()[2] == 3 and w.state.kernel_run_counters.tolist()[2] == 1
    assert sum(w.state.kernel_run_counters.tolist()) == 1  # the neighbours of the counter view are untouched


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_write_with_no_tokens_only_counts_the_launch(backend):
    w = World.make(random.Random(4))
    before = w.buf.clone()
    plan = sglang.WritePlan.allocate(write_req_capacity=2)
    plan.write_offsets.zero_()
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.zero_()
    empty = torch.zeros(0, dtype=torch.int64)
    sglang.launch_canary_write_kernel(
        context=w.context(int(sglang.CanaryLaunchTag.TAIL_K_FULL)),
        plan=plan,
        input_ids=empty,
        positions=empty,
        out_cache_loc=empty,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        backend=backend,
    )
    assert torch.equal(w.buf, before)
    assert w.state.kernel_run_counters.tolist()[2] == 1 and w.state.slot_run_counters.tolist()[2] == 0


def test_steady_state_launch_does_not_retrace_or_reimport():
    rng = random.Random(4)
    w = World.make(rng, sources=((torch.uint8, 1, 16, 16, 0),), mode=1)
    plan = random_verify_plan(rng, w)
    ctx = w.context(2)
    sglang.launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=True)
    traces = runner.trace_count()
    cache = buffers.import_cache()
    misses = cache.misses
    for _ in range(5):
        plan.verify_num_valid.fill_(rng.randrange(11))  # new values, same tensors
        sglang.launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=True)
    assert runner.trace_count() == traces
    assert cache.misses == misses  # every tensor came from the import cache


def test_import_cache_entries_die_with_their_tensor():
    rng = random.Random(5)
    w = World.make(rng)
    plan = random_verify_plan(rng, w)
    sglang.launch_canary_verify_kernel(context=w.context(0), plan=plan, check_verify_expected_token=False)
    n = len(buffers.import_cache())
    del plan
    import gc

    gc.collect()
    assert len(buffers.import_cache()) < n


def test_backend_keyword_and_environment(monkeypatch):
    rng = random.Random(6)
    w = World.make(rng)
    plan = random_verify_plan(rng, w)
    monkeypatch.setenv("CANARY_JAX_BACKEND", "reference")
    sglang.launch_canary_verify_kernel(context=w.context(0), plan=plan, check_verify_expected_token=False)
    monkeypatch.setenv("CANARY_JAX_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend must be one of"):
        sglang.launch_canary_verify_kernel(context=w.context(0), plan=plan, check_verify_expected_token=False)
    sglang.launch_canary_verify_kernel(
        context=w.context(0), plan=plan, check_verify_expected_token=False, backend="reference"
    )  # the keyword wins
    with pytest.raises(ValueError, match="backend must be one of"):
        sglang.launch_canary_verify_kernel(
            context=w.context(0), plan=plan, check_verify_expected_token=False, backend="cuda"
        )


def test_duck_typed_objects_are_accepted():
    class Anything:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    rng = random.Random(7)
    w = World.make(rng, sources=((torch.uint8, 1, 16, 16, 0),), mode=2)
    ref = w.clone()
    st = w.state
    src = Anything(tensor=w.kv[0], page_size=1, num_bytes_per_token=16, read_bytes=16)
    ctx = Anything(
        canary_buf=w.buf,
        kernel_kind=3,
        violation_ring=st.violation_ring,
        violation_write_index=st.violation_write_index,
        slot_run_counter=st.slot_run_counters[3:4],
        kernel_run_counter=st.kernel_run_counters[3:4],
        real_kv_sources=[src],
        real_kv_hash_mode=2,
        enable_chain_position_assert=st.enable_chain_position_assert,
    )
    plan, kw = random_write_args(rng, w)
    duck_plan = Anything(**{f: getattr(plan, f) for f in plan.__dataclass_fields__})
    sglang.launch_canary_write_kernel(context=ctx, plan=duck_plan, **kw)
    ref_write(context=ref.context(3), plan=plan, **kw)
    assert_same_bytes(w.tensors(), ref.tensors(), "duck-typed write")


# --- plan ------------------------------------------------------------------------------------------------
def _plan_inputs(rng, *, bs=5, max_reqs=6, max_len=24, n_slots=80, lut=False, pool=False, w=0, k=0):
    r2t = torch.zeros(max_reqs, max_len, dtype=torch.int32)
    for r in range(1, max_reqs):
        r2t[r] = torch.tensor([rng.randrange(1, n_slots) for _ in range(max_len)], dtype=torch.int32)
    rows = [rng.randrange(1, max_reqs) for _ in range(bs - 1)] + [0]  # a padding row at the end
    kw = dict(
        req_pool_indices=torch.tensor(rows),
        prefix_lens=torch.tensor([rng.randrange(0, 12) for _ in rows]),
        extend_seq_lens=torch.tensor([rng.randrange(0, 4) for _ in rows]),
        req_to_token=r2t,
        swa_window_size=w,
        full_to_swa_index_mapping=None,
        req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None,
        kv_token_id_vs_position_offset=k,
    )
    if lut:
        kw["full_to_swa_index_mapping"] = torch.tensor(
            [0] + [rng.choice([0, rng.randrange(1, 40)]) for _ in range(n_slots)]
        )
    if pool:
        kw["req_to_verify_expected_tokens"] = torch.randint(0, 1000, (max_reqs, max_len + 2), dtype=torch.int32)
        kw["req_to_verify_expected_tokens_valid_lens"] = torch.tensor([rng.randrange(0, max_len) for _ in rows])
    return kw


def check_plan_variant(variant: str, *, salt: bytes = b"", trials: int = 4) -> None:
    """Random plan launches of one variant (full, SWA with a LUT, expected-token pool with an offset), byte for
    byte against SGLang's torch reference; stale output contents must survive where SGLang leaves them."""
    rng = random.Random(zlib.crc32(salt + variant.encode()))  # stable across processes
    opts = {"full": {}, "swa_lut": dict(lut=True, w=5), "pool_eagle": dict(pool=True, k=1)}[variant]
    for trial in range(trials):
        cap = [40, 8][trial % 2]  # 8 overflows most batches
        kw = _plan_inputs(rng, **opts)
        vp = sglang.VerifyPlan.allocate(verify_capacity=cap).zero_for_testing_()
        wp = sglang.WritePlan.allocate(write_req_capacity=6).zero_for_testing_()
        vp.verify_slot_indices.fill_(77)
        vp2, wp2 = _clone_plan(vp), _clone_plan(wp)
        sglang.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, verify_capacity=cap, **kw)
        ref_plan(verify_plan_out=vp2, write_plan_out=wp2, verify_capacity=cap, **kw)
        for f in vp.__dataclass_fields__:
            assert torch.equal(getattr(vp, f), getattr(vp2, f)), (variant, trial, f)
        for f in wp.__dataclass_fields__:
            assert torch.equal(getattr(wp, f), getattr(wp2, f)), (variant, trial, f)


@pytest.mark.parametrize("variant", ["full", "swa_lut", "pool_eagle"])
def test_plan_matches_sglang_reference_bytes(variant):
    check_plan_variant(variant)


def test_plan_errors_are_sglangs():
    rng = random.Random(9)
    kw = _plan_inputs(rng)
    vp, wp = sglang.VerifyPlan.allocate(verify_capacity=8), sglang.WritePlan.allocate(write_req_capacity=6)
    with pytest.raises(ValueError, match="requires full_to_swa_index_mapping when swa_window_size > 0"):
        sglang.launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, verify_capacity=8, **{**kw, "swa_window_size": 4}
        )
    with pytest.raises(ValueError, match=r"torch_reference verify_capacity=9 does not match .*shape\[0\]=8"):
        sglang.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, verify_capacity=9, **kw)
    with pytest.raises(ValueError, match="requires req_to_verify_expected_tokens_valid_lens"):
        sglang.launch_canary_plan_kernels(
            verify_plan_out=vp,
            write_plan_out=wp,
            verify_capacity=8,
            **{**kw, "req_to_verify_expected_tokens": torch.zeros(6, 30, dtype=torch.int32)},
        )
    with pytest.raises(TypeError, match="req_to_token must have dtype torch.int32, got torch.int64"):
        sglang.launch_canary_plan_kernels(
            verify_plan_out=vp,
            write_plan_out=wp,
            verify_capacity=8,
            **{**kw, "req_to_token": kw["req_to_token"].long()},
        )
    with pytest.raises(ValueError, match="bs=5 exceeds write_req_capacity=4"):
        sglang.launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=sglang.WritePlan.allocate(write_req_capacity=4), verify_capacity=8, **kw
        )


# --- errors ----------------------------------------------------------------------------------------------
def _write_kw(w, **over):
    plan = sglang.WritePlan.allocate(write_req_capacity=2)
    plan.write_offsets.copy_(torch.tensor([0, 2, 2]))
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(1)
    kw = dict(
        context=w.context(2),
        plan=plan,
        input_ids=torch.tensor([1, 2]),
        positions=torch.tensor([0, 1]),
        out_cache_loc=torch.tensor([3, 4]),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    kw.update(over)
    return kw


def _snapshot(w):
    return {k: t.clone() for k, t in w.tensors().items()}


def _ctx(w, tag=2, **over):
    import dataclasses

    return dataclasses.replace(w.context(tag), **over)


ERROR_CASES = {
    "five_sources": (
        ValueError,
        r"at most 4 RealKvSource entries supported by the CUDA ABI, got 5",
        lambda w: dict(context=_ctx(w, real_kv_sources=w.sources() * 5)),
    ),
    "noncontiguous_ids": (
        ValueError,
        r"^kv-canary: input_ids must be contiguous$",
        lambda w: dict(input_ids=torch.tensor([1, 9, 2, 9])[::2]),
    ),
    "noncontiguous_ring": (
        ValueError,
        r"^kv-canary: violation_ring must be contiguous$",
        lambda w: dict(context=_ctx(w, violation_ring=w.state.violation_ring.t().contiguous().t())),
    ),
    "int32_positions": (
        TypeError,
        r"positions must have dtype torch.int64, got torch.int32",
        lambda w: dict(positions=torch.tensor([0, 1], dtype=torch.int32)),
    ),
    "ring_int32": (
        TypeError,
        r"violation_ring must have dtype torch.int64",
        lambda w: dict(context=_ctx(w, violation_ring=torch.zeros(4, 8, dtype=torch.int32))),
    ),
    "counter_shape": (
        ValueError,
        r"slot_run_counter must have shape \[1\], got \[2\]$",
        lambda w: dict(context=_ctx(w, slot_run_counter=w.state.slot_run_counters[2:4])),
    ),
    "length_mismatch": (
        ValueError,
        r"^kv-canary: input_ids \(2 entries\) is shorter than out_cache_loc \(3 entries\); they must have the same "
        r"length$",
        lambda w: dict(out_cache_loc=torch.tensor([3, 4, 5])),
    ),
    "ids_shorter_than_positions": (
        ValueError,
        r"^kv-canary: input_ids \(2 entries\) is shorter than positions \(3 entries\)",
        lambda w: dict(positions=torch.tensor([0, 1, 2])),
    ),
    "bool_positions": (
        TypeError,
        r"^kv-canary: positions must have dtype torch.int64, got torch.bool$",
        lambda w: dict(positions=torch.tensor([True, False])),
    ),
    "uint64_ids": (
        TypeError,
        r"^kv-canary: input_ids must have dtype torch.int64, got torch.uint64$",
        lambda w: dict(input_ids=torch.tensor([2**63, 1], dtype=torch.uint64)),
    ),
    "expected_missing": (
        ValueError,
        "expected input tensors are required when enable_write_input_assert=True",
        lambda w: dict(enable_write_input_assert=True),
    ),
    "expected_extra": (
        ValueError,
        "expected input tensors must be None when enable_write_input_assert=False",
        lambda w: dict(expected_input_tokens=torch.tensor([1, 2])),
    ),
    "offsets_len": (
        ValueError,
        r"canary_write: write_offsets.size\(0\) must equal write_req_capacity \+ 1 \(3\), got 4",
        lambda w: dict(
            plan=sglang.WritePlan(
                write_offsets=torch.zeros(4, dtype=torch.int64),
                write_seed_slot_indices=torch.zeros(2, dtype=torch.int64),
                write_num_valid_reqs=torch.ones(1, dtype=torch.int32),
            )
        ),
    ),
    "zero_slots": (
        ValueError,
        r"^kv-canary: canary_buf must have between 1 and 2\*\*31 - 1 slots, got 0$",
        lambda w: dict(context=_ctx(w, canary_buf=torch.zeros(0, 32, dtype=torch.uint8))),
    ),
    "stride_16": (
        ValueError,
        r"canary_buf slot stride must hold at least 4 int64 fields, got 2",
        lambda w: dict(context=_ctx(w, canary_buf=torch.zeros(8, 16, dtype=torch.uint8))),
    ),
    "aliasing_counters": (
        ValueError,
        r"slot_run_counter overlaps kernel_run_counter|kernel_run_counter overlaps slot_run_counter",
        lambda w: dict(context=_ctx(w, kernel_run_counter=w.state.slot_run_counters[2:3])),
    ),
    "ring_aliases_buf": (
        ValueError,
        r"overlaps",
        lambda w: dict(context=_ctx(w, violation_ring=w.buf.view(torch.int64)[:4, :].reshape(-1)[:16].reshape(2, 8))),
    ),
    "source_aliases_output": (
        ValueError,
        r"overlaps real_kv_sources\[0\]\.tensor",
        lambda w: dict(
            context=_ctx(
                w,
                real_kv_sources=(
                    sglang.RealKvSource(tensor=w.buf, page_size=1, num_bytes_per_token=32, read_bytes=16),
                ),
                real_kv_hash_mode=sglang.RealKvHashMode.PARTIAL,
            )
        ),
    ),
    "source_3d": (
        ValueError,
        r"real_kv_sources\[0\].tensor \(viewed as uint8\) must be 2-D, got 3-D",
        lambda w: dict(
            context=_ctx(
                w,
                real_kv_sources=(
                    sglang.RealKvSource(
                        tensor=torch.zeros(61, 2, 16, dtype=torch.uint8),
                        page_size=1,
                        num_bytes_per_token=16,
                        read_bytes=16,
                    ),
                ),
            )
        ),
    ),
    "source_noncontig": (
        ValueError,
        r"^kv-canary: real_kv_sources\[0\].tensor must be contiguous$",
        lambda w: dict(
            context=_ctx(
                w,
                real_kv_sources=(
                    sglang.RealKvSource(
                        tensor=torch.zeros(61, 64, dtype=torch.uint8)[:, :32],
                        page_size=1,
                        num_bytes_per_token=16,
                        read_bytes=16,
                    ),
                ),
            )
        ),
    ),
    "source_narrow": (
        ValueError,
        r"row is too narrow for its slot layout: dim-1 is 32 bytes but page_size=4 x "
        r"num_bytes_per_token=16 needs 64",
        lambda w: dict(
            context=_ctx(
                w,
                real_kv_hash_mode=sglang.RealKvHashMode.ALL,
                real_kv_sources=(
                    sglang.RealKvSource(
                        tensor=torch.zeros(16, 32, dtype=torch.uint8),
                        page_size=4,
                        num_bytes_per_token=16,
                        read_bytes=16,
                    ),
                ),
            )
        ),
    ),
    "duck_source_fields": (
        ValueError,
        r"^kv-canary: RealKvSource.page_size must be >= 1, got 0$",
        lambda w: dict(
            context=_ctx(
                w,
                real_kv_sources=(
                    types.SimpleNamespace(
                        tensor=torch.zeros(16, 32, dtype=torch.uint8),
                        page_size=0,
                        num_bytes_per_token=16,
                        read_bytes=16,
                    ),
                ),
            )
        ),
    ),
    "bad_tag": (ValueError, r"kernel_kind must be a CanaryLaunchTag", lambda w: dict(context=_ctx(w, kernel_kind=12))),
    "consumed_capsule": (
        ValueError,
        r"input_ids is a DLPack capsule that was already consumed",
        lambda w: dict(input_ids=_consumed_capsule()),
    ),
    # Issue #12: a misaligned read-only input (input_ids) is now staged in an aligned copy on CPU
    # (tests/test_interop_buckets.py); an in-place output is still refused, saying why.
    "misaligned_canary_buf": (
        ValueError,
        r"canary_buf data pointer .* is not aligned to [0-9]+ bytes.*it is an output of the launch, updated in place, "
        r"so it is never copied",
        lambda w: dict(
            context=_ctx(w, canary_buf=torch.zeros(61 * 32 + 64, dtype=torch.uint8)[16 : 16 + 61 * 32].view(61, 32))
        ),
    ),
    "not_a_tensor": (TypeError, r"positions must be a torch.Tensor", lambda w: dict(positions=[0, 1])),
}


def _consumed_capsule():
    cap = torch.tensor([1, 2]).__dlpack__()
    torch.utils.dlpack.from_dlpack(cap)
    return cap


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_refused_write_names_the_argument_and_touches_nothing(case):
    exc, pattern, over = ERROR_CASES[case]
    rng = random.Random(11)
    w = World.make(rng, sources=((torch.uint8, 1, 16, 16, 0),), mode=1)
    kw = _write_kw(w, **over(w))
    before = _snapshot(w)
    plan_before = {f: getattr(kw["plan"], f).clone() for f in kw["plan"].__dataclass_fields__}
    with pytest.raises(exc, match=pattern):
        sglang.launch_canary_write_kernel(**kw)
    assert_same_bytes(_snapshot(w), before, case)
    for f, t in plan_before.items():
        assert torch.equal(getattr(kw["plan"], f), t)


def test_refused_verify_errors():
    rng = random.Random(12)
    w = World.make(rng)
    plan = random_verify_plan(rng, w)
    before = _snapshot(w)
    with pytest.raises(ValueError, match=r"^kv-canary: plan.verify_expected_positions must be contiguous$"):
        bad = _clone_plan(plan)
        object.__setattr__(bad, "verify_expected_positions", torch.zeros(20, dtype=torch.int64)[::2])
        sglang.launch_canary_verify_kernel(context=w.context(0), plan=bad, check_verify_expected_token=False)
    with pytest.raises(TypeError, match=r"plan.enable must have dtype torch.int32, got torch.int64"):
        bad = _clone_plan(plan)
        object.__setattr__(bad, "enable", torch.ones(1, dtype=torch.int64))
        sglang.launch_canary_verify_kernel(context=w.context(0), plan=bad, check_verify_expected_token=False)
    with pytest.raises(ValueError, match=r"at most 4 RealKvSource entries supported by the CUDA ABI, got 5"):
        src = sglang.RealKvSource(
            tensor=torch.zeros(61, 16, dtype=torch.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16
        )
        sglang.launch_canary_verify_kernel(
            context=_ctx(w, real_kv_sources=(src,) * 5), plan=plan, check_verify_expected_token=False
        )
    with pytest.raises(ValueError, match=r"violation_write_index overlaps|overlaps violation_write_index"):
        sglang.launch_canary_verify_kernel(
            context=_ctx(w, violation_write_index=plan.enable), plan=plan, check_verify_expected_token=False
        )
    assert_same_bytes(_snapshot(w), before, "verify errors")


def test_real_kv_source_validation_messages():
    t = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"page_size must be >= 1, got 0"):
        sglang.RealKvSource(tensor=t, page_size=0, num_bytes_per_token=16, read_bytes=16)
    with pytest.raises(ValueError, match=r"num_bytes_per_token must be a positive multiple of 16, got 24"):
        sglang.RealKvSource(tensor=t, page_size=1, num_bytes_per_token=24, read_bytes=16)
    with pytest.raises(
        ValueError, match=r"read_bytes must be a positive multiple of 16 in \(0, num_bytes_per_token=16\], got 0"
    ):
        sglang.RealKvSource(tensor=t, page_size=1, num_bytes_per_token=16, read_bytes=0)
    with pytest.raises(ValueError, match=r"tensor must be at least 2-D, got shape \(32,\)"):
        sglang.RealKvSource(tensor=t[0], page_size=1, num_bytes_per_token=16, read_bytes=16)
    with pytest.raises(ValueError, match=r"row stride must be a multiple of 16 bytes, got 24 bytes"):
        sglang.RealKvSource(
            tensor=torch.zeros(4, 24, dtype=torch.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16
        )
    with pytest.raises(ValueError, match="VerifyPlan verify_capacity must be positive, got 0"):
        sglang.VerifyPlan.allocate(verify_capacity=0)
    with pytest.raises(ValueError, match="WritePlan write_req_capacity must be positive, got -1"):
        sglang.WritePlan.allocate(write_req_capacity=-1)
    assert sglang.VerifyPlan.allocation_bytes(10) == 328 and sglang.WritePlan.allocation_bytes(10) == 172
