"""Fault injection as public API (``canary_jax.tools.faults``): the pure array faults (numpy and JAX, jit-able), the
slot pickers, the campaign tracker, and every fault kind caught by the guarded toy stack of
``test_integration`` (an orphan flip only by the sweep)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_integration import KV_BYTES, PAGE, ToyServer, make_guard, new_pool

from canary_jax.contract import constants, sources
from canary_jax.contract.decode import ViolationRecord
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.tools import faults
from helpers import oracle

T = constants.CanaryLaunchTag


# --- the pure faults -----------------------------------------------------------------------------------------
def test_flip_kv_bits_addresses_the_slots_byte_numpy_and_jax_alike():
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, (6, 4 * 32), dtype=np.uint8)  # 6 pages of 4 slots x 32 bytes
    for slot, byte, xor in ((0, 0, 0xFF), (5, 17, 0x10), (23, 31, 0x01)):
        out = faults.flip_kv_bits(pool, slot, page_size=4, num_bytes_per_token=32, byte=byte, xor=xor)
        want = pool.copy()
        want[slot // 4, (slot % 4) * 32 + byte] ^= xor  # the RealKvSource addressing (SPEC 3)
        np.testing.assert_array_equal(out, want)
        jout = faults.flip_kv_bits(jnp.asarray(pool), slot, page_size=4, num_bytes_per_token=32, byte=byte, xor=xor)
        np.testing.assert_array_equal(np.asarray(jout), want)
    np.testing.assert_array_equal(pool, np.random.default_rng(0).integers(0, 256, (6, 128), dtype=np.uint8))  # pure


def test_flip_kv_bits_of_a_bf16_pool_changes_exactly_one_byte_and_the_hash():
    pool = (np.arange(8 * 32, dtype=np.float32).reshape(8, 32) / 7).astype(ml_dtypes.bfloat16)  # 64 bytes/row
    src = sources.RealKvSource(tensor=jnp.asarray(pool), page_size=2, num_bytes_per_token=32, read_bytes=32)
    out = faults.flip_kv_bits(src, 5, byte=3)  # slot 5: row 2, bytes 32.. of the row
    assert out.dtype == jnp.bfloat16 and out.shape == (8, 32)
    before = np.ascontiguousarray(pool).view(np.uint8)
    after = np.asarray(out).view(np.uint8)
    diff = np.argwhere(before != after)
    assert diff.tolist() == [[2, 32 + 3]] and after[2, 35] == before[2, 35] ^ 0xFF
    h = lambda a, slot: oracle.real_kv_hash([oracle.Source.of(a, 2, 32, 32)], oracle.ALL, slot)  # noqa: E731
    assert h(before, 5) != h(after, 5) and h(before, 4) == h(after, 4)  # the slot's fingerprint only


def test_flip_kv_bits_of_a_chunked_source_hits_the_hashed_sequence():
    """A chunked source hashes chunk c of a slot ``offset + c * stride`` bytes after the slot's first byte."""
    u8 = np.arange(8 * 32, dtype=np.int64).astype(np.uint8).reshape(8, 32)  # 8 rows of 32 bytes, 2 slots per row
    ch = sources.SlotChunks(chunk_bytes=4, num_chunks=2, chunk_stride_bytes=64, offset_bytes=0)
    src = sources.RealKvSource(tensor=u8, page_size=2, num_bytes_per_token=16, read_bytes=16, chunks=ch)
    for arr in (u8, jnp.asarray(u8)):
        out = np.asarray(faults.flip_kv_bits(dataclasses_replace(src, arr), 3, byte=5, xor=0x20))
        # slot 3: row 1, byte 16 of the row = flat byte 48; byte 5 is chunk 1 (+64 bytes), byte 1 in it: flat 113
        assert np.argwhere(out != u8).tolist() == [[113 // 32, 113 % 32]] and out[3, 17] == u8[3, 17] ^ 0x20
    descs = sources.check_real_kv_sources((src,), constants.RealKvHashMode.ALL)
    flipped = faults.flip_kv_bits(src, 3, byte=5)

    def h(t, slot):
        u = sources.real_kv_hash_reference([jnp.asarray(t)], descs, jnp.asarray([slot], jnp.int32))
        return int(u.lo[0]), int(u.hi[0])

    assert h(u8, 3) != h(flipped, 3) and h(u8, 2) == h(flipped, 2)
    with pytest.raises(ValueError, match=r"kv-canary: byte must be in \[0, 8\), got 8"):
        faults.flip_kv_bits(src, 3, byte=8)


def dataclasses_replace(src, tensor):
    return sources.RealKvSource(
        tensor=tensor,
        page_size=src.page_size,
        num_bytes_per_token=src.num_bytes_per_token,
        read_bytes=src.read_bytes,
        chunks=src.chunks,
    )


def test_flip_kv_bits_is_jittable_and_drops_a_traced_out_of_range_slot():
    pool = jnp.arange(4 * 16, dtype=jnp.uint8).reshape(4, 16)
    f = jax.jit(lambda p, s, b: faults.flip_kv_bits(p, s, byte=b, xor=0x80))
    out = np.asarray(f(pool, jnp.int32(2), jnp.int32(1)))
    want = np.asarray(pool).copy()
    want[2, 1] ^= 0x80
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(np.asarray(f(pool, jnp.int32(9), jnp.int32(0))), np.asarray(pool))  # dropped


def test_flip_kv_bits_refusals_name_the_argument():
    pool = np.zeros((4, 32), np.uint8)
    with pytest.raises(ValueError, match=r"kv-canary: slot must be in \[0, 4\), got 4"):
        faults.flip_kv_bits(pool, 4)
    with pytest.raises(ValueError, match=r"kv-canary: byte must be in \[0, 16\), got 16"):
        faults.flip_kv_bits(pool, 1, page_size=2, byte=16)
    with pytest.raises(ValueError, match=r"kv-canary: xor must be in \[1, 255\], got 256"):
        faults.flip_kv_bits(pool, 1, xor=256)
    with pytest.raises(ValueError, match="tensor must be at least 2-D"):
        faults.flip_kv_bits(np.zeros(8, np.uint8), 1)
    with pytest.raises(TypeError, match="slot must be an int, got float"):
        faults.flip_kv_bits(pool, 1.0)
    with pytest.raises(ValueError, match=r"num_bytes_per_token must be in \[1, row_bytes / page_size = 16\], got 32"):
        faults.flip_kv_bits(pool, 1, page_size=2, num_bytes_per_token=32)


def test_flip_canary_bits_flips_one_bit_of_one_field():
    buf = np.zeros((8, 32), np.uint8)
    oracle.write_record(buf, 3, [101, 7, -5, 2**40])
    for field, bit in ((0, 0), (1, 9), (2, 63), (3, 40)):
        for arr in (buf, jnp.asarray(buf)):
            out = np.asarray(faults.flip_canary_bits(arr, 3, field=field, bit=bit))
            got = oracle.read_record(out, 3)
            want = list(oracle.read_record(buf, 3))
            want[field] = oracle.s64(oracle.u64(want[field]) ^ (1 << bit))
            assert got == tuple(want), (field, bit)
            np.testing.assert_array_equal(out[np.arange(8) != 3], buf[np.arange(8) != 3])
    with pytest.raises(ValueError, match=r"kv-canary: field must be in \[0, 4\), got 4"):
        faults.flip_canary_bits(buf, 3, field=4, bit=0)
    with pytest.raises(ValueError, match=r"kv-canary: bit must be in \[0, 64\), got 64"):
        faults.flip_canary_bits(buf, 3, field=0, bit=64)


def test_metadata_faults_are_pure_and_exact():
    r2t = np.arange(12, dtype=np.int32).reshape(3, 4)
    for table in (r2t, jnp.asarray(r2t)):
        out = np.asarray(faults.remap_req_to_token(table, row=1, position=2, slot=99))
        want = r2t.copy()
        want[1, 2] = 99
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(
            np.asarray(faults.remap_block_table(table, row=2, block=0, page=7))[2], [7, 9, 10, 11]
        )
    np.testing.assert_array_equal(r2t, np.arange(12).reshape(3, 4))  # inputs untouched
    ids = np.array([5, 6, 7, 8])
    for arr in (ids, jnp.asarray(ids)):
        np.testing.assert_array_equal(np.asarray(faults.swap_token(arr, index=1, token=42)), [5, 42, 7, 8])
        np.testing.assert_array_equal(np.asarray(faults.swap_tokens(arr, 0, 3)), [8, 6, 7, 5])
        np.testing.assert_array_equal(np.asarray(faults.shift_position(arr, index=2)), [5, 6, 8, 8])
    jitted = jax.jit(lambda a, i: faults.swap_tokens(a, i, 0))
    np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(ids), 2)), [7, 6, 5, 8])
    with pytest.raises(ValueError, match=r"kv-canary: position must be in \[0, 4\), got 4"):
        faults.remap_req_to_token(r2t, row=0, position=4, slot=1)
    with pytest.raises(ValueError, match="kv-canary: input_ids must be 1-D"):
        faults.swap_token(r2t, index=0, token=1)
    with pytest.raises(TypeError, match="kv-canary: block_table must be an integer array"):
        faults.remap_block_table(np.zeros((2, 2), np.float32), row=0, block=0, page=1)


def test_slot_pickers():
    rng = np.random.default_rng(3)
    r2t = np.zeros((4, 8), np.int32)
    r2t[1, :5] = [11, 12, 13, 14, 15]
    r2t[2, :3] = [11, 12, 30]
    picks = {
        faults.pick_used_slot(rng, req_to_token=r2t, req_pool_indices=[1, 2, 0], prefix_lens=[4, 2, 9])
        for _ in range(60)
    }
    assert picks == {(11, 1, 0), (12, 1, 1), (13, 1, 2), (14, 1, 3), (11, 2, 0), (12, 2, 1)}
    assert faults.pick_used_slot(rng, req_to_token=r2t, req_pool_indices=[1], prefix_lens=[0]) is None
    written = {faults.pick_written_slot(rng, out_cache_loc=[0, 40, 41, 0], num_tokens=3) for _ in range(30)}
    assert written == {40, 41}
    orphans = {
        faults.pick_orphan_slot(
            rng, cached_slots=[11, 12, 13, 50, 51, 0], req_to_token=r2t, req_pool_indices=[2], seq_lens=[3]
        )
        for _ in range(40)
    }
    assert orphans == {13, 50, 51}
    assert faults.pick_orphan_slot(rng, cached_slots=[11], req_to_token=r2t, req_pool_indices=[1], seq_lens=[5]) is None


# --- the campaign tracker ------------------------------------------------------------------------------------
def rec(tag, bits, slot=3):
    return ViolationRecord(0, int(tag), slot, 1, 2, -1, 0, 0, int(bits))


def test_campaign_attributes_by_recorded_step():
    c = faults.FaultCampaign()
    c.observe([rec(T.TAIL_K_FULL, 4)], step=0)  # no episode: a false positive
    with c.episode("kv_flip_used") as ep:
        c.observe([rec(T.HEAD_K_FULL, 2)], step=1)  # before the injection: false positive
        c.injected(step=3, slot=9)
        c.observe([rec(T.TAIL_K_FULL, 4)], step=2)  # recorded before step 3 (reported late): false positive
        c.observe([rec(T.TAIL_K_FULL, 4), rec(T.TAIL_K_FULL, 5)], step=5)
        c.observe([rec(T.TAIL_K_FULL, 4)], step=6)
    assert (ep.detected, ep.detect_step, ep.steps_to_detect, ep.violations, ep.false_positives) == (True, 5, 2, 3, 2)
    assert ep.reasons == {"TAIL_K_FULL:verify_real_kv_hash": 3, "TAIL_K_FULL:verify_chain_hash": 1}
    assert ep.details == {"slot": 9} and ep.first_violation.fail_reason_bits == 4
    with c.episode("kv_flip_used"):
        c.injected(step=0)
    with c.episode("token_swap"):
        c.injected(step=4)
        c.observe([rec(T.HEAD_K_FULL, 8)], step=4)
    rep = c.report()
    assert [(k.kind, k.trials, k.injected, k.detected, k.steps_to_detect) for k in rep.kinds] == [
        ("kv_flip_used", 2, 2, 1, (2,)),
        ("token_swap", 1, 1, 1, (0,)),
    ]
    assert rep.false_positives == 3 and not rep.ok
    assert rep.false_positive_reasons == {"HEAD_K_FULL:verify_position": 1, "TAIL_K_FULL:verify_real_kv_hash": 2}
    assert rep.lines() == [
        "fault kind    injected  detected  steps to detect  fail reasons",
        "kv_flip_used  2         1         2                "
        "TAIL_K_FULL:verify_chain_hash TAIL_K_FULL:verify_real_kv_hash",
        "token_swap    1         1         0                HEAD_K_FULL:write_token",
        "false positives: 3",
    ]
    with pytest.raises(RuntimeError, match="injected\\(\\) outside an episode"):
        c.injected(step=1)
    c.begin("x")
    with pytest.raises(RuntimeError, match="episode 'x' is still open"):
        c.begin("y")


# --- every kind caught by the guarded toy stack -------------------------------------------------------------
LAST_ARRIVAL = max(ToyServer.ARRIVALS)


def with_oracle(fields):
    """The scheduler's truth as the token oracle (write input assert): what the batch meant to feed."""
    fields = dict(fields)
    fields["expected_inputs"] = ExpectedInputs(tokens=fields["input_ids"].copy(), positions=fields["positions"].copy())
    return fields


class Recording(ToyServer):
    """The toy server, remembering the previous step's batch (for the post-TAIL flip)."""

    prev_fields = None

    def batch(self):
        self.prev_fields = self.last
        return super().batch()


def run_episode(campaign, kind, inject, *, at, steps, sweep=True):
    """A fresh toy stack and guard; ``inject(server, guard, pool, fields, rng) -> (pool, fields, details)`` runs
    before step ``at``. The guard reports nothing itself (mode none): the campaign gets the rows, one step late."""
    server = Recording()
    rng = np.random.default_rng([7, at])
    guard = make_guard(
        mode="none",
        enable_write_input_assert=True,
        sweep_source=(lambda: server.sweep_entries()) if sweep else (lambda: None),
        on_violations=campaign.observe,
    )
    pool = new_pool()
    with campaign.episode(kind) as ep:
        for _ in range(steps):
            server.admit()
            fields, plan = server.batch()
            fields = with_oracle(fields)
            if guard.step_index == at:
                pool, fields, details = inject(server, guard, pool, fields, rng)
                campaign.injected(step=at, **details)
            pool, _ = guard.step(pool, **fields)
            server.finish(plan)
        guard.flush()
    return ep, guard


def flip(pool, slot):
    return faults.flip_kv_bits(pool, slot, page_size=PAGE, num_bytes_per_token=KV_BYTES)


def inject_used(server, guard, pool, fields, rng):
    slot, row, pos = faults.pick_used_slot(
        rng,
        req_to_token=fields["req_to_token"],
        req_pool_indices=fields["req_pool_indices"],
        prefix_lens=fields["prefix_lens"],
    )
    return flip(pool, slot), fields, dict(slot=slot, row=row, position=pos)


def inject_post_tail(server, guard, pool, fields, rng):
    # a slot the previous step wrote, flipped after its TAIL; request 0 (row 1) reads it again this step
    prev = server.prev_fields
    slot = faults.pick_written_slot(rng, out_cache_loc=prev["out_cache_loc"][: int(prev["extend_seq_lens"][0])])
    return flip(pool, slot), fields, dict(slot=slot)


def inject_orphan(server, guard, pool, fields, rng):
    slot = faults.pick_orphan_slot(
        rng,
        cached_slots=server.cached_slots(),
        req_to_token=fields["req_to_token"],
        req_pool_indices=fields["req_pool_indices"],
        seq_lens=fields["prefix_lens"] + fields["extend_seq_lens"],
    )
    return flip(pool, slot), fields, dict(slot=slot)


def inject_r2t(server, guard, pool, fields, rng):
    slot, row, pos = faults.pick_used_slot(
        rng,
        req_to_token=fields["req_to_token"],
        req_pool_indices=fields["req_pool_indices"],
        prefix_lens=fields["prefix_lens"],
    )
    others = sorted(server.live_slots() - {slot, 0})
    new = others[int(rng.integers(len(others)))]
    fields["req_to_token"] = faults.remap_req_to_token(fields["req_to_token"], row=row, position=pos, slot=new)
    return pool, fields, dict(row=row, position=pos, old_slot=slot, new_slot=new)


def inject_block_table(server, guard, pool, fields, rng):
    req = server.running[0]
    other = server.running[1].pages[-1]  # a page of another request
    server.block_table = faults.remap_block_table(server.block_table, row=req.row, block=1, page=other)
    fields["req_to_token"] = server.req_to_token  # the batch reads the table as it now is
    return pool, fields, dict(row=req.row, block=1, page=other)


def inject_token_swap(server, guard, pool, fields, rng):
    t = int(rng.integers(len(fields["input_ids"])))
    fields["input_ids"] = faults.swap_token(fields["input_ids"], index=t, token=int(fields["input_ids"][t]) + 500)
    return pool, fields, dict(index=t)


def inject_pos_shift(server, guard, pool, fields, rng):
    t = int(np.cumsum(fields["extend_seq_lens"])[0]) - 1  # request 0's last token this step
    fields["positions"] = faults.shift_position(fields["positions"], index=t)
    return pool, fields, dict(index=t)


@pytest.fixture(scope="module")
def campaign():
    c = faults.FaultCampaign()
    cases = [
        (faults.KV_FLIP_USED, inject_used, 5, 8),
        (faults.KV_FLIP_POST_TAIL, inject_post_tail, 5, 8),
        (faults.KV_FLIP_ORPHAN, inject_orphan, LAST_ARRIVAL + 1, LAST_ARRIVAL + 6),
        (faults.REQ_TO_TOKEN_REMAP, inject_r2t, 5, 7),
        (faults.BLOCK_TABLE_REMAP, inject_block_table, 4, 7),
        (faults.TOKEN_SWAP, inject_token_swap, 5, 7),
        (faults.POSITION_SHIFT, inject_pos_shift, 5, 7),
    ]
    eps = {kind: run_episode(c, kind, inject, at=at, steps=steps) for kind, inject, at, steps in cases}
    # the negative control: the same orphan flip without a sweep is never seen
    eps["orphan_no_sweep"] = run_episode(
        c, "kv_flip_orphan_no_sweep", inject_orphan, at=LAST_ARRIVAL + 1, steps=LAST_ARRIVAL + 9, sweep=False
    )
    return c, eps


def test_every_kind_is_caught_on_the_toy_stack(campaign):
    c, eps = campaign
    rep = c.report()
    assert rep.false_positives == 0, rep.false_positive_reasons
    by = {k.kind: k for k in rep.kinds}
    for kind in (
        faults.KV_FLIP_USED,
        faults.REQ_TO_TOKEN_REMAP,
        faults.BLOCK_TABLE_REMAP,
        faults.TOKEN_SWAP,
        faults.POSITION_SHIFT,
    ):
        assert (by[kind].injected, by[kind].detected, by[kind].steps_to_detect) == (1, 1, (0,)), kind
    assert by[faults.KV_FLIP_POST_TAIL].detected == 1 and by[faults.KV_FLIP_POST_TAIL].steps_to_detect == (0,)
    assert by["kv_flip_orphan_no_sweep"].injected == 1 and by["kv_flip_orphan_no_sweep"].detected == 0
    assert rep.lines()[-1] == "false positives: 0" and len(rep.lines()) == len(rep.kinds) + 2


def test_what_catches_each_kind(campaign):
    _, eps = campaign
    reasons = {kind: set(ep.reasons) for kind, (ep, _) in eps.items()}
    assert reasons[faults.KV_FLIP_USED] == {"TAIL_K_FULL:verify_real_kv_hash"}
    assert reasons[faults.KV_FLIP_POST_TAIL] == {"TAIL_K_FULL:verify_real_kv_hash"}
    assert {"HEAD_K_FULL:verify_position", "HEAD_K_FULL:verify_chain_hash"} <= reasons[faults.REQ_TO_TOKEN_REMAP]
    assert {"HEAD_K_FULL:verify_position", "HEAD_K_FULL:verify_chain_hash"} <= reasons[faults.BLOCK_TABLE_REMAP]
    assert reasons[faults.TOKEN_SWAP] == {"HEAD_K_FULL:write_token", "TAIL_K_FULL:write_token"}
    assert {"HEAD_K_FULL:write_position", "TAIL_K_FULL:write_position"} <= reasons[faults.POSITION_SHIFT]
    # The used / post-TAIL flips report exactly the flipped slot.
    for kind in (faults.KV_FLIP_USED, faults.KV_FLIP_POST_TAIL):
        ep, _ = eps[kind]
        assert ep.first_violation.slot_idx == ep.details["slot"] and ep.first_violation.tag == "TAIL_K_FULL"


def test_an_orphan_flip_is_caught_only_by_the_sweep(campaign):
    _, eps = campaign
    ep, guard = eps[faults.KV_FLIP_ORPHAN]
    assert ep.detected and set(ep.reasons) == {"SWEEP_K_FULL:verify_real_kv_hash"}
    rows = guard.violations()
    assert {(r.tag, r.slot_idx) for r in rows} == {("SWEEP_K_FULL", ep.details["slot"])}
    # detected at the first sweep step at or after the injection (sweeps run at steps 0, 4, 8, ...)
    assert ep.detect_step == -(-ep.inject_step // 4) * 4 and ep.detect_step > ep.inject_step
    ep, guard = eps["orphan_no_sweep"]
    assert guard.violations() == [] and guard.state.log.kernel_run_counter(T.SWEEP_K_FULL) == 0
    assert guard.step_index - ep.inject_step >= 8  # two sweep periods passed: only a sweep could have seen it
