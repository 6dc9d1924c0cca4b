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

Launch objects live in :mod:`interop.sglang_types`, the plan launcher in :mod:`interop.sglang_plan` and the launch
prologue the launchers share in :mod:`interop.sglang_launch` (all re-exported here); every check is
:mod:`canary_jax.contract.validation`'s, on the tensors' facts (:mod:`interop.arguments`), run once per launch.

Where SGLang's CUDA and CPU paths differ, these launchers follow SGLang per device: the plan's ``bs <= 4096``
limit and its kernel-path messages apply to CUDA tensors, the reference's messages to CPU tensors. Verify /
write semantics are canary-jax's (deterministic row order, seeds read before the launch, last writer wins),
which equal SGLang's torch references whenever those are well defined.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from canary_jax.contract import coverage, validation
from canary_jax.ops import backends
from interop import arguments, kernels, padding
from interop.arguments import TORCH_DTYPES, check, tensor
from interop.native import replay
from interop.runner import TensorArg
from interop.sglang_launch import _SOURCE_VALUES as _SOURCE_VALUES
from interop.sglang_launch import PLAN_BS_BLOCK_SIZE as PLAN_BS_BLOCK_SIZE
from interop.sglang_launch import (
    _check_canary_buf,
    _checked,
    _context_key,
    _replay_key,
    _run,
    _sources,
    _staged,
    _statics,
    stable,
    stable_context,
)
from interop.sglang_launch import _int as _int
from interop.sglang_plan import launch_canary_plan_kernels
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


# --- verify ----------------------------------------------------------------------------------------------
def verify_replay_key(
    context: Any,
    plan: Any,
    check_verify_expected_token: Any,
    *,
    backend: str | None,
    path: str | None,
    layout: bool = False,
) -> Any:
    """The replay key of a verify launch (:mod:`interop.native.replay`; its layout key with ``layout``), None
    where replay does not apply (for :func:`launch_canary_verify_kernel` and ``benchmarks/replay_profile.py``)."""
    return _replay_key(
        "verify",
        path,
        backend,
        getattr(context, "canary_buf", None),
        lambda k: (
            _context_key(context, arguments.CONTEXT_FIELDS, k),
            replay.fields_sig(plan, validation.VERIFY_PLAN_FIELDS, (), k),
            replay.value_sig(check_verify_expected_token),
        ),
        layout,
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
    context = stable_context(context, arguments.CONTEXT_FIELDS)  # read once: keyed, checked and launched alike
    plan = stable(plan, validation.VERIFY_PLAN_FIELDS)
    key = verify_replay_key(context, plan, check_verify_expected_token, backend=backend, path=path)
    if replay.GRAPHS.replay(key):
        return
    statics, checked, key = _checked(
        key,
        lambda: verify_replay_key(context, plan, check_verify_expected_token, backend=backend, path=path, layout=True),
        lambda: _check_verify(context, plan, check_verify_expected_token, backend),
    )
    if checked is not None:
        _, ctx, pl, src_args, _ = checked
    else:  # the same facts passed the checks: gather the tensors
        ctx = dict(zip(arguments.CONTEXT_FIELDS, _CONTEXT_GET(context)))
        pl = dict(zip(_VERIFY_PLAN_NAMES, _VERIFY_PLAN_GET(plan)))
        src_args = arguments.source_tensor_args([s.tensor for s in _sources(context)]) if statics[4] else []

    def launch():  # bucket staging and the launch: what a launch graph captures
        padded = padding.verify_plan(pl)
        args = [TensorArg("canary_buf", ctx["canary_buf"])]
        args += [TensorArg(n, t) for n, t in padded.items()]
        args += [TensorArg(n, ctx[n], True) for n in arguments.CONTEXT_FIELDS[1:]]
        args += src_args
        return _run("verify", statics, kernels.verify_body_factory, args, path, key), _staged(pl, padded)

    replay.GRAPHS.run(key, launch)


_CONTEXT_GET = operator.attrgetter(*arguments.CONTEXT_FIELDS)
_VERIFY_PLAN_NAMES = tuple("plan." + f for f in validation.VERIFY_PLAN_FIELDS)
_VERIFY_PLAN_GET = operator.attrgetter(*validation.VERIFY_PLAN_FIELDS)


def _check_verify(context: Any, plan: Any, check_verify_expected_token: Any, backend: str | None) -> tuple:
    """A verify launch's checks: ``(statics, context tensors, plan tensors, source args, read_slots)``."""
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
    read_slots = arguments.check_coverage(
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
    return statics, ctx, pl, src_args, read_slots


# --- write -----------------------------------------------------------------------------------------------
_WRITE_CONTEXT_FIELDS = (*arguments.CONTEXT_FIELDS, "enable_chain_position_assert")


def write_replay_key(
    context: Any,
    plan: Any,
    tokens: tuple,
    enable_write_input_assert: Any,
    *,
    backend: str | None,
    path: str | None,
    layout: bool = False,
) -> Any:
    """The replay key of a write launch (:mod:`interop.native.replay`; its layout key with ``layout``), None
    where replay does not apply;
    ``tokens`` = ``(input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions)`` (for
    :func:`launch_canary_write_kernel` and ``benchmarks/replay_profile.py``)."""
    return _replay_key(
        "write",
        path,
        backend,
        getattr(context, "canary_buf", None),
        lambda k: (
            _context_key(context, _WRITE_CONTEXT_FIELDS, k),
            replay.fields_sig(plan, validation.WRITE_PLAN_FIELDS, (), k),
            replay.tensors_sig(tokens, k),
            replay.value_sig(enable_write_input_assert),
        ),
        layout,
    )


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
    tokens = (input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions)
    context = stable_context(context, _WRITE_CONTEXT_FIELDS)  # read once: keyed, checked and launched alike
    plan = stable(plan, validation.WRITE_PLAN_FIELDS)
    key = write_replay_key(context, plan, tokens, enable_write_input_assert, backend=backend, path=path)
    if replay.GRAPHS.replay(key):
        return
    statics, checked, key = _checked(
        key,
        lambda: write_replay_key(
            context, plan, tokens, enable_write_input_assert, backend=backend, path=path, layout=True
        ),
        lambda: _check_write(context, plan, tokens, enable_write_input_assert, backend),
    )
    if checked is not None:
        _, ctx, pl, toks, src_args, _ = checked
    else:  # the same facts passed the checks: gather the tensors
        ctx = dict(zip(_WRITE_CONTEXT_FIELDS, _WRITE_CONTEXT_GET(context)))
        pl = dict(zip(_WRITE_PLAN_NAMES, _WRITE_PLAN_GET(plan)))
        toks = dict(zip(_TOKEN_NAMES, tokens if statics[5] else tokens[:3]))
        src_args = arguments.source_tensor_args([s.tensor for s in _sources(context)]) if statics[4] else []

    def launch():  # bucket staging and the launch: what a launch graph captures
        pl_p, toks_p = padding.write_inputs(pl, toks)
        args = [TensorArg("canary_buf", ctx["canary_buf"], True)]
        args += [TensorArg(n, t) for n, t in pl_p.items()]
        args += [TensorArg(n, t) for n, t in toks_p.items()]
        args += [TensorArg(n, ctx[n], True) for n in arguments.CONTEXT_FIELDS[1:]]
        args += [TensorArg("enable_chain_position_assert", ctx["enable_chain_position_assert"])]
        args += src_args
        ran = _run("write", statics, kernels.write_body_factory, args, path, key)
        return ran, _staged(pl, pl_p) + _staged(toks, toks_p)

    replay.GRAPHS.run(key, launch)


_WRITE_CONTEXT_GET = operator.attrgetter(*_WRITE_CONTEXT_FIELDS)
_WRITE_PLAN_NAMES = tuple("plan." + f for f in validation.WRITE_PLAN_FIELDS)
_WRITE_PLAN_GET = operator.attrgetter(*validation.WRITE_PLAN_FIELDS)
_TOKEN_NAMES = ("input_ids", "positions", "out_cache_loc", "expected_input_tokens", "expected_input_positions")


def _check_write(context: Any, plan: Any, tokens: tuple, enable_write_input_assert: Any, backend: str | None) -> tuple:
    """A write launch's checks: ``(statics, context tensors, plan tensors, token tensors, source args,
    read_slots)``; ``tokens`` as :func:`write_replay_key` takes them."""
    input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions = tokens
    sources = _sources(context)
    validation.check_source_count(len(sources))
    ctx = arguments.tensors(context, _WRITE_CONTEXT_FIELDS)
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
    read_slots = arguments.check_coverage(
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
    return statics, ctx, pl, toks, src_args, read_slots
