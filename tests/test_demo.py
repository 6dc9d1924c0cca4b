"""End-to-end tests of ``canary-jax demo``: a shortened campaign asserted through its JSON, plus the pieces
(prefix cache, scheduler invariants) it is built from."""

import copy
import io
import json
import os
import re
import sys

import numpy as np
import pytest

from canary_jax.cli import main as cli
from canary_jax.cli import render
from canary_jax.cli.demo import campaign, engine, model, workload
from canary_jax.cli.demo.faults import ALL_FAULTS, FAULT_KINDS, FAULTS_BY_KIND, parse_kinds
from canary_jax.cli.demo.radix import PageAllocator, RadixCache

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
    assert set(kinds) == set(FAULT_KINDS)
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
    # One program per forward: the canary's share is the served step (canary on) minus the same step without it.
    assert t["method"] == "one_program"
    assert t["step_ms_per_step_median"] > t["canary_ms_per_step_median"]
    assert t["canary_ms_per_step_mean"] == pytest.approx(
        t["step_ms_per_step_mean"] - t["model_ms_per_step_mean"], abs=2e-3
    )
    assert [p["part"] for p in t["parts"]] == [
        "served step, canary on (plan+HEAD+model+TAIL, 1 program)",
        "same step, canary off (the model alone)",
        "canary's share: on - off, per step",
    ]
    assert [p["median_ms"] for p in t["parts"]] == [
        t["step_ms_per_step_median"],
        t["model_ms_per_step_median"],
        t["canary_ms_per_step_median"],
    ]
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
    # A re-verified buffer reports the entries it checked, not a "ring capacity".
    line = next(x for x in out.splitlines() if x.startswith("verify of g0_k_tail:"))
    m = re.fullmatch(
        r"verify of g0_k_tail: (\d+) violations in (\d+) verified entries \(the live requests' slots\), "
        r"(\d+) decoded",
        line,
    )
    assert m and int(m.group(1)) >= 1 and int(m.group(2)) > int(m.group(1)), line
    # The saved episode (kv_flip_lo) names the flipped slot's expected position and both real-KV hashes.
    detail = next(x for x in out.splitlines() if x.startswith("  detail:   expected_position="))
    assert re.fullmatch(
        r"  detail:   expected_position=\d+ stored_real_kv_hash=0x[0-9a-f]{16} recomputed_real_kv_hash=0x[0-9a-f]{16}"
        r" req_to_token=\[.*\]",
        detail,
    ), detail
    stored, recomputed = re.findall(r"real_kv_hash=(0x[0-9a-f]{16})", detail)
    assert stored != recomputed


def test_report_fits_120_columns_with_footnote(short_demo):
    _, summary, _ = short_demo
    buf = io.StringIO()
    render.render_text(summary, out=buf)
    text = buf.getvalue()
    assert max(len(x) for x in text.splitlines()) <= 120
    assert "0 = caught in the same step" in text
    assert "steps to" in text and "detect*" in text
    # A failing run's long verdicts wrap too.
    bad = copy.deepcopy(summary)
    for f in bad["faults"]:
        f.update(
            ok=False,
            status="not_injected",
            verdict="NOT INJECTED in 3 of 3 trials (the workload ended before "
            "the fault could act; serve more --requests)",
        )
    bad["ok"] = False
    buf = io.StringIO()
    render.render_text(bad, out=buf)
    lines = buf.getvalue().splitlines()
    assert max(len(x) for x in lines) <= 120
    assert lines[-1].startswith("  ") and any(x.startswith("FAIL: kv_flip_lo NOT INJECTED") for x in lines)


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


def test_small_workload_16_byte_rows_all_kinds(tmp_path, capsys):
    """head_dim 4 leaves no byte beyond 16 for kv_flip_hi: under --inject all it is not applicable (no episodes,
    not a failure). 4 requests x 3 tokens run 10 steps, fewer than the default injection step 6 + [0, 8): the
    injection steps shrink to fit and every other kind is still injected and caught. A --plot that cannot be
    written fails with one line and exit 2 after the report, the JSON still written."""
    out = str(tmp_path / "s.json")
    plot = None
    if os.path.exists("/dev/full"):  # a .png name for a device that is always full
        plot = str(tmp_path / "full.png")
        os.symlink("/dev/full", plot)
    capsys.readouterr()
    rc = cli.main(
        [
            "demo",
            "--requests",
            "4",
            "--max-new-tokens",
            "3",
            "--trials",
            "1",
            "--layers",
            "1",
            "--head-dim",
            "4",
            "--no-progress",
            "--json",
            out,
        ]
        + (["--plot", plot] if plot else [])
    )
    cap = capsys.readouterr()
    with open(out) as f:
        s = json.load(f)
    assert s["ok"] and s["false_positives"] == 0
    by = {f["kind"]: f for f in s["faults"]}
    hi = by.pop("kv_flip_hi")
    assert hi["status"] == "not_applicable" and hi["ok"] and hi["trials"] == 0 and hi["episodes"] == []
    assert hi["verdict"].startswith("n/a: a slot's K row has only 16 bytes")
    assert not hi["expected_detect"]
    for kind, f in by.items():
        assert f["injected"] == f["detected"] == 1, (kind, f["verdict"])
        assert f["episodes"][0]["inject_step"] < 10, kind
    assert "- kv_flip_hi: not applicable: a slot's K row has only 16 bytes" in cap.out
    assert max(len(x) for x in cap.out.splitlines()) <= 120
    if plot:
        assert rc == 2
        assert cap.err == f"canary-jax: error: --plot {plot!r}: cannot write: No space left on device\n"
    else:
        assert rc == 0


def test_injection_steps_fit_the_workload():
    small = campaign.CampaignConfig(
        engine=engine.EngineConfig(), model=model.ModelConfig(num_layers=1), num_requests=4, max_new_tokens=3, trials=1
    )
    trace = campaign.dry_run(small, list(ALL_FAULTS))
    assert trace.num_steps == 10
    assert trace.sweep_steps == (3, 7)
    assert trace.ready["orphan_flip"] and min(trace.ready["orphan_flip"]) > 0  # needs a finished request first
    camp = campaign.Campaign(small, list(ALL_FAULTS))
    for f in ALL_FAULTS:
        latest = camp.latest_inject[f.kind]
        assert latest in trace.ready[f.kind] and f.detectable_after(trace, latest), f.kind
        for trial in range(3):
            assert camp.inject_step(f, np.random.default_rng([0, trial, 1])) <= latest
    assert camp.latest_inject["orphan_flip"] <= 7  # a sweep (after step 7) must still come
    # The default workload keeps the documented 6 + [0, 8) injection steps.
    default = campaign.CampaignConfig(engine=engine.EngineConfig(num_pages=256), model=model.ModelConfig(num_layers=1))
    camp = campaign.Campaign(default, list(ALL_FAULTS))
    assert camp.trace.num_steps == 64
    for f in ALL_FAULTS:
        rng_a, rng_b = np.random.default_rng([0, 1, 2]), np.random.default_rng([0, 1, 2])
        assert camp.inject_step(f, rng_a) == 6 + int(rng_b.integers(0, 8)), f.kind
    # A workload that never offers a kind its preconditions is refused up front.
    with pytest.raises(
        engine.ConfigError, match="too short for orphan_flip: in its 12 forward steps orphan_flip never"
    ):
        campaign.Campaign(
            campaign.CampaignConfig(
                engine=engine.EngineConfig(),
                model=model.ModelConfig(num_layers=1),
                num_requests=2,
                max_new_tokens=8,
                trials=1,
            ),
            [FAULTS_BY_KIND["orphan_flip"]],
        )
    with pytest.raises(engine.ConfigError, match=r"seed must be an integer in \[0, 4294967295\]"):
        campaign.CampaignConfig(engine=engine.EngineConfig(), model=model.ModelConfig(), seed=2**32)


def _fault(kind, trials, inj, det, lat, status, exp=True):
    return dict(
        kind=kind,
        trials=trials,
        injected=inj,
        detected=det,
        steps_to_detect=lat,
        mean_steps_to_detect=round(sum(lat) / len(lat), 2) if lat else None,
        max_steps_to_detect=max(lat) if lat else None,
        status=status,
        expected_detect=exp,
        ok=status != "missed",
    )


def test_plot_is_honest():
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    faults = [
        _fault("r2t_remap", 3, 3, 2, [0, 1], "missed"),
        _fault("kv_flip_lo", 3, 3, 3, [0, 0, 0], "ok"),
        _fault("kv_flip_hi", 0, 0, 0, [], "not_applicable", False),
        _fault("page_reuse", 3, 3, 3, [1, 1, 2], "ok"),
        _fault("pos_shift", 3, 2, 2, [0, 0], "not_injected"),
        _fault("token_swap", 3, 3, 0, [], "expected_miss", False),
        _fault("orphan_flip", 3, 3, 0, [], "missed"),
    ]
    fig = render.plot_figure(dict(faults=faults, canary=dict(real_kv_hash_mode="ALL"), false_positives=0))
    ax1, ax2 = fig.axes
    leg = ax1.get_legend()
    labels = [t.get_text() for t in leg.get_texts()]
    assert labels == [
        "injected",
        "detected",
        "missed (should be caught)",
        "expected miss",
        "not injected",
        "not applicable",
    ]
    # The legend's colours are fixed, not the first bar's (the first kind here was missed).
    assert leg.legend_handles[1].get_facecolor() == to_rgba(render.C_DETECTED)
    assert leg.legend_handles[2].get_hatch() == "xx"
    assert ax1.get_ylim()[0] == 0
    # Latency: bars only for detected kinds; same-step detections get a diamond at 0; the others a labelled
    # hatched placeholder, never a bar of height 0.
    solid = [p for p in ax2.patches if not p.get_hatch()]
    assert sorted(round(p.get_height(), 2) for p in solid) == [0.0, 0.0, 0.5, 1.33]
    diamonds = [ln for ln in ax2.lines if ln.get_marker() == "D"]
    assert sorted(ln.get_xdata()[0] for ln in diamonds) == [1, 4]
    assert all(ln.get_ydata()[0] == 0 for ln in diamonds)
    texts = {t.get_text() for t in ax2.texts}
    assert {"MISSED", "expected miss", "n/a", "same step"} <= texts and "not injected" not in texts
    assert len([p for p in ax2.patches if p.get_hatch() == "//"]) == 3  # kv_flip_hi, token_swap, orphan_flip
    assert ax2.get_ylim()[0] == 0 and ax2.get_ylim()[1] > 2
    plt.close(fig)
    # Nothing detected: no bars of height 0 and no negative axis.
    fig = render.plot_figure(
        dict(
            faults=[_fault("kv_flip_lo", 1, 1, 0, [], "missed")],
            canary=dict(real_kv_hash_mode="ALL"),
            false_positives=2,
        )
    )
    ax1, ax2 = fig.axes
    assert ax2.get_ylim()[0] == 0 and ax2.get_ylim()[1] >= 1
    assert ax2.get_title() == "detection latency: no fault kind was detected"
    assert [t.get_text() for t in ax1.get_legend().get_texts()] == ["injected", "detected", "missed (should be caught)"]
    plt.close(fig)


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
    prompts = workload.load_prompts()
    reqs = workload.build_requests(prompts, num_requests=6, max_new_tokens=4, seed=1)
    cfg = engine.EngineConfig(num_pages=80, max_running=3)
    eng = engine.Engine(cfg, model.ModelConfig(num_layers=1), reqs)
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


def test_engine_forward_is_one_donating_program(monkeypatch):
    """Each forward is one jitted program (plan, HEAD, the model, TAIL) that donates the pools and the canary
    buffers; with ``timed`` the same program without the canary runs first. The run compiles each once."""
    from canary_jax.cli.demo import canary_ops

    reqs = workload.build_requests(workload.load_prompts(), num_requests=3, max_new_tokens=3, seed=1)
    eng = engine.Engine(engine.EngineConfig(num_pages=80, max_running=3), model.ModelConfig(num_layers=1), reqs)

    def separate_launch(*a, **k):
        raise AssertionError("the forward ran the model as its own program")

    monkeypatch.setattr(model, "forward", separate_launch)
    compiled = canary_ops.served_step._cache_size()
    k_pool, k_tail = eng.k_pool, eng.canary.state.groups[0].k_tail
    res = eng.step(timed=True)
    assert k_pool.is_deleted() and k_tail.is_deleted()  # donated: updated in place, no copy
    assert res.step_s > 0 and res.model_s > 0 and res.canary_s == res.step_s - res.model_s
    steps = 1
    while (res := eng.step(timed=steps % 2 == 0)) is not None:
        assert not res.new_violations
        assert (res.model_s is None) == (steps % 2 == 1)
        steps += 1
    assert steps > 4 and eng.scheduler.done
    assert canary_ops.served_step._cache_size() - compiled <= 2  # canary on and off, one shape each


def test_config_refuses_impossible_sizes():
    cfg = engine.EngineConfig(num_pages=4, page_size=4)
    with pytest.raises(engine.ConfigError, match="pool too small"):
        cfg.check_workload([100], 8)
    with pytest.raises(engine.ConfigError, match="max_context"):
        engine.EngineConfig(max_context=64).check_workload([100], 8)
    with pytest.raises(engine.ConfigError, match="max_running"):
        engine.EngineConfig(max_running=10, max_tokens_per_step=8, chunk_size=8)


def test_parse_kinds():
    assert [f.kind for f in parse_kinds("all")] == list(FAULT_KINDS)
    assert parse_kinds("none") == []
    assert [f.kind for f in parse_kinds("token_swap, kv_flip_lo,token_swap")] == ["token_swap", "kv_flip_lo"]
    with pytest.raises(ValueError, match="unknown fault kind 'nope'"):
        parse_kinds("kv_flip_lo,nope")
    for empty in ("", "  ", ",", " , ,"):
        with pytest.raises(ValueError, match="--inject is empty"):
            parse_kinds(empty)


def test_kv_flip_hi_applicability():
    hi = FAULTS_BY_KIND["kv_flip_hi"]
    assert "only 16 bytes" in hi.not_applicable(model.ModelConfig(head_dim=4, num_kv_heads=2))
    assert hi.not_applicable(model.ModelConfig(head_dim=8, num_kv_heads=2)) == ""
    assert FAULTS_BY_KIND["kv_flip_lo"].not_applicable(model.ModelConfig(head_dim=4, num_kv_heads=2)) == ""


def test_health_check_flags_a_canary_path_that_stops_launching():
    prompts = workload.load_prompts()
    reqs = workload.build_requests(prompts, num_requests=6, max_new_tokens=12, seed=2)
    eng = engine.Engine(
        engine.EngineConfig(num_pages=80, max_running=3, sweep_interval=4), model.ModelConfig(num_layers=1), reqs
    )
    eng.canary.sweep = lambda *a, **k: 0  # the sweep silently stops running
    for _ in range(17):
        if eng.step() is None:
            break
    assert eng.health_errors and "SWEEP_K_FULL" in eng.health_errors[0]
    assert "canary path is not executing" in eng.health_errors[0]


def test_demo_without_tqdm_runs_with_one_hint_line(capsys, monkeypatch):
    """tqdm comes with the ``demo`` extra: without it the demo still runs, with no bar and one line on stderr."""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    capsys.readouterr()
    rc = cli.main(
        ["demo", "--requests", "4", "--max-new-tokens", "3", "--layers", "1", "--head-dim", "4", "--inject", "none"]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.out
    assert cap.err == (
        "canary-jax: no progress bar: tqdm is not installed (pip install 'canary-jax[demo]' gives one)\n"
    )
    assert "false positives (clean phase + before injections): 0" in cap.out
