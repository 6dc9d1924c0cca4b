"""Drop-in replacements for SGLang's kv-canary launchers: canary-jax on torch tensors, in place.

A torch serving engine keeps using its tensors and its calls::

    from interop.sglang import (launch_canary_plan_kernels, launch_canary_verify_kernel,
                                launch_canary_write_kernel, VerifyOrWriteContext, VerifyPlan, WritePlan, ...)

    launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=..., ...)
    launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False)
    launch_canary_write_kernel(context=ctx, plan=wp, input_ids=..., positions=..., out_cache_loc=...,
                               enable_write_input_assert=False, expected_input_tokens=None,
                               expected_input_positions=None)

Names, keyword arguments, field names, shapes and dtypes are SGLang's (``python/sglang/kernels/ops/kv_canary/``
``verify.py``, ``write.py``, ``plan/api.py``; SPEC sections 4 to 7). Any object with those attribute names is
accepted (SGLang's own dataclasses included). After a call the torch tensors hold what SGLang's launchers
would have written (canary buffer, ring, write index, counters, plan outputs), in place and ordered against
torch's current stream.

Path: the keyword ``path=`` (``"native"`` or ``"dlpack"``), else ``$CANARY_JAX_TORCH_PATH``, else ``"native"`` for
the Pallas backend on CUDA tensors with triton importable and ``"dlpack"`` otherwise
(:func:`interop.native.launch.resolve_path`). ``native``: torch ops and Triton kernels on torch's current stream,
no JAX per launch, capturable in a torch CUDA graph (:mod:`interop.native`). ``dlpack``: one jitted JAX program
on zero-copy imports, outputs donated (:mod:`interop.runner`). Same bytes either way.

Errors are SGLang's (SPEC 10), raised before anything runs, so a refused call leaves every tensor untouched:
``len(real_kv_sources) > 4``, ``kv-canary: {name} must be contiguous``, the RealKvSource ABI checks, the
write-input-assert presence checks, the plan's LUT / bs / capacity checks. The interop adds its own, all
naming the argument: wrong dtype (TypeError), wrong shape, device mix (CPU with CUDA, two GPUs), outputs
aliasing other arguments, misaligned pointers, consumed DLPack capsules (ValueError).

Launch shapes: the verify and write launchers pad the plan capacity, the request rows and the token count to
buckets (:mod:`interop.padding`: bucket-sized copies of the small read-only inputs; outputs keep their shapes),
so changing sizes do not compile a program each. The plan launcher is not padded (its outputs' shapes are the
caller's; its inputs change with ``bs``).

Backend: the keyword ``backend=`` (``"reference"`` or ``"pallas"``), else ``$CANARY_JAX_BACKEND``, else Pallas
for CUDA tensors and the jnp reference for CPU tensors (Pallas on CPU runs interpreted).

Launch objects live in :mod:`interop.sglang_types` (re-exported here); every check is
:mod:`canary_jax.contract.validation`'s, on the tensors' facts (:mod:`interop.arguments`), run once per launch.

Where SGLang's CUDA and CPU paths differ, these launchers follow SGLang per device: the plan's ``bs <= 4096``
limit and its kernel-path messages apply to CUDA tensors, the reference's messages to CPU tensors. Verify /
write semantics are canary-jax's (deterministic row order, seeds read before the launch, last writer wins),
which equal SGLang's torch references whenever those are well defined.
"""

from __future__ import annotations

import operator
import os
from typing import Any

import jax
import torch

from canary_jax.contract import coverage, validation
from canary_jax.ops import backends, buckets
from interop import arguments, kernels, padding, runner
from interop.arguments import TORCH_DTYPES, check, tensor
from interop.native import launch as native
from interop.native import replay
from interop.runner import TensorArg
from interop.sglang_types import (
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    CanaryDeviceState,
    CanaryLaunchTag,
    FailReason,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
    WritePlan,
)

PLAN_BS_BLOCK_SIZE = 4096  # SGLang's _PLAN_BS_BLOCK_SIZE (Triton offsets kernel, CUDA path only)

__all__ = [
    "CANARY_SLOT_BYTES",
    "CanaryDeviceState",
    "CanaryLaunchTag",
    "FailReason",
    "MAX_REAL_KV_SOURCES",
    "RealKvHashMode",
    "RealKvSource",
    "VerifyOrWriteContext",
    "VerifyPlan",
    "WritePlan",
    "launch_canary_plan_kernels",
    "launch_canary_verify_kernel",
    "launch_canary_write_kernel",
]


def _statics(context: Any) -> tuple[int, int]:
    tag = validation.check_kernel_kind(context.kernel_kind)
    mode = validation.check_hash_mode(getattr(context, "real_kv_hash_mode", 0))
    return int(tag), int(mode)


def _sources(context: Any) -> tuple:
    sources = getattr(context, "real_kv_sources", ()) or ()
    if not isinstance(sources, (tuple, list)):
        raise TypeError(
            f"kv-canary: real_kv_sources must be a tuple of RealKvSource (at most {MAX_REAL_KV_SOURCES}), "
            f"got {type(sources).__name__}"
        )
    return tuple(sources)


def _int(x: Any, name: str) -> int:
    """``x`` as an int (a Python or numpy integer, or a 0-d integer tensor), else a TypeError naming ``name``."""
    try:
        return int(operator.index(x))
    except TypeError:
        raise TypeError(f"kv-canary: {name} must be an int, got {type(x).__name__}") from None


def _check_canary_buf(buf: torch.Tensor) -> None:
    validation.check_canary_buffer(arguments.facts(buf), u8=TORCH_DTYPES.u8)


def _run(op: str, statics: Any, body_factory: Any, args: list, path: str | None) -> bool:
    """Runs a checked launch on the torch path ``path`` picks (:func:`interop.native.launch.resolve_path`);
    whether it ran on the native path (a CUDA graph can then capture it)."""
    backend = statics[0] if op in ("verify", "write") else "pallas"  # the plan is one jnp program
    if native.resolve_path(path, args[0].tensor.device, backend) == "native":
        if op == "plan":
            native.run_plan(statics, args)
            return True
        # a default (not asked for) native path falls back to DLPack where it cannot build
        asked = path is not None or bool(os.environ.get(native.PATH_ENV))
        return native.run_native(op, statics, body_factory, args, fallback=None if asked else runner.run_in_place)
    runner.run_in_place(op, statics, body_factory, args)
    return False


def _replay_key(op: str, path: str | None, backend: str | None, first: Any, parts: Any) -> tuple | None:
    """The launch's replay key (:mod:`interop.native.replay`), or None where replay does not apply: not CUDA
    tensors, not the native path, an argument the key cannot name, or a bad name (the checks will raise).
    ``parts()`` gives the launch's arguments already keyed (:func:`interop.native.replay.sig`); it is called only
    where replay applies."""
    if not isinstance(first, torch.Tensor) or first.device.type != "cuda":
        return None
    if first.get_device() != torch.cuda.current_device():  # replay runs on the current device's stream: eager
        return None
    try:
        b = backends.resolve_backend(backend, platform="cuda") if op != "plan" else "pallas"
        if native.resolve_path(path, first.device, b) != "native":
            return None
        env = (os.environ.get(native.PATH_ENV), os.environ.get(backends.BACKEND_ENV))
        x64 = bool(jax.config.jax_enable_x64)
        # the process-wide bucket policy decides the staging copies a graph captures
        modes = (x64, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), buckets.default_buckets())
        return (op, path, backend, env, modes, parts())
    except (ValueError, TypeError, replay.NotKeyable):
        return None


def _context_key(context: Any, fields: tuple[str, ...]) -> tuple:
    # _sources' TypeError (not a sequence) means no key: the eager checks then raise it
    srcs = _sources(context)
    if srcs and _int(getattr(context, "real_kv_hash_mode", 0), "real_kv_hash_mode") != 0:
        # a source shorter than the canary buffer is checked against the launch's slots, read every launch: eager
        n = getattr(getattr(context, "canary_buf", None), "shape", (0,))[0]
        for x in srcs:
            t = getattr(x, "tensor", None)
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] * _int(x.page_size, "page_size") < n:
                raise replay.NotKeyable("real_kv_sources")
    src = tuple(replay.fields_sig(x, ("tensor",), _SOURCE_VALUES) for x in srcs)
    return (replay.fields_sig(context, fields, ("kernel_kind", "real_kv_hash_mode")), src)


_SOURCE_VALUES = ("page_size", "num_bytes_per_token", "read_bytes")


def _staged(before: dict, after: dict) -> list[torch.Tensor]:
    """The staging tensors :mod:`interop.padding` put in place of the caller's (a graph keeps them alive)."""
    return [t for n, t in after.items() if before.get(n) is not t]


# --- verify ----------------------------------------------------------------------------------------------
def verify_replay_key(
    context: Any, plan: Any, check_verify_expected_token: Any, *, backend: str | None, path: str | None
) -> tuple | None:
    """The replay key of a verify launch (:mod:`interop.native.replay`), None where replay does not apply (for
    :func:`launch_canary_verify_kernel` and ``benchmarks/replay_profile.py``)."""
    return _replay_key(
        "verify",
        path,
        backend,
        getattr(context, "canary_buf", None),
        lambda: (
            _context_key(context, arguments.CONTEXT_FIELDS),
            replay.fields_sig(plan, validation.VERIFY_PLAN_FIELDS),
            replay.value_sig(check_verify_expected_token),
        ),
    )


def launch_canary_verify_kernel(
    *,
    context: Any,
    plan: Any,
    check_verify_expected_token: bool,
    backend: str | None = None,
    path: str | None = None,
) -> None:
    """SGLang's ``launch_canary_verify_kernel`` on torch tensors (SPEC 5; canary-jax ``verify_reference``).

    Calling contract: ``kernel_run_counter += 1`` always; with ``plan.enable[0] != 0``:
    ``slot_run_counter += min(num_valid, C)`` and each failing entry appends a row to ``violation_ring`` (in
    entry order) and bumps ``violation_write_index``. ``canary_buf``, the plan and the sources are read-only.

    Raises:
      ValueError / TypeError: SGLang's errors and the interop's (see the module docstring); nothing runs.
    """
    key = verify_replay_key(context, plan, check_verify_expected_token, backend=backend, path=path)
    if replay.GRAPHS.replay(key):
        return
    sources = _sources(context)
    validation.check_source_count(len(sources))
    ctx = arguments.tensors(context, arguments.CONTEXT_FIELDS)
    pl = arguments.tensors(plan, validation.VERIFY_PLAN_FIELDS, "plan.")
    named = {**ctx, **pl}
    arguments.check_contiguous(named, ["canary_buf", *pl, *arguments.CONTEXT_FIELDS[1:]])
    launch_sources = arguments.check_sources(sources, checked_type=RealKvSource)
    tag, mode = _statics(context)
    _check_canary_buf(ctx["canary_buf"])
    validation.check_verify_plan(arguments.fields_facts(pl, "plan."), TORCH_DTYPES)
    arguments.check_log(ctx, with_flag=False)
    src_args, meta = arguments.source_args(launch_sources, mode)
    arguments.check_devices({**named, **{a.name: a.tensor for a in src_args}}, "canary_buf")
    n = int(ctx["canary_buf"].shape[0])
    arguments.check_coverage(
        launch_sources,
        mode,
        n,
        op="verify",
        name="plan.verify_slot_indices",
        hashed=lambda: coverage.verify_hashed(
            arguments.host_int64(pl["plan.verify_slot_indices"]),
            int(pl["plan.verify_num_valid"][0]),
            int(pl["plan.enable"][0]),
            n,
        ),
    )
    platform = ctx["canary_buf"].device.type
    check = bool(check_verify_expected_token)
    statics = (backends.resolve_backend(backend, platform=platform), platform, tag, mode, meta, check)

    def launch():  # bucket staging and the launch: what a launch graph captures
        padded = padding.verify_plan(pl)
        args = [TensorArg("canary_buf", ctx["canary_buf"])]
        args += [TensorArg(n, t) for n, t in padded.items()]
        args += [TensorArg(n, ctx[n], True) for n in arguments.CONTEXT_FIELDS[1:]]
        args += src_args
        return _run("verify", statics, kernels.verify_body_factory, args, path), _staged(pl, padded)

    replay.GRAPHS.run(key, launch)


# --- write -----------------------------------------------------------------------------------------------
def launch_canary_write_kernel(
    *,
    context: Any,
    plan: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: torch.Tensor | None,
    expected_input_positions: torch.Tensor | None,
    backend: str | None = None,
    path: str | None = None,
) -> None:
    """SGLang's ``launch_canary_write_kernel`` on torch tensors (SPEC 6; canary-jax ``write_reference``).

    Calling contract: ``kernel_run_counter += 1`` always; every live entry with ``out_cache_loc >= 0`` stores
    ``(token, position, running prev_hash, real_kv_hash)`` into its slot of ``canary_buf`` and counts in
    ``slot_run_counter``; input-assert and chain-position mismatches append rows (request-major, entry order).

    Raises:
      ValueError / TypeError: SGLang's errors and the interop's (see the module docstring); nothing runs.
    """
    key = _replay_key(
        "write",
        path,
        backend,
        getattr(context, "canary_buf", None),
        lambda: (
            _context_key(context, (*arguments.CONTEXT_FIELDS, "enable_chain_position_assert")),
            replay.fields_sig(plan, validation.WRITE_PLAN_FIELDS),
            replay.sig((input_ids, positions, out_cache_loc)),
            replay.value_sig(enable_write_input_assert),
            replay.sig((expected_input_tokens, expected_input_positions)),
        ),
    )
    if replay.GRAPHS.replay(key):
        return
    sources = _sources(context)
    validation.check_source_count(len(sources))
    ctx = arguments.tensors(context, (*arguments.CONTEXT_FIELDS, "enable_chain_position_assert"))
    pl = arguments.tensors(plan, validation.WRITE_PLAN_FIELDS, "plan.")
    toks = {
        "input_ids": tensor(input_ids, "input_ids"),
        "positions": tensor(positions, "positions"),
        "out_cache_loc": tensor(out_cache_loc, "out_cache_loc"),
    }
    arguments.check_contiguous({"canary_buf": ctx["canary_buf"], **pl, **toks})
    flag = bool(enable_write_input_assert)
    validation.check_expected_inputs(
        flag, has_tokens=expected_input_tokens is not None, has_positions=expected_input_positions is not None
    )
    if flag:
        toks["expected_input_tokens"] = tensor(expected_input_tokens, "expected_input_tokens")
        toks["expected_input_positions"] = tensor(expected_input_positions, "expected_input_positions")
        arguments.check_contiguous(toks, ["expected_input_tokens", "expected_input_positions"])
    arguments.check_contiguous(ctx, [*arguments.CONTEXT_FIELDS[1:], "enable_chain_position_assert"])
    launch_sources = arguments.check_sources(sources, checked_type=RealKvSource)
    tag, mode = _statics(context)
    _check_canary_buf(ctx["canary_buf"])
    validation.check_write_plan(arguments.fields_facts(pl, "plan."), TORCH_DTYPES)
    for n, t in toks.items():  # SGLang's order: input_ids fixes num_tokens, the others must match it
        check(t, n, torch.int64, (None,))
        validation.check_same_length(n, t.shape[0], ref_name="input_ids", ref_length=toks["input_ids"].shape[0])
    arguments.check_log(ctx, with_flag=True)
    src_args, meta = arguments.source_args(launch_sources, mode)
    arguments.check_devices({**ctx, **pl, **toks, **{a.name: a.tensor for a in src_args}}, "canary_buf")
    n = int(ctx["canary_buf"].shape[0])
    arguments.check_coverage(
        launch_sources,
        mode,
        n,
        op="write",
        name="out_cache_loc",
        hashed=lambda: coverage.write_hashed(
            arguments.host_int64(pl["plan.write_offsets"]),
            int(pl["plan.write_num_valid_reqs"][0]),
            arguments.host_int64(toks["out_cache_loc"]),
            n,
        ),
    )
    platform = ctx["canary_buf"].device.type
    statics = (backends.resolve_backend(backend, platform=platform), platform, tag, mode, meta, flag)

    def launch():  # bucket staging and the launch: what a launch graph captures
        pl_p, toks_p = padding.write_inputs(pl, toks)
        args = [TensorArg("canary_buf", ctx["canary_buf"], True)]
        args += [TensorArg(n, t) for n, t in pl_p.items()]
        args += [TensorArg(n, t) for n, t in toks_p.items()]
        args += [TensorArg(n, ctx[n], True) for n in arguments.CONTEXT_FIELDS[1:]]
        args += [TensorArg("enable_chain_position_assert", ctx["enable_chain_position_assert"])]
        args += src_args
        ran = _run("write", statics, kernels.write_body_factory, args, path)
        return ran, _staged(pl, pl_p) + _staged(toks, toks_p)

    replay.GRAPHS.run(key, launch)


# --- plan ------------------------------------------------------------------------------------------------
def launch_canary_plan_kernels(
    *,
    verify_plan_out: Any,
    write_plan_out: Any,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int,
    full_to_swa_index_mapping: torch.Tensor | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: torch.Tensor | None,
    req_to_verify_expected_tokens_valid_lens: torch.Tensor | None,
    kv_token_id_vs_position_offset: int,
    backend: str | None = None,
    path: str | None = None,
) -> None:
    """SGLang's ``launch_canary_plan_kernels`` on torch tensors (SPEC 7; canary-jax ``build_plans``).

    Fills ``verify_plan_out`` and ``write_plan_out`` in place. Regions SGLang leaves untouched keep their
    contents: verify entries past ``num_valid`` (all of them on overflow) and seeds past ``bs``;
    ``write_offsets`` past ``bs`` become zero. ``backend`` is accepted for symmetry (one implementation).

    Raises:
      ValueError / TypeError: SGLang's errors (device-specific like SGLang: CUDA tensors get the kernel
        path's checks and messages, CPU tensors the reference's) and the interop's; nothing runs.
    """
    del backend
    key = _replay_key(
        "plan",
        path,
        None,
        getattr(verify_plan_out, "verify_slot_indices", None),
        lambda: (
            replay.fields_sig(verify_plan_out, validation.VERIFY_PLAN_FIELDS),
            replay.fields_sig(write_plan_out, validation.WRITE_PLAN_FIELDS),
            replay.sig((req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, full_to_swa_index_mapping)),
            replay.sig((req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens)),
            tuple(replay.value_sig(v) for v in (swa_window_size, verify_capacity, kv_token_id_vs_position_offset)),
        ),
    )
    if replay.GRAPHS.replay(key):
        return
    vp = arguments.tensors(verify_plan_out, validation.VERIFY_PLAN_FIELDS, "verify_plan_out.")
    wp = arguments.tensors(write_plan_out, validation.WRITE_PLAN_FIELDS, "write_plan_out.")
    ins = {
        "req_pool_indices": tensor(req_pool_indices, "req_pool_indices"),
        "prefix_lens": tensor(prefix_lens, "prefix_lens"),
        "extend_seq_lens": tensor(extend_seq_lens, "extend_seq_lens"),
        "req_to_token": tensor(req_to_token, "req_to_token"),
    }
    has_lut = full_to_swa_index_mapping is not None
    has_pool = req_to_verify_expected_tokens is not None
    optional = {
        "full_to_swa_index_mapping": full_to_swa_index_mapping,
        "req_to_verify_expected_tokens": req_to_verify_expected_tokens,
        # SGLang reads the valid lengths only with the pool
        "req_to_verify_expected_tokens_valid_lens": req_to_verify_expected_tokens_valid_lens if has_pool else None,
    }
    ins.update({n: tensor(x, n) for n, x in optional.items() if x is not None})
    on_cuda = vp["verify_plan_out.verify_slot_indices"].device.type == "cuda"
    bs = int(ins["req_pool_indices"].shape[0]) if ins["req_pool_indices"].dim() >= 1 else 0
    arguments.check_contiguous({**ins, **vp, **wp})
    for n in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
        check(ins[n], n, torch.int64, (bs,))
    check(ins["req_to_token"], "req_to_token", torch.int32, (None, None))
    if has_lut:
        check(ins["full_to_swa_index_mapping"], "full_to_swa_index_mapping", torch.int64, (None,))
    if has_pool:
        check(ins["req_to_verify_expected_tokens"], "req_to_verify_expected_tokens", torch.int32, (None, None))
    if "req_to_verify_expected_tokens_valid_lens" in ins:
        check(
            ins["req_to_verify_expected_tokens_valid_lens"],
            "req_to_verify_expected_tokens_valid_lens",
            torch.int64,
            (bs,),
        )
    plan_cap = int(vp["verify_plan_out.verify_slot_indices"].shape[0])
    validation.check_verify_plan(
        arguments.fields_facts(vp, "verify_plan_out."), TORCH_DTYPES, prefix="verify_plan_out.", capacity=plan_cap
    )
    cw = validation.check_write_plan(
        arguments.fields_facts(wp, "write_plan_out."), TORCH_DTYPES, prefix="write_plan_out.", offsets_message=False
    )
    validation.check_plan_launch(
        swa_window_size=_int(swa_window_size, "swa_window_size"),
        has_lut=has_lut,
        lut_len=int(ins["full_to_swa_index_mapping"].shape[0]) if has_lut else 0,
        verify_capacity=_int(verify_capacity, "verify_capacity"),
        plan_capacity=plan_cap,
        bs=bs,
        write_req_capacity=cw,
        has_pool=has_pool,
        has_valid_lens="req_to_verify_expected_tokens_valid_lens" in ins,
        path=validation.PLAN_KERNEL_PATH if on_cuda else validation.PLAN_REFERENCE_PATH,
        max_bs=PLAN_BS_BLOCK_SIZE,
    )
    arguments.check_devices({**vp, **wp, **ins}, "verify_plan_out.verify_slot_indices")
    args = [TensorArg(n, t) for n, t in ins.items()]
    args += [TensorArg(n, t, True) for n, t in {**vp, **wp}.items()]
    offset = _int(kv_token_id_vs_position_offset, "kv_token_id_vs_position_offset")
    statics = (int(swa_window_size), offset, has_lut, has_pool)
    replay.GRAPHS.run(key, lambda: (_run("plan", statics, kernels.plan_body_factory, args, path), ()))
