"""What a steady-state torch launch does on the host (issue #4): no re-trace, no re-import, and no query of
its outputs' buffer pointers after the first launch of a program.

A pointer query (``unsafe_buffer_pointer``) takes an external reference in PJRT, which on XLA's TFRT GPU client
blocks the host until the launch has been dispatched, so a per-launch query serialises the launches. The
launcher decides which outputs alias the torch memory on the first launch of each compiled program and
reuses that decision; ``set_alias_check("every")`` restores the per-launch query, and every
``ALIAS_RECHECK_PERIOD``-th launch re-checks. XLA:CPU never hands a donated imported buffer back, so these
tests force donation on CPU: outputs are then new buffers, copied back, and every value must still equal the
independent re-implementation of SGLang's references.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from helpers.interop_world import World, assert_same_bytes
from helpers.torch_reference import ref_write
from interop import runner, sglang


@pytest.fixture
def forced_donation(monkeypatch):
    """Donation on for CPU launches (measured off on XLA:CPU), alias checks in their default mode."""
    monkeypatch.setitem(runner._DONATION, "cpu", True)
    runner._compiled.cache_clear()  # fresh programs: each test sees its program's first launch
    runner.set_alias_check("first")
    yield
    runner.set_alias_check("first")


def _write_args(n=3, start_slot=5):
    plan = sglang.WritePlan.allocate(write_req_capacity=2)
    plan.write_offsets.copy_(torch.tensor([0, n, n]))
    plan.write_seed_slot_indices.copy_(torch.tensor([-1, -1]))
    plan.write_num_valid_reqs.fill_(1)
    kw = dict(
        input_ids=torch.arange(101, 101 + n),
        positions=torch.arange(n),
        out_cache_loc=torch.arange(start_slot, start_slot + n),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    return plan, kw


def _worlds():
    ours = World.make(random.Random(7), sources=((torch.uint8, 1, 16, 16, 0),), mode=1)
    ref = ours.clone()
    ours.ctx, ref.ctx = ours.context(2), ref.context(2)  # kept between launches, as an engine does
    return ours, ref


def _launch_both(ours, ref, plan, kw, step):
    """One write on both worlds; each step writes new token ids and seeds from the previous chain end."""
    kw["input_ids"].copy_(torch.arange(3) + 1000 * step)
    plan.write_seed_slot_indices[0] = -1 if step == 0 else 7
    sglang.launch_canary_write_kernel(context=ours.ctx, plan=plan, backend="reference", **kw)
    ref_write(context=ref.ctx, plan=plan, **kw)


def test_steady_state_launches_do_not_query_output_pointers(forced_donation):
    ours, ref = _worlds()
    plan, kw = _write_args()
    _launch_both(ours, ref, plan, kw, 0)
    first = runner.last_launch_report()
    assert first["donated"] is True and first["alias_checked"] is True
    assert first["aliased"] == [] and len(first["copied_back"]) == 5  # XLA:CPU: donated outputs are new buffers
    checks, traces = runner.alias_check_count(), runner.trace_count()
    for step in range(1, 6):
        _launch_both(ours, ref, plan, kw, step)
        rep = runner.last_launch_report()
        assert rep["alias_checked"] is False and rep["copied_back"] == first["copied_back"]
        assert_same_bytes(ours.tensors(), ref.tensors(), f"step {step}")
    assert runner.alias_check_count() == checks  # no pointer query after the first launch
    assert runner.trace_count() == traces
    assert ours.buf.view(torch.int64)[5:8, 0].tolist() == [5000, 5001, 5002]
    assert ours.state.kernel_run_counters[2].item() == 6 and ours.state.slot_run_counters[2].item() == 18


def test_every_mode_queries_each_launch(forced_donation):
    ours, ref = _worlds()
    plan, kw = _write_args()
    runner.set_alias_check("every")
    _launch_both(ours, ref, plan, kw, 0)
    checks = runner.alias_check_count()
    for step in range(1, 4):
        _launch_both(ours, ref, plan, kw, step)
        assert runner.last_launch_report()["alias_checked"] is True
    assert runner.alias_check_count() - checks == 3 * 5  # 5 mutable buffers: canary, ring, index, 2 counter windows
    assert_same_bytes(ours.tensors(), ref.tensors(), "every mode")
    with pytest.raises(ValueError, match="alias check mode must be 'first' or 'every', got 'sometimes'"):
        runner.set_alias_check("sometimes")


def test_periodic_recheck_recovers_outputs_wrongly_trusted(forced_donation, monkeypatch):
    """If a program's outputs stopped aliasing after the first launch (never seen; the compiled aliases fix
    it), the launches in between kept their results in the cached outputs: the re-check copies them back."""
    monkeypatch.setattr(runner, "ALIAS_RECHECK_PERIOD", 4)
    ours, ref = _worlds()
    plan, kw = _write_args()
    _launch_both(ours, ref, plan, kw, 0)
    prog = runner._LAST_REPORT["_prog"]
    assert prog.launches == 1 and prog.aliases == (False,) * 5
    prog.aliases = (True,) * 5  # pretend the first launch had found every output aliased
    _launch_both(ours, ref, plan, kw, 1)
    _launch_both(ours, ref, plan, kw, 2)
    # torch was not updated by launches 2 and 3 (their outputs were trusted to be the torch memory)
    assert ours.state.kernel_run_counters[2].item() == 1
    assert ours.buf.view(torch.int64)[5, 0].item() == 0  # step 0's token, not step 2's (2000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _launch_both(ours, ref, plan, kw, 3)  # launch 4: re-check, mismatch, copy back
    assert any("did not on launch 4" in str(w.message) for w in caught)
    assert prog.every is True and runner.last_launch_report()["alias_checked"] is True
    assert ours.state.kernel_run_counters[2].item() == 4
    assert_same_bytes(ours.tensors(), ref.tensors(), "after the re-check")
    _launch_both(ours, ref, plan, kw, 4)
    assert runner.last_launch_report()["alias_checked"] is True  # checks every launch from now on
    assert_same_bytes(ours.tensors(), ref.tensors(), "after switching to every")


def test_phase_timing_accounts_for_each_launch():
    w = World.make(random.Random(8))
    plan, kw = _write_args()
    runner.set_phase_timing(True)
    try:
        for _ in range(4):
            sglang.launch_canary_write_kernel(context=w.context(2), plan=plan, backend="reference", **kw)
        phases = runner.phase_times()
    finally:
        runner.set_phase_timing(False)
    assert set(phases) == {"prepare", "import", "fence", "dispatch", "outputs", "export", "total"}
    assert all(p["calls"] == 4 for p in phases.values())
    parts = sum(p["us_per_call"] for k, p in phases.items() if k != "total")
    assert 0 < parts <= phases["total"]["us_per_call"] * 1.01 + 1
    assert runner.phase_times() == {}  # cleared by set_phase_timing


def test_last_launch_program_dispatches_the_same_program_from_jax():
    """The bench's JAX twin: the launch's own jitted program on JAX copies of its inputs gives the bytes the
    next launch leaves in the torch tensors."""
    from interop import dlpack

    w = World.make(random.Random(9), sources=((torch.uint8, 1, 16, 16, 0),), mode=1)
    plan, kw = _write_args()
    sglang.launch_canary_write_kernel(context=w.context(2), plan=plan, backend="reference", **kw)
    fn, mutable_idx, views, dev = runner.last_launch_program()
    assert dev.type == "cpu" and len(mutable_idx) == 5 and len(views) > len(mutable_idx)
    copies = [v.clone() for v in views]
    fence = dlpack._import_exact(torch.zeros(16, dtype=torch.uint8), name="fence")
    traces = runner.trace_count()
    outs = fn(fence, *[dlpack._import_exact(c, name="copy") for c in copies])
    assert runner.trace_count() == traces  # the launch's program, already traced
    plan.write_seed_slot_indices[0] = 7  # the torch launch: the same inputs
    plan.write_seed_slot_indices[0] = -1
    sglang.launch_canary_write_kernel(context=w.context(2), plan=plan, backend="reference", **kw)
    for i, out in zip(mutable_idx, outs):
        assert torch.equal(dlpack.to_torch(out).reshape(views[i].shape), views[i]), i
    assert w.state.kernel_run_counters[2].item() == 2
