"""The native torch path (``path="native"``) on CPU tensors: SGLang's bytes, the path choice, the memory plan.

On CPU the native path runs the very program it runs on CUDA (the launch's kernels over buffers, the memory
plan, the write-back) with the Pallas kernels interpreted by JAX instead of launched through Triton; every launch
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
from jax.experimental import pallas as pl
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
    with pytest.raises(program.NotNative, match=r"write launch \(reference\).*outside the kernels"):
        sglang.launch_canary_write_kernel(context=w.context(2), plan=plan, backend="reference", path="native", **kw)
    for k, t in w.tensors().items():
        assert torch.equal(t, snap[k]), k  # nothing ran


# --- the memory plan -----------------------------------------------------------------------------------------
def _add_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + jnp.int32(1)


def _add_one(x):
    """One interpreted kernel, its result aliased to its operand: ``x + 1``."""
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(_add_kernel, out_shape=out, input_output_aliases={0: 0}, interpret=True)(x)


def _sum_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


def _sum(x, y):
    """One interpreted kernel with a fresh result: ``x + y``."""
    return pl.pallas_call(_sum_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, y)


def _program(fn, *args, mutable):
    closed = jax.make_jaxpr(fn)(*args)
    return program.build(closed, device=torch.device("cpu"), mutable=mutable, kernel_for=native.interpreted_pallas)


def _copies(prog) -> list[int]:
    """Per kernel, how many operands it gets as a copy."""
    return [len(step[3]) for step in prog.steps]


@pytest.mark.parametrize("mutable", [True, False])
def test_a_kernel_updates_a_mutable_dead_argument_in_place_and_a_read_only_one_through_a_copy(mutable):
    prog = _program(lambda x: (_add_one(x.reshape(2, 3)).reshape(6),), jnp.zeros(6, jnp.int32), mutable=[mutable])
    assert _copies(prog) == [0 if mutable else 1]
    xt = torch.arange(6, dtype=torch.int32)
    prog([xt])
    assert xt.tolist() == ([1, 2, 3, 4, 5, 6] if mutable else [0, 1, 2, 3, 4, 5])


def test_chained_kernels_update_in_place_and_an_argument_read_later_is_copied_first():
    prog = _program(lambda x: (_add_one(_add_one(x)),), jnp.zeros(3, jnp.int32), mutable=[True])
    assert _copies(prog) == [0, 0]
    xt = torch.tensor([1, 2, 3], dtype=torch.int32)
    prog([xt])
    assert xt.tolist() == [3, 4, 5]
    # x is read by the sum after add_one aliases it: add_one works on a copy, the sum sees the old x
    prog = _program(lambda x: (_sum(x, _add_one(x)),), jnp.zeros(3, jnp.int32), mutable=[True])
    assert _copies(prog) == [1, 0]
    xt = torch.tensor([1, 2, 3], dtype=torch.int32)
    prog([xt])
    assert xt.tolist() == [3, 5, 7]


def test_an_operand_read_through_another_operand_is_not_overwritten_in_place():
    def fn(x):
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return (pl.pallas_call(_sum_kernel, out_shape=out, input_output_aliases={0: 0}, interpret=True)(x, x),)

    prog = _program(fn, jnp.zeros(3, jnp.int32), mutable=[True])
    assert _copies(prog) == [1]
    xt = torch.tensor([1, 2, 3], dtype=torch.int32)
    prog([xt])
    assert xt.tolist() == [2, 4, 6]


def test_work_on_launch_data_outside_the_kernels_is_refused_naming_it_and_constants_fold_at_build():
    with pytest.raises(program.NotNative, match=r"'add' on launch data outside the kernels"):
        _program(lambda x: (x + jnp.int32(1),), jnp.zeros(3, jnp.int32), mutable=[True])
    # arithmetic on constants runs once, at build time: the launch is its kernels alone
    prog = _program(
        lambda x: (_sum(x, jnp.arange(3, dtype=jnp.int32) * 2 + 1),), jnp.zeros(3, jnp.int32), mutable=[True]
    )
    assert prog.num_kernels == 1 and len(prog.consts) == 1
    xt = torch.tensor([10, 20, 30], dtype=torch.int32)
    prog([xt])
    assert xt.tolist() == [11, 23, 35]


@pytest.mark.parametrize("fused", [True, False])
def test_the_compiled_write_updates_the_canary_and_the_log_in_place(fused, monkeypatch):
    """Traced for CUDA (compiled kernels, planned on CPU with stand-in kernels), the write is its kernels alone and
    hands each of them the canary words, the ring, the write index and the counters in place: no argument is
    copied. A small launch is one kernel with the fused write on (``fused``); with it off, four launches with
    nothing but views between them (the claim one of them)."""
    from pallas_kernels import config as pallas_config

    fuse = 512 if fused else 0
    cfg = pallas_config.PallasConfig(write_fused_max_tokens=fuse, write_fused_max_hashed=fuse // 2)
    monkeypatch.setattr(pallas_config, "DEFAULT_CONFIG", cfg)
    rng = random.Random(16)
    w = World.make(rng, num_slots=4096)
    plan, kw = random_write_args(rng, w)
    kw["enable_write_input_assert"], kw["expected_input_tokens"], kw["expected_input_positions"] = False, None, None

    class Stand:  # a compiled kernel that launches nothing
        def __init__(self, eqn):
            self.aliases = tuple((int(i), int(o)) for i, o in eqn.params["input_output_aliases"])
            self.name = eqn.params.get("name")
            self.alignments = (32,) * (len(eqn.invars) + len(eqn.outvars))

        def launch_ptrs(self, ptrs):
            del ptrs

    monkeypatch.setattr(native, "_kernel_for", lambda device: Stand)
    args = _write_args(w, plan, kw)
    prog = native._build(
        "write", ("pallas", "cuda", 2, 0, (), False), _write_factory(), args, torch.device("cpu")
    ).program
    multi = ["canary_write_chain", "canary_write_claim", "canary_write_won", "canary_write_store"]
    assert prog.kernel_names == (["canary_write_fused"] if fused else multi)
    n_args = len(args)
    copied = [src for step in prog.steps for _, src in step[3] if src < n_args]
    assert copied == [], [args[j].name for j in copied]
    canary = [j for j, a in enumerate(args) if a.name == "canary_buf"][0]
    writers = [step for step in prog.steps if canary in step[2]]  # kernels whose result is the canary buffer
    assert len(writers) == (1 if fused else 3)  # the fused kernel; or chain, claim and store (won only reads it)
    assert dict(prog.writes)[canary] == canary  # nothing to write back


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


def test_a_default_native_path_that_cannot_build_falls_back_to_dlpack_once_with_a_warning():
    """When the native path is only the default (not asked for) and a launch shape cannot be built, nothing has
    run: the launch takes the DLPack path, with one warning naming the error, and so do its later launches."""
    from interop import kernels, runner
    from interop.buffers import TensorArg

    rng = random.Random(17)
    ours = World.make(rng)
    ref = ours.clone()
    plan, kw = random_write_args(rng, ours)

    def launch_args(w):  # the reference backend's write body is glue, no kernels: the native build refuses it
        c = w.context(2)
        args = [TensorArg("canary_buf", c.canary_buf, True)]
        args += [TensorArg(f"plan.{f}", getattr(plan, f)) for f in plan.__dataclass_fields__]
        args += [TensorArg(n, kw[n]) for n in ("input_ids", "positions", "out_cache_loc")]
        args += [TensorArg(n, getattr(c, n), True) for n in ("violation_ring", "violation_write_index")]
        args += [TensorArg(n, getattr(c, n), True) for n in ("slot_run_counter", "kernel_run_counter")]
        args.append(TensorArg("enable_chain_position_assert", c.enable_chain_position_assert))
        return args

    statics = ("reference", "cpu", 2, 0, (), False)
    with pytest.warns(RuntimeWarning, match=r"could not build this write launch \(NotNative: .*outside the kernels"):
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


def test_tiny_operands_drop_their_alignment_claim_so_counter_views_are_not_staged():
    """A compiled kernel's TTIR declares 32-byte alignment on every pointer; the native path drops it for operands
    of at most ``TINY_BYTES`` (SGLang's one-row counter views sit at 8-byte offsets), and only for those."""
    from jax.experimental.pallas import triton as pltriton

    from interop.native import triton_ttir, ttir_text

    def kern(a_ref, c_ref, o_ref, c_out):
        o_ref[...] = a_ref[...] + 1
        c_out[0] = c_ref[0] + 1

    def fn(a, c):
        shapes = (jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(c.shape, c.dtype))
        params = pltriton.CompilerParams(num_warps=4, num_stages=1)
        return pl.pallas_call(kern, out_shape=shapes, input_output_aliases={1: 1}, compiler_params=params)(a, c)

    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((128,), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32))
    spec = triton_ttir.kernel_spec(closed.jaxpr.eqns[0])
    assert ttir_text.pointer_alignments(spec.ttir, "k") == [32, 32, 32, 32]
    relaxed = ttir_text.relax_alignment(spec.ttir, {1, 3})
    assert ttir_text.pointer_alignments(relaxed, "k") == [32, 1, 32, 1]
    assert relaxed.replace(" {tt.divisibility = 32 : i32}", "") == spec.ttir.replace(
        " {tt.divisibility = 32 : i32}", ""
    )
