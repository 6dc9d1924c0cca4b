"""interop.native.triton_ttir and interop.native.triton_kernels: every pallas_call of real launches as a Triton
kernel spec (triton_ttir), compiled offline for sm_90 with torch's triton, and (on a CUDA machine) launched from
torch against the reference (triton_kernels).

The equations come from real launches: ``interop.sglang.launch_canary_{verify,write}_kernel(backend="pallas")``
on CPU tensors with the launch runner replaced by a recorder, then ``jax.make_jaxpr`` of the recorded body for
platform ``"cuda"`` (compiled kernels) or ``"cpu"`` (interpreted). Tests that need triton or CUDA skip cleanly.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers.interop_world import World, assert_same_bytes, random_verify_plan, random_write_args
from interop import runner, sglang
from interop.native import triton_kernels as tk
from interop.native import triton_ttir as tt

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # noqa: BLE001
    HAS_TRITON = False

TAG = int(sglang.CanaryLaunchTag.TAIL_K_FULL)
BF16 = (torch.bfloat16, 1, 64, 32, 0)  # (dtype, page_size, num_bytes_per_token, read_bytes, extra row bytes)
F32 = (torch.float32, 4, 32, 32, 16)
VERIFY = ("canary_verify", "canary_verify_rows")
WRITE = ("canary_write_chain", "canary_write_claim", "canary_write_won", "canary_write_store")
WRITE_FUSED = ("canary_write_fused",)  # a launch of at most write_fused_max_tokens / _hashed tokens
WRITE_LONG = ("canary_write_chain", "canary_write_long", "canary_write_claim", "canary_write_won", "canary_write_store")


# --- real launches as equations ----------------------------------------------------------------------------
@contextlib.contextmanager
def recording():
    """Replaces the torch launch paths by a recorder of ``(op, statics, body_factory, args)``."""
    calls = []

    def record(op, statics, body_factory, args, fallback=None):
        calls.append((op, statics, body_factory, list(args)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "run_in_place", record)
        try:
            from interop.native import launch as native_launch

            mp.setattr(native_launch, "run_native", record, raising=False)
        except ImportError:
            pass
        yield calls


def body_aval(t: torch.Tensor) -> jax.ShapeDtypeStruct:
    """What the launch body sees for a torch tensor: int64 as ``uint32[..., 2]``, the rest as is."""
    if t.dtype == torch.int64:
        return jax.ShapeDtypeStruct((*t.shape, 2), jnp.uint32)
    if t.dtype == torch.bfloat16:
        return jax.ShapeDtypeStruct(tuple(t.shape), jnp.bfloat16)
    return jax.ShapeDtypeStruct(tuple(t.shape), jnp.dtype(str(t.dtype).removeprefix("torch.")))


def pallas_eqns(jaxpr) -> list:
    """Every ``pallas_call`` equation of ``jaxpr``, in order, looking inside ``pjit`` / ``jit`` sub-jaxprs."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            out.append(e)
            continue
        for p in e.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                out.extend(pallas_eqns(inner))
    return out


def launch_eqns(launch, platform: str) -> list:
    """The pallas_call equations of one recorded launch, traced for ``platform`` (``"cuda"``: compiled)."""
    with recording() as calls:
        launch()
    assert len(calls) == 1
    _, statics, body_factory, args = calls[0]
    statics = list(statics)
    statics[1] = platform
    closed = jax.make_jaxpr(body_factory(tuple(statics)))({a.name: body_aval(a.tensor) for a in args})
    return pallas_eqns(closed.jaxpr)


def verify_launch(sources, mode, check, *, device="cpu", seed=0):
    rng = random.Random(seed)
    w = World.make(rng, sources=sources, mode=mode, device=device)
    plan = random_verify_plan(rng, w, cap=16, device=device)
    return lambda: sglang.launch_canary_verify_kernel(
        context=w.context(TAG), plan=plan, check_verify_expected_token=check, backend="pallas"
    )


def write_launch(sources, mode, assert_inputs, *, seed=0):
    rng = random.Random(seed)
    w = World.make(rng, sources=sources, mode=mode)
    plan, kw = random_write_args(rng, w, cw=4, t=12)
    kw["enable_write_input_assert"] = assert_inputs
    if not assert_inputs:
        kw["expected_input_tokens"] = kw["expected_input_positions"] = None
    elif kw["expected_input_tokens"] is None:
        kw["expected_input_tokens"] = kw["input_ids"].clone()
        kw["expected_input_positions"] = kw["positions"].clone()
    return lambda: sglang.launch_canary_write_kernel(context=w.context(TAG), plan=plan, backend="pallas", **kw)


def long_write_launch():
    """2 requests x 300 tokens: the long-request role (``canary_write_long``) is compiled in."""
    w = World.make(random.Random(7), sources=(BF16,), mode=2)
    plan = sglang.WritePlan.allocate(write_req_capacity=2)
    plan.write_offsets.copy_(torch.tensor([0, 300, 600]))
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(2)
    loc = torch.arange(600) % 61
    return lambda: sglang.launch_canary_write_kernel(
        context=w.context(TAG),
        plan=plan,
        input_ids=torch.arange(600) * 7,
        positions=torch.arange(600),
        out_cache_loc=loc,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        backend="pallas",
    )


def multi_write_launch():
    """4352 one-token requests (a large decode batch)."""
    n = 4352
    w = World.make(random.Random(9), sources=(), mode=0)
    plan = sglang.WritePlan.allocate(write_req_capacity=n)
    plan.write_offsets.copy_(torch.arange(n + 1))
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(n)
    return lambda: sglang.launch_canary_write_kernel(
        context=w.context(TAG),
        plan=plan,
        input_ids=torch.arange(n) * 7,
        positions=torch.zeros(n, dtype=torch.int64),
        out_cache_loc=torch.arange(n) % 61,
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
        backend="pallas",
    )


CASES = {
    # name: (launch factory, expected pallas_call names in order)
    "verify_none": (lambda: verify_launch((), 0, False), VERIFY),
    "verify_partial_1src_check": (lambda: verify_launch((BF16,), 1, True), VERIFY),
    "verify_all_2src": (lambda: verify_launch((BF16, F32), 2, False), VERIFY),
    "write_none": (lambda: write_launch((), 0, False), WRITE_FUSED),
    "write_partial_1src": (lambda: write_launch((BF16,), 1, False), WRITE_FUSED),
    "write_input_assert_2src": (lambda: write_launch((BF16, F32), 2, True), WRITE_FUSED),
    "write_long": (long_write_launch, WRITE_LONG),
    "write_multi": (multi_write_launch, WRITE),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh spec / TTIR cache directory for this module."""
    path = tmp_path_factory.mktemp("triton_cache")
    old = os.environ.get(tt.CACHE_ENV)
    os.environ[tt.CACHE_ENV] = str(path)
    tt.clear_memo()
    yield path
    tt.clear_memo()
    if old is None:
        os.environ.pop(tt.CACHE_ENV, None)
    else:
        os.environ[tt.CACHE_ENV] = old


@pytest.fixture(scope="module")
def eqns(cache):
    """case -> the compiled-mode pallas_call equations of its launch."""
    return {name: launch_eqns(make(), "cuda") for name, (make, _) in CASES.items()}


@pytest.fixture(scope="module")
def specs(eqns):
    """case -> the specs of its equations (lowered once here)."""
    return {name: [tt.kernel_spec(e) for e in es] for name, es in eqns.items()}


# --- specs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_every_pallas_call_of_a_launch_yields_a_spec(case, eqns, specs):
    assert tuple(e.params["name"] for e in eqns[case]) == CASES[case][1]
    for eqn, spec in zip(eqns[case], specs[case]):
        p = eqn.params
        cp = p["compiler_params"]
        assert spec.name == p["name"]
        assert spec.grid == (*p["grid_mapping"].grid, 1, 1)[:3]  # our grids are 1-D
        assert spec.num_warps == cp.num_warps and spec.num_stages == cp.num_stages
        assert (spec.num_inputs, spec.num_outputs) == (len(eqn.invars), len(eqn.outvars))
        assert spec.key == tt.spec_key(spec.ttir, spec.num_warps, spec.num_stages)
        assert spec.ttir.startswith(f"module @{spec.name} {{\n") and spec.ttir.endswith("\n}\n")
        assert len(re.findall(r"^\s*tt\.func\b", spec.ttir, flags=re.M)) == 1
        assert not re.search(r"#loc|\[unknown\]|\bloc\(", spec.ttir)
        func, params = tt.ttir_params(spec.ttir)
        assert func == spec.name
        assert len(params) == spec.num_inputs + spec.num_outputs
        assert all(ty.startswith("!tt.ptr<") for ty, _ in params)
        # jax marks every pointer parameter tt.divisibility = 32 (0.10.2; XLA asks for 16-byte pointers): a
        # multiple of 16, the same for all, and what the launcher checks.
        divs = {d for _, d in params}
        assert len(divs) == 1 and next(iter(divs)) % 16 == 0, divs
        assert tk.TritonKernel(spec, torch.device("cuda", 0)).alignments == (next(iter(divs)),) * len(params)


def test_specs_are_memoised_in_process_and_on_disk(eqns, specs, tmp_path, monkeypatch):
    monkeypatch.setenv(tt.CACHE_ENV, str(tmp_path))
    tt.clear_memo()
    lowered = []
    real = tt._lower_and_print
    monkeypatch.setattr(tt, "_lower_and_print", lambda *a: lowered.append(a[0]) or real(*a))
    es = eqns["verify_partial_1src_check"]
    first = [tt.kernel_spec(e) for e in es]
    assert len(lowered) == 2 and first == specs["verify_partial_1src_check"]
    assert all(tt.kernel_spec(e) is s for e, s in zip(es, first))  # in-process memo
    assert len(lowered) == 2
    tt.clear_memo()
    assert [tt.kernel_spec(e) for e in es] == first  # disk
    again = launch_eqns(CASES["verify_partial_1src_check"][0](), "cuda")  # a new trace: new jaxpr objects
    assert [tt.kernel_spec(e) for e in again] == first
    assert len(lowered) == 2
    assert len(list((tmp_path / "specs").glob("*.json"))) == 2
    # the disk key is made of text without object addresses, so it holds across processes
    for e in es:
        with np.printoptions(threshold=10**9):
            for name, value in e.params.items():
                assert not re.search(r" at 0x[0-9a-f]+", str(value)), name
    # a damaged file is lowered again
    for f in (tmp_path / "specs").glob("*.json"):
        f.write_text("{")
    tt.clear_memo()
    assert [tt.kernel_spec(e) for e in es] == first and len(lowered) == 4


def test_memo_tells_equations_with_the_same_kernel_jaxpr_apart(eqns, specs):
    eqn = eqns["verify_none"][0]
    from jax.experimental.pallas import triton as pltriton

    other = eqn.replace(params=dict(eqn.params, compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=2)))
    spec = tt.kernel_spec(other)
    assert (spec.num_warps, spec.num_stages) == (8, 2)
    assert spec.ttir == specs["verify_none"][0].ttir and spec.key != specs["verify_none"][0].key
    assert tt.kernel_spec(eqn) == specs["verify_none"][0]


def test_interpreted_and_foreign_equations_are_refused(cache):
    (eqn, _) = launch_eqns(CASES["verify_none"][0](), "cpu")
    assert eqn.params["interpret"]
    with pytest.raises(ValueError, match=r"canary_verify runs interpreted"):
        tt.kernel_spec(eqn)
    closed = jax.make_jaxpr(lambda x: x + 1)(1.0)
    with pytest.raises(TypeError, match="pallas_call equation"):
        tt.kernel_spec(closed.jaxpr.eqns[0])


@pytest.mark.parametrize("printed,count", [("nothing\n", 0), ("module @a {\n}\nmodule @b {\n}\n", 2)])
def test_a_lowering_that_prints_no_or_two_modules_raises(printed, count, eqns, tmp_path, monkeypatch):
    monkeypatch.setenv(tt.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(tt, "_lower_and_print", lambda *a: printed)
    tt.clear_memo()
    try:
        with pytest.raises(ValueError, match=rf"pallas_call canary_write_won .*printed {count} Triton modules"):
            tt.kernel_spec(eqns["write_multi"][2])
    finally:
        tt.clear_memo()


def test_lowering_stops_before_jaxlibs_own_compile():
    """Newer jaxlibs compile the TTIR inside the lowering rule; kernel_spec's thread stops there instead."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    real = getattr(reg, "triton", None)
    if real is None:
        pytest.skip("this jax's pallas_call_registration has no jaxlib triton module to stand in for")
    with tt._skip_jaxlib_compile():
        assert isinstance(reg.triton, tt._CompileProxy) and reg.triton.__name__ == real.__name__
        with pytest.raises(tt._TtirCaptured):
            reg.triton.compile("cuda", b"", "9.0")
        assert tt._LOCAL.captured
    assert reg.triton is real and not tt._LOCAL.skip_compile


def test_strip_locations_and_params():
    text = (
        "#loc = [unknown]\nmodule @k {\n  tt.func public @k(%arg0: !tt.ptr<i32> {tt.divisibility = 32 : i32} "
        '[unknown], %arg1: !tt.ptr<i8> {tt.divisibility = 16 : i32} "x"(#loc3)) {\n'
        '    %0 = tt.get_program_id x : i32 "program_id:"(#loc12)\n    tt.return [unknown]\n  } [unknown]\n'
        "} [unknown]\n#loc3 = foo.py:1:2\n"
    )
    out = tt.strip_locations(text[text.index("module") :])
    assert "loc" not in out and "unknown" not in out and out.endswith("}\n")
    assert tt.ttir_params(out) == ("k", [("!tt.ptr<i32>", 32), ("!tt.ptr<i8>", 16)])
    with pytest.raises(ValueError, match="unknown location form"):
        tt.strip_locations("module @k {\n  %0 = foo callsite(#loc1 at #loc2)\n}\n")
    with pytest.raises(ValueError, match="exactly one tt.func"):
        tt.ttir_params("module @k {\n}\n")


@pytest.mark.parametrize(
    "grid,vmapped,want",
    [((3,), (), (3, 1, 1)), ((2, 3), (), (2, 3, 1)), ((2, 3, 4, 5), (), (6, 4, 5)), ((1, 70000), (), (70000, 1, 1)),
     ((4, 5), (0,), (5, 4, 1))],
)  # fmt: skip
def test_launch_grid_mirrors_jax(grid, vmapped, want):
    gm = types.SimpleNamespace(grid=grid, vmapped_dims=vmapped, num_dynamic_grid_bounds=0)
    assert tt.launch_grid(gm) == want


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(tt.CACHE_ENV, str(tmp_path / "a" / "b"))
    assert tt.cache_dir() == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    monkeypatch.delenv(tt.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tt.cache_dir() == tmp_path / ".cache" / "canary_jax" / "triton"


def test_spec_checks_its_key():
    with pytest.raises(ValueError, match="not the spec's own"):
        tt.KernelSpec("k", "module @k {\n}\n", (1, 1, 1), 4, 3, 0, 0, "0" * 64)


# --- launch argument checks (before anything touches CUDA) -------------------------------------------------
def test_launch_checks_arguments_before_touching_cuda(specs):
    spec = specs["verify_none"][0]
    kern = tk.TritonKernel(spec, torch.device("cuda", 0))
    n = spec.num_inputs + spec.num_outputs
    with pytest.raises(ValueError, match=rf"canary_verify takes 8 inputs \+ 3 outputs = {n} tensors, got {n - 1}"):
        kern.launch([torch.zeros(8, dtype=torch.int32)] * (n - 1))
    args = [torch.zeros(64, dtype=torch.int32) for _ in range(n)]
    bad = list(args)  # each argument is checked in turn: index 0 fails first on CPU
    bad[0] = torch.zeros(64, dtype=torch.uint8)[4:]  # 4 bytes past a 64-aligned allocation
    with pytest.raises(ValueError, match=r"canary_verify: argument 0 data pointer 0x[0-9a-f]+ is not aligned to 32"):
        kern.launch(bad)
    bad[0] = torch.zeros(8, 8, dtype=torch.int32).t()
    with pytest.raises(ValueError, match=r"canary_verify: argument 0 \(pointer 0x[0-9a-f]+\) is not contiguous"):
        kern.launch(bad)
    with pytest.raises(ValueError, match=r"canary_verify: argument 0 \(pointer 0x[0-9a-f]+\) is on cpu"):
        kern.launch(args)
    bad[0] = 7
    with pytest.raises(TypeError, match="argument 0 is int"):
        kern.launch(bad)
    assert kern._run is None  # nothing compiled or loaded
    with pytest.raises(ValueError, match="needs a CUDA device"):
        tk.TritonKernel(spec, torch.device("cpu"))


def fake_compiled(kern: tk.TritonKernel, monkeypatch) -> tuple[list, list]:
    """Stands in for the compiled kernel (device -1, so CPU tensors pass the device check; stream 1234):
    ``(calls into run, calls of launch_metadata)``; the enter-hook chain starts empty."""
    calls, metas = [], []
    compiled = types.SimpleNamespace(launch_metadata=lambda grid, stream, *a: metas.append((grid, stream, a)) or "md")
    kern._index, kern._run, kern._compiled = -1, lambda *a: calls.append(a), compiled
    kern._function, kern._packed = 0xF00, (4, 1, 16)
    kern._runtime = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]), launch_exit_hook=None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: -1)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1234 if i == -1 else 0, raising=False)
    return calls, metas


def test_launch_calls_run_with_the_compiled_kernels_arguments(specs, monkeypatch):
    """The call into triton's launcher, with a stand-in for the compiled kernel (CPU tensors, device -1)."""
    spec = specs["verify_none"][1]
    kern = tk.TritonKernel(spec, torch.device("cuda", 0))
    calls, metas = fake_compiled(kern, monkeypatch)
    args = [torch.zeros(16, dtype=torch.int32) for _ in range(spec.num_inputs + spec.num_outputs)]
    kern.launch(args)
    ptrs = tuple(t.data_ptr() for t in args)
    assert calls == [(*spec.grid, 1234, 0xF00, (4, 1, 16), None, None, None, *ptrs)] and not metas
    kern._runtime.launch_enter_hook.calls.append(print)  # a registered hook gets launch metadata and the chains
    kern.launch(args)
    enter = kern._runtime.launch_enter_hook
    assert calls[1] == (*spec.grid, 1234, 0xF00, (4, 1, 16), "md", enter, None, *ptrs)
    assert metas == [(spec.grid, 1234, ptrs)]


def test_launch_ptrs_makes_the_same_call_as_launch(specs, monkeypatch):
    """``launch_ptrs`` compiles on first use, then calls ``run`` exactly as ``launch`` does (hooks or not), and
    checks nothing: a misaligned pointer ``launch`` refuses goes to ``run`` as is."""
    spec = specs["verify_none"][1]
    kern = tk.TritonKernel(spec, torch.device("cuda", 0))
    compiles = []
    monkeypatch.setattr(kern, "compile", lambda: compiles.append(fake_compiled(kern, monkeypatch)))
    args = [torch.zeros(16, dtype=torch.int32) for _ in range(spec.num_inputs + spec.num_outputs)]
    kern.launch_ptrs([t.data_ptr() for t in args])
    assert len(compiles) == 1
    calls, metas = compiles[0]
    kern.launch(args)
    kern.launch_ptrs([t.data_ptr() for t in args])
    ptrs = tuple(t.data_ptr() for t in args)
    assert calls == [(*spec.grid, 1234, 0xF00, (4, 1, 16), None, None, None, *ptrs)] * 3 and not metas
    kern._runtime.launch_enter_hook.calls.append(print)
    kern.launch(args)
    kern.launch_ptrs([t.data_ptr() for t in args])
    enter = kern._runtime.launch_enter_hook
    assert calls[3] == calls[4] == (*spec.grid, 1234, 0xF00, (4, 1, 16), "md", enter, None, *ptrs)
    assert metas == [(spec.grid, 1234, ptrs)] * 2
    assert len(compiles) == 1
    bad = list(args)
    bad[0] = torch.zeros(64, dtype=torch.uint8)[4:]  # 4 bytes past an aligned allocation
    with pytest.raises(ValueError, match="not aligned to 32"):
        kern.launch(bad)
    kern.launch_ptrs([t.data_ptr() for t in bad])
    assert calls[-1][-len(ptrs) :] == (bad[0].data_ptr(), *ptrs[1:])


def test_triton_kernels_reexports_the_spec_names():
    """``from interop.native.triton_kernels import kernel_spec, KernelSpec, cache_dir, ...`` keeps working: the
    very objects of interop.native.triton_ttir."""
    moved = set(tk.__all__) - {"TritonKernel", "compile_offline", "optimized_ttir", "triton_available"}
    assert moved == {"CACHE_ENV", "KernelSpec", "cache_dir", "clear_memo", "kernel_spec", "launch_grid",
                     "lowering_count", "spec_key", "strip_locations", "ttir_params"}  # fmt: skip
    assert moved <= set(tt.__all__)
    assert all(getattr(tk, name) is getattr(tt, name) for name in moved)
    assert all(hasattr(tk, name) for name in tk.__all__) and all(hasattr(tt, name) for name in tt.__all__)


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_scratch_allocator_is_installed_only_when_none_is_set():
    from triton.runtime import _allocation

    try:
        _allocation._allocator.set(_allocation._NULL_ALLOCATOR)
        tk._ensure_allocator()
        assert _allocation._allocator.get() is tk._torch_scratch
        mine = lambda size, align, stream: None  # noqa: E731
        _allocation._allocator.set(mine)
        tk._ensure_allocator()
        assert _allocation._allocator.get() is mine
    finally:
        _allocation._allocator.set(_allocation._NULL_ALLOCATOR)


def test_triton_available_never_raises(monkeypatch):
    want = HAS_TRITON and torch.cuda.is_available()
    assert tk.triton_available() is want

    def boom():
        raise RuntimeError("driver")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    tk.triton_available.cache_clear()  # asked once per process: ask again under the broken driver
    try:
        assert tk.triton_available() is False
    finally:
        tk.triton_available.cache_clear()


def test_launch_hooks_are_passed_only_when_registered():
    assert not tk._hooks_on(None)
    chain = types.SimpleNamespace(calls=[])
    assert not tk._hooks_on(chain)
    chain.calls.append(print)
    assert tk._hooks_on(chain) and tk._hooks_on(print)


# --- offline compile for sm_90 -----------------------------------------------------------------------------
@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_every_spec_compiles_offline_for_sm90(specs, record_property):
    """The TTIR our jax emits compiles with torch's triton for the H100 / H200; none needs global scratch."""
    done = {}
    for case, ss in specs.items():
        for s in ss:
            if s.key in done:
                continue
            r = tk.compile_offline(s, 90)
            assert r["name"] == s.name
            assert r["num_params"] == s.num_inputs + s.num_outputs + 2  # + global and profile scratch pointers
            assert 0 <= r["shared_bytes"] <= 228 * 1024
            done[s.key] = {"case": case, **r}
    record_property("compiled", json.dumps(list(done.values())))
    scratch = sorted({r["name"] for r in done.values() if r["global_scratch_size"]})
    assert scratch == [], f"kernels needing global scratch on sm_90: {scratch}"
    assert {r["name"] for r in done.values()} == set(VERIFY) | set(WRITE_LONG) | set(WRITE_FUSED)


# --- the verify kernels from torch tensors -----------------------------------------------------------------
_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int32): torch.int32, np.dtype(np.uint32): torch.int32}


def _empty(aval, device) -> torch.Tensor:
    return torch.empty(tuple(aval.shape), dtype=_TORCH[np.dtype(aval.dtype)], device=device)


def verify_operands(w: World, plan, eqns) -> list[tuple[list, list]]:
    """``(inputs, outputs)`` torch tensors of both verify pallas_calls, in ``pallas_kernels/verify.py``
    ``_verify_pallas``'s order; outputs aliased to inputs (the log) are the input tensors themselves.

    Every int64 tensor is passed as its int32 (lo, hi) words, the canary buffer as ``int32[N, S/4]``, each
    real-KV source (only with a hash mode) as ``int32[rows, row_bytes/4]``, the launch's counters as SGLang's
    one-element per-tag views' words (a one-row counter array: the kernels bump that row).
    """
    words32 = lambda t: t.view(torch.int32)  # noqa: E731 - int64 [n] -> int32 [2n]; same bytes
    st, dev = w.state, w.buf.device
    words = w.buf.view(torch.int32)
    sources = [t.view(torch.uint8).view(torch.int32) for t in w.kv] if w.mode else []
    head = [plan.verify_num_valid, plan.enable]
    in1 = [
        *head,
        st.violation_write_index,
        words32(plan.verify_slot_indices),
        words32(plan.verify_expected_tokens),
        words32(plan.verify_expected_positions),
        words32(plan.verify_prev_slot_indices),
        words,
        *sources,
    ]
    bits, counts, base = (_empty(v.aval, dev) for v in eqns[0].outvars)
    log = [
        st.violation_ring.view(torch.int32),
        st.violation_write_index,
        words32(st.slot_run_counters[TAG : TAG + 1]),
        words32(st.kernel_run_counters[TAG : TAG + 1]),
    ]
    in2 = [
        *head,
        words32(plan.verify_slot_indices),
        words32(plan.verify_expected_tokens),
        words32(plan.verify_prev_slot_indices),
        words,
        bits,
        counts,
        base,
        *log,
    ]
    calls = [(in1, [bits, counts, base]), (in2, log)]
    for eqn, (ins, outs) in zip(eqns, calls):  # the mapping's bytes match the equation's avals
        assert len(ins) == len(eqn.invars) and len(outs) == len(eqn.outvars)
        for t, v in zip([*ins, *outs], [*eqn.invars, *eqn.outvars]):
            assert t.numel() * t.element_size() == v.aval.size * v.aval.dtype.itemsize, (eqn.params["name"], v.aval)
        for i, o in eqn.params["input_output_aliases"]:
            assert outs[o] is ins[i]
    return calls


_JITTED: dict = {}


def run_interpreted(eqn, ins, outs) -> None:
    """Runs an interpreted pallas_call equation on the tensors' bytes (CPU) and writes the results to ``outs``."""
    fn = _JITTED.get(id(eqn))
    if fn is None:
        fn = _JITTED[id(eqn)] = (eqn, jax.jit(lambda *xs: eqn.primitive.bind(*xs, **eqn.params)))
    arrays = [
        jnp.asarray(t.contiguous().reshape(-1).view(torch.uint8).numpy().view(v.aval.dtype).reshape(v.aval.shape))
        for t, v in zip(ins, eqn.invars)
    ]
    for t, r in zip(outs, fn[1](*arrays)):
        t.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(np.array(r).reshape(-1).view(np.uint8)))


VERIFY_WORLDS = {"none": ((), 0, False), "partial_1src_check": ((BF16,), 1, True)}


def _verify_against_reference(world_case: str, device: str, run_kernels) -> World:
    sources, mode, check = VERIFY_WORLDS[world_case]
    rng = random.Random(11)
    ours = World.make(rng, sources=sources, mode=mode, device=device)
    ref = ours.clone()
    for step in range(3):
        for w in (ours, ref):  # something for verify to find
            w.buf[1 + step, step] ^= 0x10
            if w.kv:
                w.kv[0].view(torch.uint8).view(-1)[64 * (2 + step)] ^= 0x5A
        plan = random_verify_plan(rng, ours, cap=16, device=device)
        ref_plan = type(plan)(**{f: getattr(plan, f).clone() for f in plan.__dataclass_fields__})
        run_kernels(ours, plan, check)
        with pytest.MonkeyPatch.context() as mp:  # the reference through the JAX (DLPack) path, not the native one
            mp.setenv("CANARY_JAX_TORCH_PATH", "dlpack")
            sglang.launch_canary_verify_kernel(
                context=ref.context(TAG), plan=ref_plan, check_verify_expected_token=check, backend="reference"
            )
        assert_same_bytes(ours.tensors(), ref.tensors(), f"{world_case} step {step}")
    assert int(ours.state.violation_write_index.item()) > 0
    return ours


def _kernels_eqns(w: World, plan, check: bool, platform: str) -> list:
    return launch_eqns(
        lambda: sglang.launch_canary_verify_kernel(
            context=w.context(TAG), plan=plan, check_verify_expected_token=check, backend="pallas"
        ),
        platform,
    )


@pytest.mark.parametrize("world_case", list(VERIFY_WORLDS))
def test_verify_operand_mapping_matches_the_reference_interpreted(world_case, cache):
    """The operand mapping of the GPU test below, run through the interpreted kernels on CPU."""

    traced: list = []

    def run(w, plan, check):
        if not traced:  # the equations depend on shapes only: trace once
            traced.extend(_kernels_eqns(w, plan, check, "cpu"))
            compiled = _kernels_eqns(w, plan, check, "cuda")
            assert [[v.aval for v in e.invars] for e in traced] == [[v.aval for v in e.invars] for e in compiled]
        es = traced
        for eqn, (ins, outs) in zip(es, verify_operands(w, plan, es)):
            run_interpreted(eqn, ins, outs)

    _verify_against_reference(world_case, "cpu", run)


@pytest.mark.skipif(not tk.triton_available(), reason="needs triton and a CUDA device")
@pytest.mark.parametrize("world_case", list(VERIFY_WORLDS))
def test_verify_kernels_launched_from_torch_match_the_reference(world_case, cache):
    device = torch.device("cuda", torch.cuda.current_device())
    kernels: dict = {}
    traced: list = []

    def run(w, plan, check):
        if not traced:
            traced.extend(_kernels_eqns(w, plan, check, "cuda"))
        for eqn, (ins, outs) in zip(traced, verify_operands(w, plan, traced)):
            spec = tt.kernel_spec(eqn)
            if spec.key not in kernels:
                kernels[spec.key] = tk.TritonKernel(spec, device)
            kernels[spec.key].launch([*ins, *outs])
        torch.cuda.synchronize(device)

    _verify_against_reference(world_case, "cuda", run)
    assert len(kernels) == 2  # one spec per pallas_call across the steps (same shapes)
