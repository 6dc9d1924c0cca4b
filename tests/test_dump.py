"""The public dump API (``canary_jax.runtime.dump``) and ``canary-jax verify-dump`` on it.

A guarded toy stack (``test_integration``) runs with a KV flip; its dump is read back byte for byte, decoded by
verify-dump with SGLang's text plus the detail a debugger needs (the expected position, the stored and the
recomputed real-KV hash, checked against the Python-int oracle) and one line per repeated row. The same run in
a subprocess with ``JAX_ENABLE_X64=1`` writes a byte-identical dump.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from canary_jax.cli import main as cli
from canary_jax.cli import verify_dump
from canary_jax.contract import constants, decode
from canary_jax.contract.layout import ViolationLog
from canary_jax.runtime import dump
from canary_jax.tools import faults

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FLIP_AT, STEPS = 5, 9


def run_scenario(path: str) -> dict:
    """The toy stack for STEPS steps; before step FLIP_AT byte 0 of a slot it verifies flips. Dumps to ``path``."""
    from test_integration import KV_BYTES, PAGE, ToyServer, make_guard, new_pool, source

    server = ToyServer()
    guard = make_guard(mode="none", sweep_source=lambda: server.sweep_entries())
    pool = new_pool()
    hit = {}
    for _ in range(STEPS):
        server.admit()
        fields, plan = server.batch()
        if guard.step_index == FLIP_AT:
            row = int(fields["req_pool_indices"][0])
            pos = int(fields["prefix_lens"][0]) - 1
            slot = int(fields["req_to_token"][row, pos])
            pool = faults.flip_kv_bits(pool, slot, page_size=PAGE, num_bytes_per_token=KV_BYTES)
            hit = dict(slot=slot, row=row, position=pos, token=server.running[0].tokens[pos])
        pool, _ = guard.step(pool, **fields)
        server.finish(plan)
    guard.flush()
    guard.dump(path, real_kv_sources=source(pool))
    return dict(guard=guard, pool=pool, hit=hit, fields=fields)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    d = tmp_path_factory.mktemp("dump")
    x64_path = str(d / "x64.npz")
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), x64_path], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    path = str(d / "state.npz")
    out = run_scenario(path)
    log, _ = proc.communicate(timeout=600)
    out.update(path=path, x64_path=x64_path, x64_rc=proc.returncode, x64_log=log.decode(errors="replace"))
    return out


def test_round_trip_is_byte_identical(scenario):
    guard, pool = scenario["guard"], scenario["pool"]
    d = dump.load_dump(scenario["path"])
    names = ("ring", "write_index", "slot_run_counters", "kernel_run_counters", "enable_chain_position_assert")
    for name in (*names, "launch_ticket"):  # the ticket is zero between launches, and loads as zero
        np.testing.assert_array_equal(np.asarray(getattr(d.log, name)), np.asarray(getattr(guard.state.log, name)))
    (g,), (want,) = d.state.groups, guard.state.groups
    assert g.kind == want.kind and g.v_head is None and g.swa_index_lut is None
    np.testing.assert_array_equal(np.asarray(g.k_head), np.asarray(want.k_head))
    np.testing.assert_array_equal(np.asarray(g.k_tail), np.asarray(want.k_tail))
    ((src,), v) = d.real_kv_sources[0]
    assert v == () and (src.page_size, src.num_bytes_per_token, src.read_bytes) == (2, 32, 32)
    np.testing.assert_array_equal(src.tensor, np.asarray(pool))
    f = scenario["fields"]
    np.testing.assert_array_equal(d.req_to_token, f["req_to_token"])
    np.testing.assert_array_equal(d.req_pool_indices, f["req_pool_indices"])
    np.testing.assert_array_equal(d.seq_lens, f["prefix_lens"] + f["extend_seq_lens"])
    assert d.step == STEPS and d.real_kv_hash_mode is constants.RealKvHashMode.ALL
    assert d.log.num_violations() == guard.state.log.num_violations() >= 3
    # What was loaded is a working state: decoding it gives the guard's rows.
    assert decode.decode_violations(d.log) == guard.violations()


def test_x64_on_writes_the_same_bytes(scenario):
    assert scenario["x64_rc"] == 0, scenario["x64_log"][-3000:]
    with np.load(scenario["path"]) as a, np.load(scenario["x64_path"]) as b:
        assert sorted(a.files) == sorted(b.files)
        for k in a.files:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def hashes(pool, slot, token, position):
    """(stored, recomputed) real-KV hash of ``slot`` as signed ints, from the Python-int oracle: the bytes the
    model wrote for (token, position), and the bytes as dumped."""
    from test_integration import KV_BYTES, PAGE, kv_rows_np

    from helpers import oracle

    dumped = np.asarray(pool).copy()
    original = dumped.copy()
    original[slot // PAGE, (slot % PAGE) * KV_BYTES :][:KV_BYTES] = kv_rows_np([token], [position])[0]
    h = lambda a: oracle.s64(oracle.real_kv_hash([oracle.Source.of(a, PAGE, KV_BYTES, KV_BYTES)], oracle.ALL, slot))  # noqa: E731
    return h(original), h(dumped)


def test_verify_dump_prints_sglangs_text_then_the_detail_and_one_line_per_repeat(scenario, capsys):
    guard, hit = scenario["guard"], scenario["hit"]
    rows = guard.violations()
    assert {(r.tag, r.slot_idx, r.position, r.fail_reason_bits) for r in rows} == {
        ("TAIL_K_FULL", hit["slot"], hit["position"], int(constants.FailReason.VERIFY_REAL_KV_HASH_MISMATCH))
    }
    stored, recomputed = hashes(scenario["pool"], hit["slot"], hit["token"], hit["position"])
    assert stored != recomputed
    capsys.readouterr()
    json_path = scenario["path"] + ".json"
    rc = cli.main(["verify-dump", scenario["path"], "--json", json_path])
    out = capsys.readouterr().out
    assert rc == 1
    n = len(rows)
    sglang = decode.format_violation(rows[0], total=n, ring_overflow=False, step_when_pumped=0)
    detail = (
        f"  detail:   expected_position={hit['position']} stored_real_kv_hash={stored & (2**64 - 1):#018x} "
        f"recomputed_real_kv_hash={recomputed & (2**64 - 1):#018x} req_to_token=[({hit['row']}, {hit['position']})]"
    )
    repeat = (
        f"kv_canary violation repeated: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slot_idx={hit['slot']} "
        f"position={hit['position']} count={n} first_row=0 last_row={n - 1}"
    )
    assert f"ring: {n} violations recorded, {n} decoded (ring capacity 1024)\n" in out
    assert "\n".join([sglang, detail, repeat]) in out
    # The TAIL buffer re-verified over the live requests: the same slot, its expected position from the plan.
    assert "verify of g0_k_tail: 1 violations in " in out
    reverify = decode.format_violation(
        decode.ViolationRecord(0, 2, hit["slot"], hit["position"], hit["token"], -1, *rows[0].key[5:7], 4),
        total=1,
        ring_overflow=False,
        step_when_pumped=0,
    )
    assert reverify + "\n" + detail + "\n" in out
    assert "verify of g0_k_head: 0 violations in " in out
    with open(json_path) as f:
        rep = json.load(f)
    (ring,) = rep["rings"]
    assert ring["decoded"] == n and ring["distinct"] == 1
    assert ring["collapsed"] == [dict(row=0, count=n, first_row=0, last_row=n - 1)]
    assert ring["violations"][0]["detail"]["expected_position"] == hit["position"]
    assert ring["violations"][0]["detail"]["recomputed_real_kv_hash"] == recomputed
    assert rep["step"] == STEPS


def test_a_remapped_page_shows_the_expected_position(tmp_path, capsys):
    """A block-table remap kept in the dumped req_to_token: the re-verify names the position each failing entry
    expected (the row itself holds the stored one)."""
    from test_integration import PAGE, ToyServer, make_guard, new_pool, source

    server = ToyServer()
    guard = make_guard(mode="none")
    pool = new_pool()
    for _ in range(6):
        server.admit()
        if guard.step_index == 5:
            req, other = server.running[0], server.running[1]
            server.block_table = faults.remap_block_table(server.block_table, row=req.row, block=1, page=other.pages[0])
        fields, plan = server.batch()
        pool, _ = guard.step(pool, **fields)
        server.finish(plan)
    path = guard.dump(str(tmp_path / "remap.npz"), real_kv_sources=source(pool))
    rep = verify_dump.load_and_report(path)
    (tail,) = [b for b in rep["buffers"] if b["name"] == "g0_k_tail"]
    rows = tail["verify"]["violations"]
    pos_rows = [r for r in rows if "verify_position" in r["reasons"]]
    assert pos_rows, rows
    for r in pos_rows:  # slots of the other request's page 0 (positions 0, 1) read at positions 2, 3
        assert r["slot_idx"] // PAGE == other.pages[0] and r["position"] == r["slot_idx"] % PAGE
        assert r["detail"]["expected_position"] == r["position"] + PAGE
        assert (req.row, r["position"] + PAGE) in [tuple(m) for m in r["detail"]["mapped_at"]]


def test_load_dump_refusals(tmp_path):
    ring = np.zeros((4, 8), np.int64)
    p = tmp_path / "ring.npy"
    np.save(p, ring)
    with pytest.raises(dump.DumpError, match="is not a canary-jax dump"):
        dump.load_dump(p)
    arrays = dump.dump_arrays(ViolationLog.allocate(ring_capacity=4))
    q = tmp_path / "newer.npz"
    np.savez(q, **dict(arrays, canary_jax_dump_version=np.int64(99)))
    with pytest.raises(dump.DumpError, match="is a dump of version 99; this canary-jax reads up to 1"):
        dump.load_dump(q)
    np.savez(q, **{k: v for k, v in arrays.items() if k != "write_index"})
    with pytest.raises(dump.DumpError, match="the dump has no 'write_index'"):
        dump.load_dump(q)
    with pytest.raises(ValueError, match="pass req_to_token, req_pool_indices and seq_lens together"):
        dump.dump_arrays(ViolationLog.allocate(ring_capacity=4), req_to_token=np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="real_kv_sources has 1 entries for 0 groups"):
        dump.dump_arrays(ViolationLog.allocate(ring_capacity=4), real_kv_sources=[((), ())])
    with pytest.raises(TypeError, match="state must be a CanaryState or a ViolationLog"):
        dump.dump_arrays(ring)
    # A log-only dump round-trips too.
    log = dump.load_dump(dump.save_dump(tmp_path / "log", ViolationLog.allocate(ring_capacity=4))).log
    assert log.ring_capacity == 4 and log.num_violations() == 0


if __name__ == "__main__":  # the x64 run of the scenario (started by the fixture)
    run_scenario(sys.argv[1])
