"""A real-KV source shorter than the canary buffer (issue #28): SGLang's launchers accept it and hash the source's
bytes at the slots a launch touches; canary-jax accepts it too wherever the launch's slots are known on the host,
and refuses only a slot the launch hashes past the source, naming it. Inside ``jit`` (and a CUDA-graph capture)
the whole-buffer rule stays (``canary_jax.contract.coverage``).

Golden bytes are computed here with Python ints (``helpers/oracle.py``), never copied from our output.
"""

from __future__ import annotations

import dataclasses
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import canary_jax as cj
from canary_jax.contract import coverage
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_head, canary_plan, canary_sweep, canary_tail
from helpers import oracle
from helpers.interop_world import World, assert_same_bytes
from helpers.torch_reference import ref_verify, ref_write
from interop import sglang

NUM_SLOTS, ROWS, NBPT = 16, 8, 16  # the call: 16-slot canary buffer, a source of 8 rows x page_size 1
KV = np.array([[(r * 37 + c * 11 + 5) % 256 for c in range(NBPT)] for r in range(ROWS)], np.uint8)
TAIL = int(cj.CanaryLaunchTag.TAIL_K_FULL)


def golden_record(slot: int, token: int, position: int, mode: int) -> bytes:
    """The 32 record bytes a chain-head write of ``token`` at ``position`` into ``slot`` stores (Python ints)."""
    src = oracle.Source.of(KV, page_size=1, num_bytes_per_token=NBPT, read_bytes=NBPT)
    rkv = oracle.real_kv_hash([src], mode, slot)
    fields = (token, position, oracle.ANCHOR_HASH, rkv)
    return b"".join(oracle.u64(f).to_bytes(8, "little") for f in fields)


def golden_fold() -> int:
    """Slot 2's ALL fingerprint, folded by hand: two 8-byte words, one source (SPEC 2.5)."""
    row = bytes(KV[2])
    acc = 0
    for k in (0, 8):
        acc = oracle.splitmix64(acc ^ int.from_bytes(row[k : k + 8], "little"))
    return oracle.splitmix64(acc)


def jax_context(mode=cj.RealKvHashMode.ALL, kv=KV):
    src = cj.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=NBPT, read_bytes=NBPT)
    return cj.VerifyOrWriteContext(
        canary_buf=cj.allocate_canary_buffer(num_slots=NUM_SLOTS),
        kernel_kind=cj.CanaryLaunchTag.TAIL_K_FULL,
        log=cj.ViolationLog.allocate(ring_capacity=8),
        real_kv_sources=(src,),
        real_kv_hash_mode=mode,
    )


def torch_world(mode=2) -> World:
    w = World.make(random.Random(0), num_slots=NUM_SLOTS, ring=8, sources=((torch.uint8, 1, NBPT, NBPT, 0),), mode=mode)
    w.kv[0] = torch.from_numpy(KV.copy())
    return w


def torch_write_args(slots, tokens, positions):
    t = len(slots)
    plan = sglang.WritePlan(
        write_offsets=torch.tensor([0, t], dtype=torch.int64),
        write_seed_slot_indices=torch.tensor([-1], dtype=torch.int64),
        write_num_valid_reqs=torch.tensor([1], dtype=torch.int32),
    )
    kw = dict(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        out_cache_loc=torch.tensor(slots, dtype=torch.int64),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    return plan, kw


def torch_verify_plan(slots, positions, prevs):
    n = len(slots)
    return sglang.VerifyPlan(
        verify_slot_indices=torch.tensor(slots, dtype=torch.int64),
        verify_expected_tokens=torch.full((n,), -1, dtype=torch.int64),
        verify_expected_positions=torch.tensor(positions, dtype=torch.int64),
        verify_prev_slot_indices=torch.tensor(prevs, dtype=torch.int64),
        verify_num_valid=torch.tensor([n], dtype=torch.int32),
        enable=torch.tensor([1], dtype=torch.int32),
    )


# --- the exact call, on all four paths ----------------------------------------------------------------
def test_golden_fold_matches_the_oracle():
    src = oracle.Source.of(KV, page_size=1, num_bytes_per_token=NBPT, read_bytes=NBPT)
    assert oracle.real_kv_hash([src], 2, 2) == golden_fold() != 0


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_jax_write_of_slot_2_with_an_8_slot_source(backend):
    ctx = jax_context()
    plan = cj.WritePlan.from_requests(counts=[1], seed_slots=[-1])
    ctx = cj.write(ctx, plan, np.array([7]), np.array([0]), np.array([2]), backend=backend)
    buf = np.asarray(ctx.canary_buf)
    assert bytes(buf[2, :32]) == golden_record(2, 7, 0, 2)
    assert int.from_bytes(bytes(buf[2, 24:32]), "little") == golden_fold()
    assert not buf[np.arange(NUM_SLOTS) != 2].any()  # nothing else stamped
    assert np.asarray(ctx.log.slot_run_counters)[TAIL].tolist() == [1, 0]  # one slot stored (a uint32 pair)
    # and a verify of it: clean
    vplan = cj.VerifyPlan.from_entries(slots=[2], positions=[0], prev_slots=[-1])
    ctx = cj.verify(ctx, vplan, backend=backend)
    assert ctx.log.num_violations() == 0


@pytest.mark.parametrize("path", ["dlpack", "native"])
def test_torch_write_of_slot_2_with_an_8_slot_source(path):
    w = torch_world()
    ref = w.clone()
    plan, kw = torch_write_args([2], [7], [0])
    sglang.launch_canary_write_kernel(context=w.context(TAIL), plan=plan, backend="pallas", path=path, **kw)
    ref_write(context=ref.context(TAIL), plan=plan, **kw)  # SGLang's torch reference, re-implemented
    assert bytes(w.buf[2, :32].numpy()) == golden_record(2, 7, 0, 2)
    assert_same_bytes(w.tensors(), ref.tensors(), path)
    vplan = torch_verify_plan([2], [0], [-1])
    sglang.launch_canary_verify_kernel(
        context=w.context(TAIL), plan=vplan, check_verify_expected_token=False, backend="pallas", path=path
    )
    ref_verify(context=ref.context(TAIL), plan=vplan, check_verify_expected_token=False)
    assert_same_bytes(w.tensors(), ref.tensors(), f"{path} verify")
    assert int(w.state.violation_write_index.item()) == 0


# --- a slot past the source: refused, naming it, nothing changed --------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_jax_slot_past_the_source_is_refused(backend):
    ctx = jax_context()
    buf, log = np.asarray(ctx.canary_buf).copy(), np.asarray(ctx.log.write_index).copy()
    plan = cj.WritePlan.from_requests(counts=[3], seed_slots=[-1])
    msg = re.escape(
        "kv-canary: write hashes slot 9 (out_cache_loc[1]) but real_kv_sources[0] covers 8 slots (8 rows x page_size 1)"
    )
    with pytest.raises(ValueError, match=msg):
        cj.write(ctx, plan, np.array([7, 8, 9]), np.arange(3), np.array([2, 9, 3]), backend=backend)
    vplan = cj.VerifyPlan.from_entries(slots=[2, 0, 12], positions=[0, 1, 2], prev_slots=[-1, 2, 0])
    msg = re.escape("kv-canary: verify hashes slot 12 (plan.verify_slot_indices[2]) but real_kv_sources[0] covers 8")
    with pytest.raises(ValueError, match=msg):
        cj.verify(ctx, vplan, backend=backend)
    assert (np.asarray(ctx.canary_buf) == buf).all() and (np.asarray(ctx.log.write_index) == log).all()


def test_jax_slots_not_hashed_need_no_coverage():
    """Entries the kernels never hash: slot 0 (skipped), slots past the buffer (zero record), entries past
    num_valid, a disabled plan, a skipped write entry (-1), tokens outside the live requests, mode NONE."""
    ctx = jax_context()
    vplan = cj.VerifyPlan.from_entries(slots=[0, 99, -3], positions=[0, 0, 0], prev_slots=[-1, -1, -1])
    out = cj.verify(ctx, vplan)
    assert out.log.num_violations() == 2  # 99 and -3 read as zero records and fail, as before
    padded = cj.VerifyPlan.from_entries(slots=[2, 14], positions=[0, 0], prev_slots=[-1, -1])
    dead = dataclasses.replace(padded, verify_num_valid=jnp.array([1], jnp.int32))  # entry 1 (slot 14) is dead
    assert cj.verify(jax_context(), dead).log.num_violations() == 1  # slot 2 was never written: it fails
    off = dataclasses.replace(padded, enable=jnp.array([0], jnp.int32))
    assert cj.verify(jax_context(), off).log.num_violations() == 0
    with pytest.raises(ValueError, match="slot 14"):
        cj.verify(jax_context(), padded)
    plan = cj.WritePlan.from_requests(counts=[2], seed_slots=[-1])
    cj.write(jax_context(), plan, np.array([7, 8, 9]), np.arange(3), np.array([2, -1, 15]))  # token 2 not live
    with pytest.raises(ValueError, match="slot 15"):
        cj.write(jax_context(), plan, np.array([7, 8]), np.arange(2), np.array([2, 15]))
    cj.write(jax_context(cj.RealKvHashMode.NONE), plan, np.array([7, 8]), np.arange(2), np.array([2, 15]))


@pytest.mark.parametrize("path", ["dlpack", "native"])
def test_torch_slot_past_the_source_is_refused(path):
    w = torch_world(mode=1)
    before = {k: t.clone() for k, t in w.tensors().items()}
    plan, kw = torch_write_args([2, 11], [7, 8], [0, 1])
    with pytest.raises(ValueError, match=re.escape("write hashes slot 11 (out_cache_loc[1]) but real_kv_sources[0]")):
        sglang.launch_canary_write_kernel(context=w.context(TAIL), plan=plan, backend="pallas", path=path, **kw)
    vplan = torch_verify_plan([3, 8], [0, 1], [-1, 3])
    with pytest.raises(ValueError, match=re.escape("verify hashes slot 8 (plan.verify_slot_indices[1])")):
        sglang.launch_canary_verify_kernel(
            context=w.context(TAIL), plan=vplan, check_verify_expected_token=False, backend="pallas", path=path
        )
    assert_same_bytes(w.tensors(), before, path)


def test_torch_launch_with_a_short_source_reads_its_slots_every_launch():
    """A launch with a short hashing source reads its slots at every launch (so it is neither memoised nor replayed:
    ``test_native_memo``); with mode NONE, or sources that cover the buffer, nothing is read."""
    w = torch_world()
    src = sglang.arguments.check_sources(w.sources(), checked_type=sglang.RealKvSource)
    hashed = lambda: (np.array([0]), np.array([3]))  # noqa: E731
    assert sglang.arguments.check_coverage(src, 2, NUM_SLOTS, op="write", name="out_cache_loc", hashed=hashed)
    assert not sglang.arguments.check_coverage(src, 0, NUM_SLOTS, op="write", name="out_cache_loc", hashed=hashed)
    assert not sglang.arguments.check_coverage(src, 2, ROWS, op="write", name="out_cache_loc", hashed=hashed)


# --- inside jit: the whole-buffer rule ---------------------------------------------------------------------------
def test_inside_jit_the_whole_buffer_rule_stays():
    plan = cj.WritePlan.from_requests(counts=[1], seed_slots=[-1])

    @jax.jit
    def step(kv, buf, log):
        src = cj.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=NBPT, read_bytes=NBPT)
        ctx = cj.VerifyOrWriteContext(
            canary_buf=buf,
            kernel_kind=cj.CanaryLaunchTag.TAIL_K_FULL,
            log=log,
            real_kv_sources=(src,),
            real_kv_hash_mode=cj.RealKvHashMode.ALL,
        )
        return cj.write(ctx, plan, jnp.array([7]), jnp.array([0]), jnp.array([2])).canary_buf

    buf = cj.allocate_canary_buffer(num_slots=NUM_SLOTS)
    log = cj.ViolationLog.allocate(ring_capacity=8)
    msg = re.escape(
        "kv-canary: real_kv_sources[0] covers 8 slots (8 rows x page_size 1) but canary_buf has 16 slots; inside jit"
    )
    with pytest.raises(ValueError, match=msg):
        step(jnp.asarray(KV), buf, log)
    full = np.concatenate([KV, KV])  # 16 rows: covers the buffer, accepted inside jit with SGLang's bytes
    out = np.asarray(step(jnp.asarray(full), buf, log))
    assert bytes(out[2, :32]) == golden_record(2, 7, 0, 2)
    assert not coverage.host_checked()


# --- the step API, eagerly ---------------------------------------------------------------------------------------
def _step_world():
    config = CanaryStepConfig(verify_capacity=64, write_req_capacity=4, real_kv_hash_mode=cj.RealKvHashMode.ALL)
    group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=NUM_SLOTS, has_v_half=False)
    return config, CanaryState.create([group], ring_capacity=16)


def _step_batch(r2t, prefix, slots, tokens):
    return CanaryBatch(
        req_pool_indices=np.array([1]),
        prefix_lens=np.array([prefix]),
        extend_seq_lens=np.array([len(slots)]),
        input_ids=np.array(tokens),
        positions=np.arange(prefix, prefix + len(slots)),
        out_cache_loc=np.array(slots),
        req_to_token=r2t,
    )


def test_step_api_eager_tail_and_sweep_accept_a_short_source():
    config, state = _step_world()
    src = ((cj.RealKvSource(tensor=jnp.asarray(KV), page_size=1, num_bytes_per_token=NBPT, read_bytes=NBPT),), ())
    r2t = np.zeros((4, 16), np.int32)
    r2t[1, :4] = [2, 3, 5, 6]
    for prefix, slots, tokens in ((0, [2, 3, 5], [7, 8, 9]), (3, [6], [10])):
        batch = _step_batch(r2t, prefix, slots, tokens)
        plans = canary_plan(state, batch, config=config)
        state, plans = canary_head(state, batch, config=config, plans=plans)
        state, summary = canary_tail(state, plans, batch, config=config, real_kv_sources=(src,))
    assert int(summary.violations_total) == 0
    tail = np.asarray(state.groups[0].k_tail)
    want = oracle.real_kv_hash([oracle.Source.of(KV, page_size=1, num_bytes_per_token=NBPT, read_bytes=NBPT)], 2, 6)
    assert int.from_bytes(bytes(tail[6, 24:32]), "little") == oracle.u64(want)
    sweep = cj.VerifyPlan.from_entries(slots=[2, 3], positions=[0, 1], prev_slots=[-1, 2])
    state = canary_sweep(state, (sweep,), config=config, real_kv_sources=(src,))
    assert int(np.asarray(state.log.write_index)[0]) == 0
    # a slot past the source: refused by name, before anything runs
    batch = _step_batch(r2t, 4, [9], [11])
    r2t[1, 4] = 9
    plans = canary_plan(state, batch, config=config)
    state, plans = canary_head(state, batch, config=config, plans=plans)
    with pytest.raises(ValueError, match=re.escape("group 0 K TAIL write hashes slot 9 (out_cache_loc[0])")):
        canary_tail(state, plans, batch, config=config, real_kv_sources=(src,))
    bad = cj.VerifyPlan.from_entries(slots=[2, 12], positions=[0, 1], prev_slots=[-1, 2])
    with pytest.raises(ValueError, match=re.escape("group 0 K SWEEP verify hashes slot 12")):
        canary_sweep(state, (bad,), config=config, real_kv_sources=(src,))
