"""The native torch path (``path="native"``) on CPU tensors: SGLang's bytes, the path choice, the memory plan.

On CPU the native path runs the very program it runs on CUDA (torch ops for the glue XLA would run, the memory
plan, the copy-out) with the Pallas kernels interpreted by JAX instead of launched through Triton; every launch
here must leave the torch tensors byte-identical to the independent re-implementation of SGLang's torch
references (``helpers/torch_reference.py``). The Triton launches themselves are exercised on CUDA
(``test_native_graphs.py``, ``test_torch_engine.py``, ``test_native_triton.py``).
"""

from __future__ import annotations

import random
import warnings
import zlib

import jax
import jax.numpy as jnp
import pytest
import torch
from test_interop_sglang import CONFIGS, _run_pair, check_plan_variant

from helpers.interop_world import World, assert_same_bytes, random_verify_plan, random_write_args
from interop import sglang
from interop.native import launch as native
from interop.native import program


@pytest.fixture
def native_env(monkeypatch):
    monkeypatch.setenv(native.PATH_ENV, "native")


@pytest.mark.parametrize("config", ["none", "all_4src_stride48"])  # partial_2src: the x64 test below
def test_random_launches_match_sglang_reference_bytes(config, native_env):
    rng = random.Random(zlib.crc32(b"native" + config.encode()))
    sources, mode, stride = CONFIGS[config]
    ours = World.make(rng, sources=sources, mode=mode, stride=stride)
    ref = ours.clone()
    tags = [int(sglang.CanaryLaunchTag.TAIL_K_FULL), int(sglang.CanaryLaunchTag.HEAD_V_SWA)]
    ops = ["write", "write", "verify", "write", "verify", "verify", "write", "verify"]
    for step, op in enumerate(ops):
        if step % 3 == 2:  # corrupt a KV byte and a canary field on both sides
            kv_byte, slot, byte = rng.randrange(16), rng.randrange(1, ours.buf.shape[0]), rng.randrange(32)
            for w in (ours, ref):
                if w.kv:
                    w.kv[0].view(torch.uint8).view(-1)[kv_byte] ^= 0x5A
                w.buf[slot, byte] ^= 0x01
        _run_pair(rng, ours, ref, op, tags[op == "verify"], "pallas")
        assert_same_bytes(ours.tensors(), ref.tensors(), f"{config} step {step} ({op})")
    assert int(ours.state.violation_write_index.item()) > 0  # the corruptions were found
    assert int(ours.state.slot_run_counters.sum()) > 10


@pytest.mark.parametrize("variant", ["full", "swa_lut", "pool_eagle"])
def test_plan_matches_sglang_reference_bytes(variant, native_env):
    check_plan_variant(variant, salt=b"native", trials=3)


def test_x64_on_gives_the_same_bytes(native_env):
    rng = random.Random(11)
    ours = World.make(rng, sources=CONFIGS["partial_2src"][0], mode=1)
    ref = ours.clone()
    with jax.enable_x64(True):
        for step, op in enumerate(["write", "verify", "write", "verify"]):
            _run_pair(rng, ours, ref, op, int(sglang.CanaryLaunchTag.TAIL_K_FULL), "pallas")
            assert_same_bytes(ours.tensors(), ref.tensors(), f"x64 step {step} ({op})")


def test_read_only_tensors_untouched_and_state_updated_in_place(native_env):
    rng = random.Random(12)
    w = World.make(rng, sources=((torch.uint8, 1, 16, 16, 0),), mode=2)
    plan, kw = random_write_args(rng, w)
    kw.update(enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
    ro = {f: getattr(plan, f).clone() for f in plan.__dataclass_fields__}
    ro.update({k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)})
    kv = w.kv[0].clone()
    state = {k: (t.data_ptr(), id(t)) for k, t in w.tensors().items()}
    before = w.buf.clone()
    sglang.launch_canary_write_kernel(context=w.context(2), plan=plan, backend="pallas", **kw)
    for f in plan.__dataclass_fields__:
        assert torch.equal(getattr(plan, f), ro[f]), f
    for k, v in kw.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, ro[k]), k
    assert torch.equal(w.kv[0], kv)
    assert {k: (t.data_ptr(), id(t)) for k, t in w.tensors().items()} == state
    assert w.state.kernel_run_counters.tolist()[2] == 1
    if int(plan.write_num_valid_reqs.item()) and (kw["out_cache_loc"] >= 0).any():
        assert not torch.equal(w.buf, before) or int(w.state.slot_run_counters[2]) == 0


def test_token_counts_build_one_program_per_bucket(native_env):
    rng = random.Random(13)
    w = World.make(rng, num_slots=200)

    def write(t):
        plan, kw = random_write_args(rng, w, cw=4, t=t)
        kw.update(enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
        sglang.launch_canary_write_kernel(context=w.context(2), plan=plan, backend="pallas", **kw)

    counts = [1, 2, 3, 5, 7, 8, 9, 13, 17, 31, 33, 40, 3, 9, 33]
    traces = native.trace_count()
    for t in counts:
        write(t)
    built = native.trace_count() - traces
    assert 0 < built <= 6, built  # buckets, not one program per token count
    before = native.trace_count()
    for t in sorted(set(counts)):
        write(t)
    assert native.trace_count() == before  # steady state builds nothing


def test_path_keyword_environment_and_default(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(native.PATH_ENV, raising=False)
    assert native.resolve_path(None, cpu) == "dlpack"
    monkeypatch.setattr(native.triton_kernels, "triton_available", lambda: True)
    assert native.resolve_path(None, cuda) == "native"
    assert native.resolve_path(None, cuda, "reference") == "dlpack"  # the jnp reference loops: DLPack
    monkeypatch.setattr(native.triton_kernels, "triton_available", lambda: False)
    assert native.resolve_path(None, cuda) == "dlpack"
    monkeypatch.setenv(native.PATH_ENV, "NATIVE")
    assert native.resolve_path(None, cpu) == "native"
    assert native.resolve_path("dlpack", cpu) == "dlpack"  # the keyword wins
    monkeypatch.setenv(native.PATH_ENV, "xla")
    with pytest.raises(ValueError, match=r"\$CANARY_JAX_TORCH_PATH must be one of .*'xla'"):
        native.resolve_path(None, cpu)
    with pytest.raises(ValueError, match=r"path must be one of .*'fast'"):
        native.resolve_path("fast", cpu)
    rng = random.Random(14)
    w = World.make(rng)
    with pytest.raises(ValueError, match="path must be one of"):
        sglang.launch_canary_verify_kernel(
            context=w.context(0), plan=random_verify_plan(rng, w), check_verify_expected_token=False, path="fast"
        )


def test_reference_backend_on_the_native_path_is_refused_naming_why():
    rng = random.Random(15)
    w = World.make(rng)
    plan, kw = random_write_args(rng, w)
    snap = {k: t.clone() for k, t in w.tensors().items()}
    with pytest.raises(program.NotNative, match=r"write launch \(reference\).*'while'"):
        sglang.launch_canary_write_kernel(context=w.context(2), plan=plan, backend="reference", path="native", **kw)
    for k, t in w.tensors().items():
        assert torch.equal(t, snap[k]), k  # nothing ran


# --- the memory plan -----------------------------------------------------------------------------------------
def _program(fn, *args, mutable):
    closed = jax.make_jaxpr(fn)(*args)
    return program.build(closed, device=torch.device("cpu"), mutable=mutable, pallas=program.interpreted_pallas)


def test_scatter_into_a_mutable_dead_input_is_in_place_and_into_a_read_only_one_copies():
    x = jnp.arange(6, dtype=jnp.int32)
    fn = lambda x, i: (x.at[i].set(jnp.int32(-5)),)  # noqa: E731
    i = jnp.array([4], jnp.int32)
    for mutable, in_place in (([True, False], True), ([False, False], False)):
        prog = _program(fn, x, i, mutable=mutable)
        xt, it = torch.arange(6, dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
        (out,) = prog([xt, it])
        assert out.tolist() == [0, 1, 2, 3, -5, 5]
        assert (out.data_ptr() == xt.data_ptr()) == in_place
        assert xt.tolist() == ([0, 1, 2, 3, -5, 5] if in_place else [0, 1, 2, 3, 4, 5])


def test_a_value_read_after_the_scatter_is_not_overwritten():
    fn = lambda x: (x.at[1].add(jnp.uint32(7)), x + jnp.uint32(1))  # noqa: E731
    prog = _program(fn, jnp.zeros(3, jnp.uint32), mutable=[True])
    xt = torch.tensor([1, 2, 3], dtype=torch.int32)
    a, b = prog([xt])
    assert a.tolist() == [1, 9, 3] and b.tolist() == [2, 3, 4]


@pytest.mark.parametrize("fused", [True, False])
def test_the_compiled_write_donates_the_canary_buffer_to_its_kernels(fused, monkeypatch):
    """Traced for CUDA (compiled kernels), the write's memory plan hands every kernel the canary words, the ring
    and the write index in place: no launch copies the pool (planned on CPU with stand-in kernels). A small
    launch is one kernel with the fused write on (``fused``); with it off, the four launches (the claim one of them:
    nothing but views between the kernels)."""
    from pallas_kernels import config as pallas_config

    fuse = 512 if fused else 0
    cfg = pallas_config.PallasConfig(write_fused_max_tokens=fuse, write_fused_max_hashed=fuse // 2)
    monkeypatch.setattr(pallas_config, "DEFAULT_CONFIG", cfg)
    rng = random.Random(16)
    w = World.make(rng, num_slots=4096)
    plan, kw = random_write_args(rng, w)
    kw["enable_write_input_assert"], kw["expected_input_tokens"], kw["expected_input_positions"] = False, None, None
    captured = {}

    def fake_pallas(eqn):
        aliases = tuple((int(i), int(o)) for i, o in eqn.params["input_output_aliases"])
        kernel = program._Interpreted(aliases, eqn.params.get("name"))
        captured.setdefault("eqns", []).append(eqn)
        return (lambda a, d: []), tuple(i for i, _ in aliases), kernel

    orig = native._pallas_for
    native._pallas_for = lambda device: fake_pallas
    try:
        args = _write_args(w, plan, kw)
        launch = native._build(
            "write", ("pallas", "cuda", 2, 0, (), False), _write_factory(), args, torch.device("cpu")
        )
    finally:
        native._pallas_for = orig
    prog = launch.program
    steps = [s for s in prog.steps if s.name == "pallas_call"]
    multi = ["canary_write_chain", "canary_write_claim", "canary_write_won", "canary_write_store"]
    names = ["canary_write_fused"] if fused else multi
    assert [s.kernel.name for s in steps] == names
    words = (4096, 8)  # the canary buffer as uint32 words
    donated = {}
    for s in steps:
        for k in s.inplace:
            shape = tuple(prog.avals[s.ins[k]].shape)
            donated.setdefault(shape, []).append(s.donate[k])
    assert all(donated[(6, 16)]), donated  # the ring (6 rows of 16 words)
    if fused:
        assert donated[words] == [True], donated  # the one kernel overwrites the canary in place
        assert not [s for s in prog.steps if s.name == "scatter-max"]  # no claim outside the kernel
        return
    # chain, claim and store kernels overwrite the canary in place (the claim its float32 view, a bitcast)
    assert donated[words] == [True, True, True], donated
    assert not [s for s in prog.steps if s.name == "scatter-max"]  # the claim is a kernel


def _write_factory():
    from interop import kernels

    return kernels.write_body_factory


def _write_args(w, plan, kw):
    from interop import arguments, padding
    from interop.buffers import TensorArg

    ctx = w.context(2)
    pl = arguments.tensors(plan, ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs"), "plan.")
    toks = {n: kw[n] for n in ("input_ids", "positions", "out_cache_loc")}
    pl, toks = padding.write_inputs(pl, toks)
    args = [TensorArg("canary_buf", ctx.canary_buf, True)]
    args += [TensorArg(n, t) for n, t in pl.items()]
    args += [TensorArg(n, t) for n, t in toks.items()]
    for n in ("violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter"):
        args.append(TensorArg(n, getattr(ctx, n), True))
    args.append(TensorArg("enable_chain_position_assert", ctx.enable_chain_position_assert))
    return args


def test_an_operand_read_through_another_view_is_not_overwritten_in_place():
    """``x.at[1:3].set(x[0:2])``: the update is a view of the operand, so the scatter must not write into the
    operand while reading it (XLA would copy): the result is the shifted values, not a smear."""
    fn = lambda x: (x.at[jnp.array([1, 2])].set(x[0:2]),)  # noqa: E731
    prog = _program(fn, jnp.zeros(4, jnp.int32), mutable=[True])
    (scatter,) = [s for s in prog.steps if s.name == "scatter"]
    assert scatter.donate[0] is False
    (out,) = prog([torch.tensor([10, 20, 30, 40], dtype=torch.int32)])
    assert out.tolist() == [10, 10, 20, 40]


def test_a_default_native_path_that_cannot_build_falls_back_to_dlpack_once_with_a_warning():
    """When the native path is only the default (not asked for) and a launch shape cannot be built, nothing has
    run: the launch takes the DLPack path, with one warning naming the error, and so do its later launches."""
    from interop import kernels, runner
    from interop.buffers import TensorArg

    rng = random.Random(17)
    ours = World.make(rng)
    ref = ours.clone()
    plan, kw = random_write_args(rng, ours)

    def launch_args(w):  # the reference backend's write body has while loops: the native build refuses it
        c = w.context(2)
        args = [TensorArg("canary_buf", c.canary_buf, True)]
        args += [TensorArg(f"plan.{f}", getattr(plan, f)) for f in plan.__dataclass_fields__]
        args += [TensorArg(n, kw[n]) for n in ("input_ids", "positions", "out_cache_loc")]
        args += [TensorArg(n, getattr(c, n), True) for n in ("violation_ring", "violation_write_index")]
        args += [TensorArg(n, getattr(c, n), True) for n in ("slot_run_counter", "kernel_run_counter")]
        args.append(TensorArg("enable_chain_position_assert", c.enable_chain_position_assert))
        return args

    statics = ("reference", "cpu", 2, 0, (), False)
    with pytest.warns(RuntimeWarning, match=r"could not build this write launch \(NotNative: .*'while'"):
        native.run_native("write", statics, kernels.write_body_factory, launch_args(ours), fallback=runner.run_in_place)
    runner.run_in_place("write", statics, kernels.write_body_factory, launch_args(ref))
    assert_same_bytes(ours.tensors(), ref.tensors(), "fallback launch")
    traces = native.trace_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second build
        native.run_native("write", statics, kernels.write_body_factory, launch_args(ours), fallback=runner.run_in_place)
    assert native.trace_count() == traces
    assert int(ours.state.kernel_run_counters[2]) == 2


def test_inference_tensor_outputs_outside_inference_mode_are_refused_before_anything_runs(native_env):
    rng = random.Random(18)
    with torch.inference_mode():
        w = World.make(rng)
        vp = random_verify_plan(rng, w)
        vplan, kw = random_write_args(rng, w)
    snap = {k: t.clone() for k, t in w.tensors().items()}
    with pytest.raises(ValueError, match=r"canary_buf is an inference tensor .* outside inference mode"):
        sglang.launch_canary_write_kernel(context=w.context(2), plan=vplan, backend="pallas", **kw)
    with pytest.raises(ValueError, match=r"violation_ring is an inference tensor"):
        sglang.launch_canary_verify_kernel(
            context=w.context(2), plan=vp, check_verify_expected_token=False, backend="pallas"
        )
    for k, t in w.tensors().items():
        assert torch.equal(t, snap[k]), k
    with torch.inference_mode():  # inside inference mode the same launch runs
        sglang.launch_canary_verify_kernel(
            context=w.context(2), plan=vp, check_verify_expected_token=False, backend="pallas"
        )
    assert int(w.state.kernel_run_counters[2]) == 1
