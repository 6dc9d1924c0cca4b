"""The JAX side of the torch launchers: verify / write / plan bodies for :func:`interop.runner.run_in_place`.

Each ``*_body_factory(statics)`` returns ``body(vals) -> dict``: ``vals`` maps SGLang's argument names
(``canary_buf``, ``plan.verify_slot_indices``, ``violation_ring``, ``slot_run_counter``, ...) to JAX arrays in
canary-jax's form (int64 tensors as ``uint32[..., 2]`` pairs, the rest in their torch dtype); the body
rebuilds canary-jax's launch objects, runs the chosen backend (``canary_jax.ops.reference`` or the Pallas
kernels) and returns the new values of the mutable names. SGLang passes per-tag counters as one-element
views; the body places them at row ``tag`` of canary-jax's per-tag counter arrays and reads them back.
"""

from __future__ import annotations

import jax.numpy as jnp

from canary_jax.contract import constants, sources, validation
from canary_jax.contract.layout import ViolationLog
from canary_jax.ops import backends, plan_launch
from canary_jax.planning.plans import VerifyOrWriteContext, VerifyPlan, WritePlan


def _counters(c: jnp.ndarray, row: int, num_tags: int) -> jnp.ndarray:
    """One int64 counter ``uint32[1, 2]`` as the log's counter array: itself where ``row`` is 0 and the array
    has one row (the Pallas kernels bump the one row of a one-row array, :class:`pallas_kernels.calls.Prologue`:
    no scatter around the launch), else placed at row ``row`` of a ``uint32[num_tags, 2]`` array."""
    if num_tags == 1:
        return c
    return jnp.zeros((num_tags, 2), jnp.uint32).at[row].set(c[0])


def _counter_rows(backend: str, tag: int) -> tuple[int, int]:
    """``(row, rows)`` of the launch's counter in the log built for ``backend``: the Pallas kernels take the
    counter alone; the jnp reference indexes the full per-tag arrays by tag."""
    return (0, 1) if backend == "pallas" else (tag, max(constants.NUM_LAUNCH_TAGS, tag + 1))


def _log(v: dict, backend: str, tag: int, flag) -> ViolationLog:
    row, n = _counter_rows(backend, tag)
    return ViolationLog(
        ring=v["violation_ring"],
        write_index=v["violation_write_index"],
        slot_run_counters=_counters(v["slot_run_counter"], row, n),
        kernel_run_counters=_counters(v["kernel_run_counter"], row, n),
        enable_chain_position_assert=flag,
    )


def _log_out(log: ViolationLog, backend: str, tag: int) -> dict:
    row, _ = _counter_rows(backend, tag)
    return {
        "violation_ring": log.ring,
        "violation_write_index": log.write_index,
        "slot_run_counter": log.slot_run_counters[row][None],
        "kernel_run_counter": log.kernel_run_counters[row][None],
    }


def _sources(v: dict, source_meta: tuple) -> tuple:
    return tuple(
        sources.prechecked_source(v[f"real_kv_sources[{i}].tensor"], page_size=p, num_bytes_per_token=n, read_bytes=r)
        for i, (p, n, r) in enumerate(source_meta)
    )


def _context(v: dict, backend: str, tag: int, mode: int, source_meta: tuple, flag) -> VerifyOrWriteContext:
    """canary-jax's launch context from the launch's values (``flag``: the chain-position assert)."""
    return VerifyOrWriteContext(
        canary_buf=v["canary_buf"],
        kernel_kind=constants.CanaryLaunchTag(tag),
        log=_log(v, backend, tag, flag),
        real_kv_sources=_sources(v, source_meta),
        real_kv_hash_mode=constants.RealKvHashMode(mode),
    )


def verify_body_factory(statics):
    """statics = (backend, platform, tag, mode, source_meta, check_verify_expected_token); ``platform`` is the
    torch device type, which decides whether the Pallas kernels run compiled or interpreted."""
    backend, platform, tag, mode, source_meta, check = statics
    impl = backends.implementation("verify", backend, platform=platform)

    def body(v: dict) -> dict:
        plan = VerifyPlan(**{f: v[f"plan.{f}"] for f in validation.VERIFY_PLAN_FIELDS})
        ctx = _context(v, backend, tag, mode, source_meta, jnp.ones((1,), jnp.int32))
        out = impl(ctx, plan, check_verify_expected_token=check)
        return _log_out(out.log, backend, tag)

    return body


def write_body_factory(statics):
    """statics = (backend, platform, tag, mode, source_meta, enable_write_input_assert); ``platform`` as for
    :func:`verify_body_factory`."""
    backend, platform, tag, mode, source_meta, assert_inputs = statics
    impl = backends.implementation("write", backend, platform=platform)

    def body(v: dict) -> dict:
        plan = WritePlan(**{f: v[f"plan.{f}"] for f in validation.WRITE_PLAN_FIELDS})
        ctx = _context(v, backend, tag, mode, source_meta, v["enable_chain_position_assert"])
        out = impl(
            ctx,
            plan,
            v["input_ids"],
            v["positions"],
            v["out_cache_loc"],
            enable_write_input_assert=assert_inputs,
            expected_input_tokens=v.get("expected_input_tokens"),
            expected_input_positions=v.get("expected_input_positions"),
        )
        res = _log_out(out.log, backend, tag)
        res["canary_buf"] = out.canary_buf
        return res

    return body


def plan_body_factory(statics):
    """statics = (backend, platform, swa_window_size, kv_token_id_vs_position_offset, has_lut, has_pool): the plans
    over the launcher's plan buffers, on ``backend``'s plan kernel (:func:`canary_jax.ops.plan_launch.build_plans`:
    ``pallas`` is one launch, compiled where ``platform``, the torch device type, is a GPU, interpreted elsewhere;
    ``reference`` is the jnp builder)."""
    backend, platform, w, k, has_lut, has_pool = statics

    def body(v: dict) -> dict:
        vp = VerifyPlan(**{f: v[f"verify_plan_out.{f}"] for f in validation.VERIFY_PLAN_FIELDS})
        wp = WritePlan(**{f: v[f"write_plan_out.{f}"] for f in validation.WRITE_PLAN_FIELDS})
        new_v, new_w = plan_launch.build_plans(
            backend=backend,
            platform=platform,
            req_pool_indices=v["req_pool_indices"],
            prefix_lens=v["prefix_lens"],
            extend_seq_lens=v["extend_seq_lens"],
            req_to_token=v["req_to_token"],
            swa_window_size=w,
            full_to_swa_index_mapping=v["full_to_swa_index_mapping"] if has_lut else None,
            req_to_verify_expected_tokens=v["req_to_verify_expected_tokens"] if has_pool else None,
            req_to_verify_expected_tokens_valid_lens=(
                v["req_to_verify_expected_tokens_valid_lens"] if has_pool else None
            ),
            kv_token_id_vs_position_offset=k,
            verify_plan_out=vp,
            write_plan_out=wp,
        )
        out = {f"verify_plan_out.{f}": getattr(new_v, f) for f in validation.VERIFY_PLAN_FIELDS}
        out.update({f"write_plan_out.{f}": getattr(new_w, f) for f in validation.WRITE_PLAN_FIELDS})
        return out

    return body
