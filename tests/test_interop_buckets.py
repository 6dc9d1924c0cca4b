"""Torch launchers under issue #12: bucket-padded launch shapes, sources shorter than the pool, CPU inputs that
XLA cannot import in place, and the alignment message of int64 views.

Every launch is compared with the independent re-implementation of SGLang's torch references
(``helpers/torch_reference.py``), whole tensors byte for byte.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from canary_jax.ops import buckets
from helpers.interop_world import World, assert_same_bytes, random_verify_plan, random_write_args
from helpers.torch_reference import ref_verify, ref_write
from interop import dlpack, padding, runner, sglang


def _snapshot(w):
    return {k: t.clone() for k, t in w.tensors().items()}


def test_token_counts_compile_one_program_per_bucket():
    """T = 1..40 and C = 1..40: buckets 16, 32, 64 -> at most 3 programs per op (was one per size)."""
    rng = random.Random(5)
    ours = World.make(rng, num_slots=61, ring=64)
    ref = ours.clone()
    before = runner.trace_count()
    for t in range(1, 41):
        plan, kw = random_write_args(rng, ours, cw=rng.randint(1, 5), t=t)
        sglang.launch_canary_write_kernel(context=ours.context(2), plan=plan, backend="reference", **kw)
        ref_write(context=ref.context(2), plan=plan, **kw)
        vplan = random_verify_plan(rng, ours, cap=t)
        sglang.launch_canary_verify_kernel(
            context=ours.context(3), plan=vplan, check_verify_expected_token=True, backend="reference"
        )
        ref_verify(context=ref.context(3), plan=vplan, check_verify_expected_token=True)
        assert_same_bytes(ours.tensors(), ref.tensors(), f"T={t}")
        assert runner.trace_count() - before <= 12, f"{runner.trace_count() - before} programs by T={t}"
    # write: 3 buckets x assert flag on/off; verify: 3 buckets
    assert runner.trace_count() - before <= 9


def test_padded_write_keeps_out_of_contract_offsets_inside_t():
    """An offset past T is clamped to T by the kernels; the padded launch must not reach the padded tokens. SGLang's
    reference does not define this case, so the padded launch is compared with an unpadded one (bucket list
    holding exactly Cw = 2 and T = 5)."""
    rng = random.Random(9)
    padded = World.make(rng, num_slots=61, ring=16)
    exact = padded.clone()
    plan, kw = random_write_args(rng, padded, cw=2, t=5)
    plan.write_offsets.copy_(torch.tensor([0, 3, 40]))  # past T = 5
    plan.write_num_valid_reqs.fill_(7)  # above Cw = 2
    sglang.launch_canary_write_kernel(context=padded.context(2), plan=plan, backend="reference", **kw)
    try:
        buckets.set_default_buckets((2, 5, 16))
        sglang.launch_canary_write_kernel(context=exact.context(2), plan=plan, backend="reference", **kw)
    finally:
        buckets.set_default_buckets()
    assert_same_bytes(padded.tensors(), exact.tensors(), "out of contract")
    assert int(padded.state.slot_run_counters[2]) > 0  # something was written
    assert plan.write_offsets.tolist() == [0, 3, 40]  # the caller's plan is untouched


@pytest.mark.parametrize("launch", ["verify", "write"])
def test_source_shorter_than_the_pool_refuses_a_slot_past_it(launch):
    rng = random.Random(3)
    w = World.make(rng, num_slots=128, sources=((torch.uint8, 4, 16, 16, 0),), mode=2)
    w.kv[0] = w.kv[0][:24].clone()  # 24 rows x page_size 4 = 96 slots < 128
    before = _snapshot(w)
    # a hashed slot past the source is refused by name (issue #28: slots inside it are accepted, as SGLang does)
    msg = rf"kv-canary: {launch} hashes slot (9[6-9]|1[0-2][0-9]) \(.*\) but " + re.escape(
        "real_kv_sources[0] covers 96 slots (24 rows x page_size 4)"
    )
    with pytest.raises(ValueError, match=msg):
        if launch == "verify":
            plan = random_verify_plan(rng, w, cap=4)
            sglang.launch_canary_verify_kernel(context=w.context(2), plan=plan, check_verify_expected_token=False)
        else:
            plan, kw = random_write_args(rng, w, cw=2, t=4)
            kw["out_cache_loc"].fill_(120)  # every live entry writes slot 120, past the source's 96
            sglang.launch_canary_write_kernel(context=w.context(2), plan=plan, **kw)
    assert_same_bytes(_snapshot(w), before, launch)
    w.mode = 0  # NONE: the sources are never read, nothing to refuse (like the row-width check)
    plan = random_verify_plan(rng, w, cap=4)
    sglang.launch_canary_verify_kernel(context=w.context(2), plan=plan, check_verify_expected_token=False)


def _misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a CPU tensor whose data pointer is 16 (not 64) bytes past an aligned one."""
    raw = torch.zeros(t.numel() * t.element_size() + 128, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 64 + 16
    out = raw[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def test_misaligned_read_only_cpu_inputs_are_staged_not_refused():
    rng = random.Random(21)
    ours = World.make(rng, num_slots=61, ring=16)
    ref = ours.clone()
    for step in range(3):  # the staged copies are refreshed on every launch
        plan, kw = random_write_args(rng, ours, cw=3, t=9)
        kw["input_ids"] = torch.from_numpy(np.asarray(kw["input_ids"].numpy()[None].repeat(2, 0)))[1]  # offset view
        kw["positions"] = _misaligned_copy(kw["positions"])
        kw["out_cache_loc"] = _misaligned_copy(kw["out_cache_loc"])
        object.__setattr__(plan, "write_offsets", _misaligned_copy(plan.write_offsets))
        object.__setattr__(plan, "write_num_valid_reqs", _misaligned_copy(plan.write_num_valid_reqs))
        assert kw["positions"].data_ptr() % 64 and plan.write_num_valid_reqs.data_ptr() % 64
        sglang.launch_canary_write_kernel(context=ours.context(2), plan=plan, backend="reference", **kw)
        ref_write(context=ref.context(2), plan=plan, **kw)
        assert_same_bytes(ours.tensors(), ref.tensors(), f"step {step}")
        vplan = random_verify_plan(rng, ours, cap=16)
        object.__setattr__(vplan, "verify_slot_indices", _misaligned_copy(vplan.verify_slot_indices))
        object.__setattr__(vplan, "verify_num_valid", _misaligned_copy(vplan.verify_num_valid))
        sglang.launch_canary_verify_kernel(context=ours.context(3), plan=vplan, check_verify_expected_token=False)
        ref_verify(context=ref.context(3), plan=vplan, check_verify_expected_token=False)
        assert_same_bytes(ours.tensors(), ref.tensors(), f"verify step {step}")


def test_misaligned_outputs_are_refused_saying_why():
    rng = random.Random(22)
    w = World.make(rng, num_slots=61, ring=16)
    w.state = w.state.__class__(
        violation_ring=_misaligned_copy(w.state.violation_ring),
        violation_write_index=w.state.violation_write_index,
        slot_run_counters=w.state.slot_run_counters,
        kernel_run_counters=w.state.kernel_run_counters,
        enable_chain_position_assert=w.state.enable_chain_position_assert,
    )
    before = _snapshot(w)
    plan = random_verify_plan(rng, w, cap=16)
    with pytest.raises(ValueError) as e:
        sglang.launch_canary_verify_kernel(context=w.context(2), plan=plan, check_verify_expected_token=False)
    msg = str(e.value)
    assert "violation_ring data pointer" in msg and "not aligned to 64 bytes" in msg
    assert "storage offset 16 bytes = 2 torch.int64 elements" in msg  # bytes, and elements of the int64 tensor
    assert "it is an output of the launch, updated in place, so it is never copied" in msg
    assert_same_bytes(_snapshot(w), before, "refused")


def test_int64_alignment_message_counts_int64_elements():
    base = torch.zeros(64, dtype=torch.int64)
    off = next(o for o in range(1, 16) if (base.data_ptr() + 8 * o) % 64)
    with pytest.raises(ValueError) as e:
        dlpack.to_jax(base[off : off + 8], name="ids")
    assert f"storage offset {8 * off} bytes = {off} torch.int64 elements" in str(e.value)


def test_staging_fills_its_padded_rows_once_and_its_live_rows_every_call():
    """A staging tensor is reused for the same caller tensor: the live rows follow the caller's current values,
    the fill rows stay the fill, an edge row follows the current last row (``interop.padding.pad_rows``)."""
    t = torch.tensor([5, 6, 7], dtype=torch.int64)
    a = padding.pad_rows(t, 8, fill=-1)
    assert a.tolist() == [5, 6, 7] + [-1] * 5
    t.copy_(torch.tensor([1, 2, 3]))
    b = padding.pad_rows(t, 8, fill=-1)
    assert b is a and b.tolist() == [1, 2, 3] + [-1] * 5
    e = padding.pad_rows(t, 8, edge=True, clamp=(0, 2))
    assert e is not a and e.tolist() == [1, 2, 2] + [2] * 5
    t.copy_(torch.tensor([0, 1, 1]))
    assert padding.pad_rows(t, 8, edge=True, clamp=(0, 2)).tolist() == [0, 1, 1] + [1] * 5
    assert padding.pad_rows(t, 3) is t  # a bucket size already: no copy
