"""interop on CUDA tensors: zero-copy by pointer, in place, stream order, SGLang byte parity, bad input.

Skipped without a CUDA device (and a JAX GPU backend). What each test establishes:

* imports and exports are pointer-equal (uint8 canary buffers, int32, int64 as pairs, bf16 KV);
* a launch leaves every output in the torch tensors themselves; with donation the outputs *are* the torch
  memory (``last_launch_report()['aliased']``), so nothing proportional to the pool is copied;
* stream order: a torch write queued on a side stream (behind a long sleep) that the current stream waits for
  is seen by the JAX verify; torch reads queued right after a launch see JAX's results, even when JAX's own
  stream is busy;
* the random launches and the plan produce the bytes of SGLang's torch references (re-implemented in
  helpers/torch_reference.py), and CUDA equals CPU;
* bad input (CPU mixed with CUDA, two GPUs (skipped with one GPU), wrong dtype, non-contiguous, aliasing
  outputs, consumed capsule)
  raises naming the argument and leaves the tensors untouched;
* donated buffers that alias torch memory survive many allocate/launch/free cycles (no double free).

These are the DLPack path's mechanics, so the module pins ``$CANARY_JAX_TORCH_PATH=dlpack`` (the default on
CUDA is the native path); the byte-parity tests also run on the native path.
"""

from __future__ import annotations

import gc
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers.interop_world import World, assert_same_bytes, random_verify_plan, random_write_args
from helpers.torch_reference import ref_verify, ref_write
from interop import dlpack, runner, sglang, streams


def _have_gpu() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


pytestmark = pytest.mark.skipif(not _have_gpu(), reason="needs CUDA in torch and a JAX GPU backend")

BACKENDS = ["reference", "pallas"]


@pytest.fixture(autouse=True)
def _dlpack_path(monkeypatch):
    monkeypatch.setenv("CANARY_JAX_TORCH_PATH", "dlpack")


def _clone_plan(p):
    return type(p)(**{f: getattr(p, f).clone() for f in p.__dataclass_fields__})


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64, torch.bfloat16])
def test_cuda_import_export_zero_copy(dtype):
    t = torch.zeros(1000, 32, dtype=dtype, device="cuda")
    a = dlpack.to_jax(t, name="t")
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert list(a.devices())[0].platform == "gpu"
    if dtype == torch.int64:
        assert a.shape == (1000, 32, 2)
    back = dlpack.to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.device == t.device


def test_cuda_int64_values_survive_as_pairs():
    vals = torch.tensor([0, -1, 2**40 + 5, -(2**63), 2**63 - 1], dtype=torch.int64, device="cuda")
    a = dlpack.to_jax(vals, name="vals")
    lo = jax.lax.convert_element_type(a[:, 0], jnp.uint32)
    assert a.dtype in (jnp.int32, jnp.uint32) and int(lo[2]) == 5


def _write_once(w, *, backend, tag=2, n=3, start_slot=5):
    plan = sglang.WritePlan.allocate(write_req_capacity=2, device="cuda")
    plan.write_offsets.copy_(torch.tensor([0, n, n]))
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(1)
    kw = dict(
        input_ids=torch.arange(101, 101 + n, device="cuda"),
        positions=torch.arange(n, device="cuda"),
        out_cache_loc=torch.arange(start_slot, start_slot + n, device="cuda"),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    sglang.launch_canary_write_kernel(context=w.context(tag), plan=plan, backend=backend, **kw)
    return plan, kw


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_launch_is_in_place_and_aliases_when_donation_does(backend):
    rng = random.Random(1)
    w = World.make(rng, device="cuda", sources=((torch.bfloat16, 1, 64, 64, 0),), mode=2)
    ptrs = {k: t.data_ptr() for k, t in w.tensors().items()}
    _write_once(w, backend=backend)
    torch.cuda.synchronize()
    assert {k: t.data_ptr() for k, t in w.tensors().items()} == ptrs
    rep = runner.last_launch_report()
    assert rep["donated"] == runner.donation_aliases(torch.device("cuda"))
    if rep["donated"]:
        assert "canary_buf" in rep["aliased"], rep  # no O(num_slots) copy
    assert w.buf.view(torch.int64)[5, :2].tolist() == [101, 0]
    assert w.state.slot_run_counters[2].item() == 3 and w.state.kernel_run_counters[2].item() == 1


def _random_sequence(backend, worlds, seed=2):
    """The same random launches on every world: ``(world, who)`` with who in gpu / ref / cpu; yields per step."""
    rng = random.Random(seed)
    for step, op in enumerate(["write", "write", "verify", "write", "verify", "verify"]):
        seed = rng.randrange(1 << 30)
        for world, who in worlds:
            r = random.Random(seed)
            dev = "cpu" if who == "cpu" else "cuda"
            tag = 2 if op == "write" else 7
            if op == "write":
                plan, kw = random_write_args(r, world, device=dev)
                if who == "ref":
                    ref_write(context=world.context(tag), plan=plan, **kw)
                else:
                    sglang.launch_canary_write_kernel(
                        context=world.context(tag), plan=plan, backend=backend if who == "gpu" else "reference", **kw
                    )
            else:
                plan = random_verify_plan(r, world, device=dev)
                if who == "ref":
                    ref_verify(context=world.context(tag), plan=plan, check_verify_expected_token=True)
                else:
                    sglang.launch_canary_verify_kernel(
                        context=world.context(tag),
                        plan=plan,
                        check_verify_expected_token=True,
                        backend=backend if who == "gpu" else "reference",
                    )
        yield step, op


SOURCES = ((torch.bfloat16, 1, 64, 32, 0), (torch.float32, 4, 32, 32, 16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_random_launches_match_sglang_reference(backend):
    gpu = World.make(random.Random(2), device="cuda", sources=SOURCES, mode=1)
    ref = gpu.clone()
    for step, op in _random_sequence(backend, [(gpu, "gpu"), (ref, "ref")]):
        assert_same_bytes(gpu.tensors(), ref.tensors(), f"{backend} gpu vs sglang ref, step {step} {op}")
    assert gpu.state.violation_write_index.item() > 0 and gpu.state.slot_run_counters.sum().item() > 0


def test_cuda_native_path_random_launches_match_sglang_reference(monkeypatch):
    """The native path (Triton kernels on torch's stream, torch-op glue) gives SGLang's bytes on CUDA."""
    from interop.native import launch as native
    from interop.native import triton_kernels

    if not triton_kernels.triton_available():
        pytest.skip("needs triton")
    monkeypatch.setenv("CANARY_JAX_TORCH_PATH", "native")
    gpu = World.make(random.Random(2), device="cuda", sources=SOURCES, mode=1)
    ref = gpu.clone()
    traces = native.trace_count()
    for step, op in _random_sequence("pallas", [(gpu, "gpu"), (ref, "ref")]):
        assert_same_bytes(gpu.tensors(), ref.tensors(), f"native gpu vs sglang ref, step {step} {op}")
    assert native.trace_count() > traces  # it really took the native path
    assert gpu.state.violation_write_index.item() > 0 and gpu.state.slot_run_counters.sum().item() > 0


def test_cuda_equals_cpu_bytes():
    gpu = World.make(random.Random(2), device="cuda", sources=SOURCES, mode=1)
    cpu = World.make(random.Random(2), device="cpu", sources=SOURCES, mode=1)
    for src, dst in zip(gpu.tensors().values(), cpu.tensors().values()):
        dst.copy_(src.cpu())
    for step, op in _random_sequence("reference", [(gpu, "gpu"), (cpu, "cpu")]):
        assert_same_bytes(gpu.tensors(), cpu.tensors(), f"gpu vs cpu, step {step} {op}")


# --- stream order ------------------------------------------------------------------------------------------
def _verify_setup(backend):
    rng = random.Random(3)
    w = World.make(rng, device="cuda", sources=((torch.uint8, 1, 16, 16, 0),), mode=1)
    _write_once(w, backend=backend, n=4, start_slot=8)
    plan = sglang.VerifyPlan.allocate(verify_capacity=4, device="cuda")
    plan.verify_slot_indices.copy_(torch.arange(8, 12))
    plan.verify_expected_positions.copy_(torch.arange(4))
    plan.verify_prev_slot_indices.copy_(torch.tensor([-1, 8, 9, 10]))
    plan.verify_expected_tokens.fill_(-1)
    plan.verify_num_valid.fill_(4)
    torch.cuda.synchronize()
    sglang.launch_canary_verify_kernel(
        context=w.context(2), plan=plan, check_verify_expected_token=False, backend=backend
    )
    torch.cuda.synchronize()
    assert w.state.violation_write_index.item() == 0
    return w, plan


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_jax_waits_for_a_side_stream_write_the_current_stream_waits_for(backend):
    w, plan = _verify_setup(backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the corruption lands
        w.kv[0][10, 0] ^= 0x5A  # flips a byte slot 10 fingerprints
    torch.cuda.current_stream().wait_stream(side)
    sglang.launch_canary_verify_kernel(
        context=w.context(2), plan=plan, check_verify_expected_token=False, backend=backend
    )
    rows = w.state.violation_ring[:1].clone()  # queued right after the launch on the current stream
    n = w.state.violation_write_index.clone()
    torch.cuda.synchronize()
    assert n.item() == 1, "the verify ran before torch's queued write (or torch read before JAX wrote)"
    assert rows[0, 1].item() == 10 and rows[0, 7].item() == 4


@jax.jit
def _busy(x):
    """Eight 8192^3 matmuls in one program (one compile; each first compile is slow on the H200 machine)."""
    return jax.lax.fori_loop(0, 8, lambda _, y: (y @ y) * 1e-4, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_torch_sees_results_while_jax_stream_is_busy(backend):
    rng = random.Random(4)
    w = World.make(rng, device="cuda")
    x = _busy(dlpack.to_jax(torch.ones(8192, 8192, device="cuda"), name="x"))  # tens of ms queued on JAX's stream
    plan = sglang.WritePlan.allocate(write_req_capacity=1, device="cuda")
    plan.write_offsets.copy_(torch.tensor([0, 2]))
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(1)
    sglang.launch_canary_write_kernel(
        context=w.context(2),
        plan=plan,
        input_ids=torch.tensor([7, 8], device="cuda"),
        positions=torch.tensor([0, 1], device="cuda"),
        out_cache_loc=torch.tensor([3, 4], device="cuda"),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        backend=backend,
    )
    snap = w.buf[3:5].clone()  # torch kernel on the current stream, no host sync in between
    counters = w.state.kernel_run_counters.clone()
    torch.cuda.synchronize()
    jax.block_until_ready(x)
    assert snap.view(torch.int64)[:, :2].tolist() == [[7, 0], [8, 1]]
    assert counters[2].item() == 1


def test_cuda_host_sync_mode_also_orders():
    streams.set_stream_sync("host")
    try:
        test_cuda_torch_sees_results_while_jax_stream_is_busy("reference")
    finally:
        streams.set_stream_sync("fence")


# --- bad input ---------------------------------------------------------------------------------------------
def _snapshot(w):
    return {k: t.clone() for k, t in w.tensors().items()}


def test_cuda_bad_input_names_the_argument_and_touches_nothing():
    import dataclasses

    rng = random.Random(5)
    w = World.make(rng, device="cuda")
    plan, kw = _write_once(w, backend="reference")
    before = _snapshot(w)
    ctx = w.context(2)
    cases = [
        (
            ValueError,
            r"out_cache_loc must be on canary_buf's device cuda:0, got cpu",
            dict(kw, out_cache_loc=kw["out_cache_loc"].cpu()),
        ),
        (
            ValueError,
            r"violation_ring must be on canary_buf's device",
            dict(kw, context=dataclasses.replace(ctx, violation_ring=w.state.violation_ring.cpu())),
        ),
        (
            TypeError,
            r"input_ids must have dtype torch.int64, got torch.int32",
            dict(kw, input_ids=kw["input_ids"].int()),
        ),
        (
            ValueError,
            r"^kv-canary: positions must be contiguous$",
            dict(kw, positions=torch.arange(6, device="cuda")[::2]),
        ),
        (
            ValueError,
            r"slot_run_counter overlaps|overlaps slot_run_counter",
            dict(kw, context=dataclasses.replace(ctx, slot_run_counter=ctx.kernel_run_counter)),
        ),
        (
            ValueError,
            r"input_ids is a DLPack capsule that was already consumed",
            dict(kw, input_ids=_consumed(kw["input_ids"])),
        ),
    ]
    for exc, pattern, args in cases:
        args.setdefault("context", ctx)
        with pytest.raises(exc, match=pattern):
            sglang.launch_canary_write_kernel(plan=plan, **args)
    torch.cuda.synchronize()
    assert_same_bytes(_snapshot(w), before, "refused calls")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_tensors_on_two_gpus_are_refused_and_touch_nothing():
    w = World.make(random.Random(6), device="cuda")
    plan, kw = _write_once(w, backend="reference")
    before = _snapshot(w)
    with pytest.raises(ValueError, match=r"positions must be on canary_buf's device cuda:0, got cuda:1"):
        sglang.launch_canary_write_kernel(
            context=w.context(2), plan=plan, **dict(kw, positions=kw["positions"].to("cuda:1"))
        )
    torch.cuda.synchronize()
    assert_same_bytes(_snapshot(w), before, "refused two-GPU call")


def _consumed(t):
    cap = t.clone().__dlpack__()
    torch.utils.dlpack.from_dlpack(cap)
    return cap


def test_cuda_donated_buffers_survive_alloc_free_cycles():
    dev = torch.device("cuda")
    stats0 = jax.devices("gpu")[0].memory_stats() or {}
    for i in range(40):
        rng = random.Random(i)
        w = World.make(rng, device="cuda", num_slots=4096)
        _write_once(w, backend="reference")
        junk = jax.device_put(np.full((1 << 20,), i, np.float32), jax.devices("gpu")[0])  # JAX allocations
        del w, junk
        if i % 10 == 9:
            gc.collect()
            torch.cuda.empty_cache()
    torch.cuda.synchronize()
    w = World.make(random.Random(99), device="cuda")
    _write_once(w, backend="reference")
    torch.cuda.synchronize()
    assert w.buf.view(torch.int64)[5, :2].tolist() == [101, 0]
    stats1 = jax.devices("gpu")[0].memory_stats() or {}
    if "bytes_in_use" in stats0 and "bytes_in_use" in stats1:
        assert stats1["bytes_in_use"] - stats0["bytes_in_use"] < 64 << 20
    assert runner.donation_aliases(dev) in (True, False)
