"""End-to-end tests of ``canary-jax demo``: a shortened campaign asserted through its JSON, plus the pieces
(prefix cache, scheduler invariants) it is built from."""

import json
import os

import numpy as np
import pytest

from canary_jax.demo import cli
from canary_jax.demo import engine as E
from canary_jax.demo import faults as F
from canary_jax.demo import model as M
from canary_jax.demo import workload as W
from canary_jax.demo.radix import PageAllocator, RadixCache

SHORT = ["--requests", "10", "--max-new-tokens", "8", "--trials", "1", "--no-progress"]


@pytest.fixture(scope="module")
def short_demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    paths = dict(json=str(d / "out.json"), plot=str(d / "out.png"), dump=str(d / "state.npz"))
    rc = cli.main(["demo", *SHORT, "--json", paths["json"], "--plot", paths["plot"], "--dump", paths["dump"]])
    with open(paths["json"]) as f:
        return rc, json.load(f), paths


def test_short_demo_detects_every_kind_without_false_positives(short_demo):
    rc, summary, _ = short_demo
    assert rc == 0
    assert summary["false_positives"] == 0
    assert summary["steps"] > 0
    kinds = {f["kind"]: f for f in summary["faults"]}
    assert set(kinds) == set(F.FAULT_KINDS)
    for kind, f in kinds.items():
        assert f["injected"] >= 1, kind
        assert f["detected"] == f["injected"], (kind, f)
        assert f["fail_reasons"], kind


def test_short_demo_fail_reasons_match_the_fault(short_demo):
    _, summary, _ = short_demo
    reasons = {f["kind"]: set(f["fail_reasons"]) for f in summary["faults"]}
    assert "TAIL_K_FULL:verify_real_kv_hash" in reasons["kv_flip_lo"]
    assert "TAIL_K_FULL:verify_real_kv_hash" in reasons["kv_flip_hi"]
    assert reasons["orphan_flip"] == {"SWEEP_K_FULL:verify_real_kv_hash"}
    assert "HEAD_K_FULL:write_position" in reasons["pos_shift"]
    assert "HEAD_K_FULL:write_token" in reasons["token_swap"]
    assert {"HEAD_K_FULL:verify_position", "HEAD_K_FULL:verify_chain_hash"} <= reasons["r2t_remap"]


def test_short_demo_outputs(short_demo):
    _, summary, paths = short_demo
    t = summary["timing"]
    assert t["model_ms_per_step_median"] > 0 and t["canary_ms_per_step_median"] > 0
    with open(paths["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(paths["dump"]) > 0


def test_verify_dump_of_demo_state(short_demo, capsys):
    _, _, paths = short_demo
    capsys.readouterr()
    rc = cli.main(["verify-dump", paths["dump"], "--max-messages", "1"])
    out = capsys.readouterr().out
    assert rc == 1  # the saved episode holds the injected fault's violations
    assert "kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash" in out
    assert "verify of tail_buf" in out


def test_partial_mode_misses_high_flip_as_expected(tmp_path):
    out = str(tmp_path / "p.json")
    rc = cli.main(["demo", *SHORT, "--real-kv", "partial", "--inject", "kv_flip_hi,kv_flip_lo", "--json", out])
    assert rc == 0
    with open(out) as f:
        s = json.load(f)
    by = {f["kind"]: f for f in s["faults"]}
    assert by["kv_flip_lo"]["detected"] == by["kv_flip_lo"]["injected"] == 1
    assert by["kv_flip_hi"]["injected"] == 1 and by["kv_flip_hi"]["detected"] == 0
    assert not by["kv_flip_hi"]["expected_detect"]
    assert by["kv_flip_hi"]["verdict"].startswith("expected miss")
    assert s["false_positives"] == 0


# --- pieces ----------------------------------------------------------------------------------------------
def test_radix_match_insert_split_evict():
    alloc = PageAllocator(num_pages=8, page_size=2)
    tree = RadixCache(alloc)
    a = [alloc.alloc() for _ in range(3)]
    slots_a = np.concatenate([alloc.slots_of_page(p) for p in a])
    have, node = tree.insert([1, 2, 3, 4, 5, 6], slots_a)
    assert have == 0
    # A shared first page splits the node; the new suffix is the tree's.
    b = [alloc.alloc() for _ in range(2)]
    slots_b = np.concatenate([slots_a[:2], alloc.slots_of_page(b[1])])
    have, node_b = tree.insert([1, 2, 9, 9], slots_b)
    assert have == 2
    matched, last = tree.match_prefix([1, 2, 3, 4, 7])  # page aligned: 4 tokens
    np.testing.assert_array_equal(matched, slots_a[:4])
    # Sweep walk: [1,2] -> [3,4] -> [5,6], and [1,2] -> [9,9]; positions by depth, prev = predecessor slot.
    slots, pos, prev = tree.sweep_entries()
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 2, 3]
    np.testing.assert_array_equal(slots, np.concatenate([slots_a, slots_b[2:]]))
    np.testing.assert_array_equal(prev, [-1, *slots_a[:5], slots_a[1], slots_b[2]])
    # Locked nodes survive eviction; unlocked leaves go LRU first and free their pages.
    tree.inc_lock_ref(last)
    free_before = alloc.num_free
    freed = tree.evict(10)
    assert freed == 2  # the [9, 9] and [5, 6] leaves, one page each
    assert alloc.num_free == free_before + 2
    matched, _ = tree.match_prefix([1, 2, 3, 4])
    assert len(matched) == 4
    tree.dec_lock_ref(last)
    assert tree.evict(10) == 2 and tree.total_pages() == 0


def test_engine_clean_run_pages_and_rows_come_back():
    prompts = W.load_prompts()
    reqs = W.build_requests(prompts, num_requests=6, max_new_tokens=4, seed=1)
    cfg = E.EngineConfig(num_pages=80, max_running=3)
    eng = E.Engine(cfg, M.ModelConfig(num_layers=1), reqs)
    steps = 0
    while (res := eng.step()) is not None:
        assert not res.new_violations
        steps += 1
    sched = eng.scheduler
    assert sched.done and len(sched.finished) == 6
    assert all(len(r.tokens) == len(r.prompt) + 4 for r in sched.finished)
    assert sorted(sched.free_rows) == [1, 2, 3]
    assert sched.allocator.reserved == 0
    # Every page is either free or held by the prefix cache, exactly once.
    cached = {int(s) // cfg.page_size for n in sched.tree.nodes() for s in n.value}
    free = list(sched.allocator.free_pages)
    assert len(free) == len(set(free))
    assert not cached & set(free)
    assert len(cached) + len(free) == cfg.num_pages - 1
    assert sched.stats["prefix_hit_tokens"] > 0  # shared preambles were reused


def test_config_refuses_impossible_sizes():
    cfg = E.EngineConfig(num_pages=4, page_size=4)
    with pytest.raises(E.ConfigError, match="pool too small"):
        cfg.check_workload([100], 8)
    with pytest.raises(E.ConfigError, match="max_context"):
        E.EngineConfig(max_context=64).check_workload([100], 8)
    with pytest.raises(E.ConfigError, match="max_running"):
        E.EngineConfig(max_running=10, max_tokens_per_step=8, chunk_size=8)


def test_parse_kinds():
    assert [f.kind for f in F.parse_kinds("all")] == list(F.FAULT_KINDS)
    assert F.parse_kinds("none") == []
    assert [f.kind for f in F.parse_kinds("token_swap, kv_flip_lo,token_swap")] == ["token_swap", "kv_flip_lo"]
    with pytest.raises(ValueError, match="unknown fault kind 'nope'"):
        F.parse_kinds("kv_flip_lo,nope")


def test_health_check_flags_a_canary_path_that_stops_launching():
    prompts = W.load_prompts()
    reqs = W.build_requests(prompts, num_requests=6, max_new_tokens=12, seed=2)
    eng = E.Engine(E.EngineConfig(num_pages=80, max_running=3, sweep_interval=4), M.ModelConfig(num_layers=1), reqs)
    eng.canary.sweep = lambda *a, **k: 0  # the sweep silently stops running
    for _ in range(17):
        if eng.step() is None:
            break
    assert eng.health_errors and "SWEEP_K_FULL" in eng.health_errors[0]
    assert "canary path is not executing" in eng.health_errors[0]
