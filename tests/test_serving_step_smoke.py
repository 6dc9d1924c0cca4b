"""Smoke test of ``benchmarks.serving_step`` (issue #17) on the CPU: the ``--small`` path, decode and prefill, every
mode.

One subprocess runs ``python -m benchmarks.serving_step --small`` (reference backend, XLA attention) with XLA's
CPU backend optimisation off, which halves the compile time of the canary programs and changes no result. The
test checks that each scenario x mode reports positive times, that the clean run records no violation with
every plan enabled and complete, and that a byte flipped in layer 0's K between steps is reported as a real-KV
hash mismatch in PARTIAL and ALL (and, as expected, not in NONE): the benchmark measures a canary that checks.
The profile attribution and the Pallas decode-attention wrapper (interpret mode) get small checks of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import serving_step as ss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# decode128 (8 requests in --small) and prefill; decode1 is its one-request case, left to the GPU runs (CI time)
SCENARIOS = ("decode128", "prefill")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("serving_step") / "small.json"
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip(),
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.pop("CANARY_JAX_BACKEND", None)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.serving_step",
        "--small",
        "--scenario",
        ",".join(SCENARIOS + ("write4096",)),
        "--modes",
        "off,none,partial,all",
        "--parts",
        "none",
        "--rounds",
        "1",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as fh:
        return json.load(fh), proc.stdout


def test_each_scenario_and_mode_has_positive_times(small_run):
    res, stdout = small_run
    assert res["attention"]["decode"] == "xla" and res["attention"]["prefill"] == "xla"
    for name in SCENARIOS:
        sres = res["scenarios"][name]
        assert not sres.get("error"), sres.get("error")
        assert not sres.get("errors"), sres.get("errors")
        for mode in ss.MODES:
            mr = sres["modes"][mode]
            assert mr["step_wall_ms"] > 0, (name, mode)
            assert "step_ms" in mr and len(mr["call_s"]) == 1
        assert sres["config"]["canary_backend"] == "reference"
        assert set(sres["overhead_pct"]) == {"none", "partial", "all"}
    assert res["write4096"]["us"] > 0 and res["write4096"]["violations"] == 0
    assert "## Step time per scenario and mode" in stdout


def test_clean_run_reports_nothing_and_plans_are_complete(small_run):
    res, _ = small_run
    scns = ss.scenarios(small=True)
    for name in SCENARIOS:
        for mode in ("none", "partial", "all"):
            mr = res["scenarios"][name]["modes"][mode]
            assert mr["violations_clean"] == 0, (name, mode)
            assert mr["verify_enable"] == 1, (name, mode)
            assert mr["verify_num_valid"] == scns[name].verify_entries, (name, mode)


def test_kv_byte_flip_is_detected_in_partial_and_all(small_run):
    res, _ = small_run
    for name in SCENARIOS:
        fc = res["scenarios"][name]["fault_check"]
        for mode in ("partial", "all"):
            assert fc[mode]["detected"], (name, mode, fc[mode])
            assert fc[mode]["real_kv_hash_rows"] > 0
            assert "TAIL_K_FULL" in fc[mode]["tags"]
        assert not fc["none"]["detected"] and fc["none"]["new_violations"] == 0, fc["none"]


def test_attribution_of_kernels_to_parts():
    hlo = "\n".join(
        [
            "HloModule jit_program, entry_computation_layout={}",
            '  %fusion.3 = u32[8]{0} fusion(u32[8]{0} %p), kind=kLoop, metadata={op_name="jit(program)/while/body/'
            'canary_plan/jit(_build_plans_impl)/add"}',
            '  %custom-call.7 = (u32[8]{0}, s32[1]{0}) custom-call(%a), metadata={op_name="jit(program)/while/body/'
            'canary_tail/jit(_verify_pallas)/pallas_call"}',
            '  %custom-call.9 = u32[8]{0} custom-call(%a), metadata={op_name="jit(program)/while/body/canary_head/'
            'jit(_write_pallas)/pallas_call"}',
            '  %dot.1 = bf16[8,8]{1,0} dot(%a, %b), metadata={op_name="jit(program)/while/body/model/dot_general"}',
            "  %copy.5 = u8[8,32]{1,0} copy(%x)",
        ]
    )
    module, index = ss.hlo_index(hlo)
    assert module == "jit_program"
    assert index["custom-call.7"][0] == "custom-call"
    events = [
        ("loop_add_fusion", 0.0, 1000.0, "fusion.3"),
        ("canary_verify", 1.0, 3000.0, "custom-call.7"),
        ("canary_write_chain", 2.0, 2000.0, "custom-call.9"),
        ("sm90_xmma_gemm_bf16", 3.0, 5000.0, None),
        ("fusion_3", 4.0, 1000.0, None),  # no hlo_op stat (a command-buffer replay): matched by its sanitized name
        ("copy_5", 5.0, 500.0, None),
        # no hlo_op, but the trace's tf_op stat carries the op_name
        ("canary_write_store", 6.0, 400.0, None, "jit(program)/while/body/canary_tail/jit(_write_pallas)/pallas_call"),
    ]
    got = ss.attribute(events, index, steps=2)
    parts = got["parts_ms"]
    assert parts["plan"] == pytest.approx(1e-3)  # (1000 + 1000) ns over 2 steps
    assert parts["tail_verify"] == pytest.approx(1.5e-3)
    assert parts["head_write"] == pytest.approx(1e-3)
    assert parts["model"] == pytest.approx(2.5e-3)
    assert parts["plan_other"] == pytest.approx(2.5e-4)  # after a plan kernel: charged to the plan
    assert parts["tail_write"] == pytest.approx(2e-4)
    assert got["kernel_sum_ms"] == pytest.approx(6.45e-3)


def test_attribution_of_unnamed_canary_kernels_by_name_and_timeline():
    """What the H200 trace gives (no hlo_op stats): the plan's fusions are found by name, the Pallas kernels by
    XLA's name suffixes (HEAD, then TAIL ``__1``, then the sweep ``__2``) and, for kernels several phases
    share, by where they run."""
    hlo = "\n".join(
        [
            "HloModule jit_program",
            '  %loop_select_fusion = u32[8]{0} fusion(%p), metadata={op_name="jit(program)/canary_plan/jit(f)/x"}',
            '  %loop_add_fusion.4 = u32[8]{0} fusion(%p), metadata={op_name="jit(program)/canary_sweep/jit(_build_plans'
            '_impl)/x"}',
        ]
    )
    _, index = ss.hlo_index(hlo)
    names = [
        ("loop_select_fusion", 10.0),  # plan
        ("MemcpyD2D", 1.0),  # a copy inside the plan
        ("canary_verify", 5.0),  # HEAD
        ("canary_write_chain", 4.0),
        ("canary_write_claim", 0.5),  # shared by HEAD and TAIL
        ("canary_write_won", 2.0),  # likewise
        ("nvjet_sm90_tst_64x16", 100.0),  # model
        ("canary_verify__1", 7.0),  # TAIL
        ("canary_write_chain__1", 6.0),
        ("canary_write_claim", 1.0),
        ("canary_write_won", 3.0),
        ("MemcpyD2D", 2.0),  # a copy after the TAIL write
        ("loop_add_fusion_4", 1.0),  # sweep plan
        ("canary_verify__1", 9.0),  # the sweep reuses the TAIL kernel (same shapes)
    ]
    events = [(n, float(i), 1000.0 * us, None) for i, (n, us) in enumerate(names)]
    p = ss.attribute(events, index, steps=1)["parts_ms"]
    assert p["plan"] == pytest.approx(0.010) and p["plan_copy"] == pytest.approx(0.001)
    assert p["head_verify"] == pytest.approx(0.005) and p["head_write"] == pytest.approx(0.0065)
    assert p["model"] == pytest.approx(0.100)
    assert p["tail_verify"] == pytest.approx(0.007) and p["tail_write"] == pytest.approx(0.010)
    assert p["tail_copy"] == pytest.approx(0.002)
    assert p["sweep_plan"] == pytest.approx(0.001) and p["sweep_verify"] == pytest.approx(0.009)


def test_attribution_of_phase_kernels_whose_op_name_has_no_step_scope():
    """What the H100 trace of 2026-12-07 gave: the Pallas kernels carry an op_name without the step's scopes
    (``canary_head`` ...), so they are attributed as unnamed ones: ``canary_plan`` to the plan, ``canary_phase`` to
    HEAD, ``canary_phase__1`` to TAIL, the sweep's plan and verify after the TAIL to the sweep."""
    meta = 'metadata={op_name="jit(many)/while/body/pallas_call"}'
    hlo = "\n".join(
        ["HloModule m"]
        + [f"  %{k} = u32[8]{{0}} custom-call(%p), {meta}" for k in ("canary_plan", "canary_phase", "canary_phase.1")]
        + [f"  %canary_verify = u32[8]{{0}} custom-call(%p), {meta}"]
    )
    _, index = ss.hlo_index(hlo)
    names = [
        ("canary_plan", 2.0),  # plan
        ("canary_phase", 5.0),  # HEAD
        ("nvjet_sm90_gemm", 100.0),  # model
        ("canary_phase__1", 7.0),  # TAIL
        ("canary_plan", 3.0),  # the sweep's plan (the step's plan kernel)
        ("canary_verify__1", 11.0),  # the sweep's verify
    ]
    events = [(n, float(i), 1000.0 * us, None) for i, (n, us) in enumerate(names)]
    p = ss.attribute(events, index, steps=1)["parts_ms"]
    assert "canary_unattributed" not in p
    assert p["plan"] == pytest.approx(0.002) and p["head_phase"] == pytest.approx(0.005)
    assert p["tail_phase"] == pytest.approx(0.007) and p["model"] == pytest.approx(0.100)
    assert p["sweep_plan"] == pytest.approx(0.003) and p["sweep_verify"] == pytest.approx(0.011)


def test_attribution_of_a_sweep_whose_kernels_the_step_shares():
    """decode: the sweep's plan has the per-forward plan's shapes, so XLA names their kernels alike, and the
    sweep's verify reuses the TAIL kernel (``__1``). A verify of index >= 1 right after plan kernels (no model
    kernel between) is the sweep's, and so are those plan kernels."""
    hlo = 'HloModule m\n  %loop_select_fusion = u32[8]{0} fusion(%p), metadata={op_name="jit(p)/canary_plan/x"}'
    _, index = ss.hlo_index(hlo)
    names = [
        ("loop_select_fusion", 10.0),  # step 1: plan
        ("canary_verify", 5.0),  # HEAD
        ("canary_write_chain", 4.0),
        ("nvjet_sm90_gemm", 100.0),  # model
        ("canary_verify__1", 7.0),  # TAIL
        ("canary_write_chain__1", 6.0),
        ("loop_select_fusion", 20.0),  # the sweep's plan (same kernel as the step's plan)
        ("MemcpyD2D", 3.0),
        ("canary_verify__1", 30.0),  # the sweep's verify (same kernel as TAIL's)
        ("canary_verify_rows__2", 1.0),
        ("loop_select_fusion", 10.0),  # step 2: plan
        ("canary_verify", 5.0),
    ]
    events = [(n, float(i), 1000.0 * us, None) for i, (n, us) in enumerate(names)]
    got = ss.attribute(events, index, steps=2, cycle=1)
    p = {k: 2 * v for k, v in got["parts_ms"].items()}  # ms over both steps
    assert p["plan"] == pytest.approx(0.020) and p["sweep_plan"] == pytest.approx(0.020)
    assert p["sweep_copy"] == pytest.approx(0.003) and p["sweep_verify"] == pytest.approx(0.031)
    assert p["tail_verify"] == pytest.approx(0.007) and p["head_verify"] == pytest.approx(0.010)
    assert [row[1] for row in got["timeline"]][-2:] == ["plan", "head_verify"]


@pytest.mark.parametrize(
    "pages, ps, hk, hq, d, pps, lengths",
    [
        (12, 4, 2, 4, 16, 4, [16, 11]),  # one split, one page a step
        (70, 16, 2, 40, 16, 16, [256, 1, 77, 200]),  # 4 splits of 4 pages, 2 head blocks (20 heads a KV head)
    ],
)
def test_pallas_decode_attention_matches_xla_in_interpret_mode(pages, ps, hk, hq, d, pps, lengths):
    rng = np.random.default_rng(0)
    b = len(lengths)
    kp = jnp.asarray(rng.standard_normal((pages, ps, hk, d)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((pages, ps, hk, d)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((b, hq, d)) / 4, jnp.bfloat16)
    bt = jnp.asarray(rng.permutation(np.arange(1, pages))[: b * pps].reshape(b, pps), jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    got = ss.decode_attention_pallas(q, kp, vp, bt, lengths, interpret=True)
    want = ss.decode_attention_xla(q, kp, vp, bt, lengths)
    err = jnp.linalg.norm((got - want).astype(jnp.float32), axis=(1, 2)) / jnp.linalg.norm(
        want.astype(jnp.float32), axis=(1, 2)
    )
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float(err.max()) < 2e-2, err
    jax.clear_caches()
