"""The torch <-> JAX exchange layer on CPU: zero-copy by pointer, lossless int64, refusals, caching, windows.

CUDA counterparts (pointer equality on the GPU, donation in place, stream order) are in test_interop_cuda.py.
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from interop import buffers, dlpack, runner


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.bfloat16, torch.float32, torch.int16])
def test_import_is_zero_copy(dtype):
    t = torch.zeros(37, 48, dtype=dtype)
    a = dlpack.to_jax(t, name="t")
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == (37, 48) and np.dtype(a.dtype).itemsize == t.element_size()


def test_int64_becomes_pairs_not_int32():
    vals = [0, 1, -1, 2**31, -(2**63), 2**63 - 1, 0x0123456789ABCDEF]
    t = torch.tensor(vals, dtype=torch.int64)
    a = dlpack.to_jax(t, name="t")
    assert a.shape == (len(vals), 2) and a.unsafe_buffer_pointer() == t.data_ptr()
    lo = np.asarray(a[:, 0]).astype(np.uint32).astype(np.uint64)
    hi = np.asarray(a[:, 1]).astype(np.uint32).astype(np.uint64)
    assert ((hi << np.uint64(32)) | lo).view(np.int64).tolist() == vals
    # what plain DLPack would have done with x64 off: silently 32-bit
    if not jax.config.read("jax_enable_x64"):
        assert jax.dlpack.from_dlpack(t).dtype == jnp.int32
    with pytest.raises(TypeError, match=r"t has dtype torch.int64; with jax_enable_x64 off JAX would silently"):
        dlpack.to_jax(t, name="t", int64="refuse")


def test_float64_refused_without_x64():
    if jax.config.read("jax_enable_x64"):
        pytest.skip("x64 on: float64 imports as float64")
    with pytest.raises(TypeError, match="kv_f64 has dtype torch.float64"):
        dlpack.to_jax(torch.zeros(4, dtype=torch.float64), name="kv_f64")


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(8, 8, dtype=torch.int32)[:, ::2],
        lambda: torch.zeros(8, 6, dtype=torch.int32).t(),
        lambda: torch.zeros(1, 8, dtype=torch.int32).expand(4, 8),
    ],
)
def test_non_contiguous_refused(make):
    with pytest.raises(ValueError, match=r"^kv-canary: plan.x must be contiguous$"):
        dlpack.to_jax(make(), name="plan.x")


def test_odd_strides_of_size_one_dims_are_normalised():
    base = torch.arange(8, dtype=torch.int32)
    t = base.as_strided((8, 1), (1, 13))  # contiguous by torch's rule, odd stride on the size-1 dim
    assert t.is_contiguous()
    a = dlpack.to_jax(t, name="t")
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert np.asarray(a).reshape(-1).tolist() == list(range(8))


def test_misaligned_refused_instead_of_copied():
    align = dlpack.device_alignment(torch.device("cpu"))
    assert align & (align - 1) == 0
    base = torch.zeros(1024, dtype=torch.uint8)
    off = next(o for o in range(1, 512) if (base.data_ptr() + o) % align == 0)
    ok = base[off : off + 64]
    assert dlpack.to_jax(ok, name="ok").unsafe_buffer_pointer() == ok.data_ptr()
    if align > 1:
        bad = base[off + align // 2 : off + align // 2 + 64]
        with pytest.raises(
            ValueError, match=rf"kv-canary: kv_view data pointer 0x[0-9a-f]+ is not aligned to {align} bytes"
        ):
            dlpack.to_jax(bad, name="kv_view")
        # plain from_dlpack would have copied silently
        assert jax.dlpack.from_dlpack(bad).unsafe_buffer_pointer() != bad.data_ptr()


def test_capsules_fresh_and_consumed():
    t = torch.arange(16, dtype=torch.int32)
    cap = t.__dlpack__()
    a = dlpack.to_jax(cap, name="cap_arg")
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    with pytest.raises(ValueError, match="kv-canary: cap_arg is a DLPack capsule that was already consumed"):
        dlpack.to_jax(cap, name="cap_arg")
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        dlpack.to_jax([1, 2], name="lst")


def test_unsupported_device_refused():
    with pytest.raises(ValueError, match="only CPU and CUDA tensors"):
        dlpack.to_jax(torch.empty(4, device="meta"), name="m")


def test_export_is_zero_copy():
    a = jnp.arange(64, dtype=jnp.int32)
    t = dlpack.to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()


def test_import_cache_hits_and_dies_with_owner():
    cache = dlpack.ImportCache(max_entries=3)
    t = torch.zeros(16, dtype=torch.int32)
    a1 = dlpack.to_jax(t, name="t", cache=cache)
    a2 = dlpack.to_jax(t, name="t", cache=cache)
    assert a1 is a2 and cache.hits == 1 and len(cache) == 1
    del t, a1, a2
    gc.collect()
    assert len(cache) == 0
    keep = [torch.zeros(16, dtype=torch.int32) for _ in range(5)]
    for k in keep:
        dlpack.to_jax(k, name="k", cache=cache)
    assert len(cache) == 3  # LRU bound


# --- run_in_place ------------------------------------------------------------------------------------------
def _bump_factory(statics):
    (delta,) = statics

    def body(v):
        c = v["counter"]  # uint32[1, 2] (int64)
        lo = c[..., 0] + jnp.uint32(delta)
        hi = c[..., 1] + (lo < c[..., 0]).astype(jnp.uint32)
        return {"counter": jnp.stack([lo, hi], -1), "flag": v["flag"] + 1, "buf": v["buf"].at[0, 0].add(1)}

    return body


def test_run_in_place_windows_merge_adjacent_counters_and_keep_neighbours():
    counters = torch.tensor([7, 2**32 - 1, 11, 13], dtype=torch.int64)  # views at 8-byte offsets
    flags = torch.zeros(3, dtype=torch.int32)
    buf = torch.zeros(4, 32, dtype=torch.uint8)
    args = [
        buffers.TensorArg("counter", counters[1:2], True),
        buffers.TensorArg("other", counters[2:3], False),
        buffers.TensorArg("flag", flags[1:2], True),
        buffers.TensorArg("buf", buf, True),
    ]
    for _ in range(3):
        runner.run_in_place("bump", (1,), _bump_factory, args)
    assert counters.tolist() == [7, 2**32 + 2, 11, 13]  # carry into the high word, neighbours untouched
    assert flags.tolist() == [0, 3, 0]
    assert buf[0, 0].item() == 3
    rep = runner.last_launch_report()
    assert sorted(rep["aliased"] + rep["copied_back"]) == sorted(["counter", "flag", "buf"])
    assert rep["donated"] == runner.donation_aliases(torch.device("cpu"))


def test_run_in_place_refuses_aliasing_outputs_and_device_mix():
    t = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="counter overlaps other"):
        runner.run_in_place(
            "bump",
            (1,),
            _bump_factory,
            [buffers.TensorArg("counter", t[1:2], True), buffers.TensorArg("other", t[0:4], False)],
        )
    with pytest.raises(ValueError, match="meta_arg is on meta but counter is on cpu"):
        runner.run_in_place(
            "bump",
            (1,),
            _bump_factory,
            [buffers.TensorArg("counter", t[1:2], True), buffers.TensorArg("meta_arg", torch.empty(2, device="meta"))],
        )
    assert t.tolist() == [0] * 8
