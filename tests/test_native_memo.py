"""The launchers' memo of checked launches (issue #26: a launch with a key it has seen skips its checks).

A launch key names every tensor's address, shape, strides and dtype and every scalar by value
(:mod:`interop.native.replay`); a key whose checks passed is memoised (:data:`interop.sglang_launch.CHECKED`) and
its program too (:func:`interop.native.launch.run_native`), so its later launches gather their tensors and launch.
On the CPU the launchers give no key (no CUDA graph to replay), so these tests key CPU launches as a CUDA launch
would be keyed, with replay off, and run the interpreted kernels.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from helpers.interop_world import World, assert_same_bytes, random_verify_plan, random_write_args
from interop import sglang, sglang_launch
from interop.native import launch as native
from interop.native import replay

TAIL = int(sglang.CanaryLaunchTag.TAIL_K_FULL)


@pytest.fixture
def keyed(monkeypatch):
    """CPU launches keyed like CUDA ones; counts of the checks that ran, by op."""
    monkeypatch.setenv(replay.GRAPHS_ENV, "0")  # replay off: every launch runs (checked or memoised)

    def key(op, path, backend, first, parts, layout=False):  # as _replay_key keys a CUDA launch: native only
        if path != "native":
            return None
        return sglang_launch.launch_key(op, path, backend, (), parts, layout)

    monkeypatch.setattr(sglang, "_replay_key", key)
    monkeypatch.setattr(sglang_launch, "KEYS", replay.GuardedKeys())
    monkeypatch.setattr(sglang_launch.CHECKED, "_d", {})
    monkeypatch.setattr(sglang_launch.LAYOUTS, "_d", {})
    monkeypatch.setattr(native, "_READY", replay.KeyMemo())
    ran = {"verify": 0, "write": 0}
    for op in ran:
        real = getattr(sglang, f"_check_{op}")

        def spy(*a, _real=real, _op=op):
            ran[_op] += 1
            return _real(*a)

        monkeypatch.setattr(sglang, f"_check_{op}", spy)
    return ran


def _world(mode: int = 2) -> World:
    return World.make(random.Random(3), num_slots=64, ring=16, sources=((torch.uint8, 1, 16, 16, 0),), mode=mode)


def _launch_write(w, plan, kw, path):
    sglang.launch_canary_write_kernel(context=w.context(TAIL), plan=plan, backend="pallas", path=path, **kw)


def _launch_verify(w, plan, path):
    sglang.launch_canary_verify_kernel(
        context=w.context(TAIL), plan=plan, check_verify_expected_token=True, backend="pallas", path=path
    )


def test_a_seen_key_skips_its_checks_and_gives_the_same_bytes(keyed):
    rng = random.Random(5)
    w = _world()
    twin = w.clone()
    plan, kw = random_write_args(rng, w)
    vplan = random_verify_plan(rng, w)
    for _ in range(3):  # the native launches, keyed; the DLPack twin unkeyed
        _launch_write(w, plan, kw, "native")
        _launch_write(twin, plan, kw, "dlpack")
        _launch_verify(w, vplan, "native")
        _launch_verify(twin, vplan, "dlpack")
    assert keyed == {"write": 3 + 1, "verify": 3 + 1}  # every unkeyed DLPack launch, and the first native one
    assert len(native._READY) == 2
    assert_same_bytes(w.tensors(), twin.tensors(), "memoised native launches")
    assert int(w.state.kernel_run_counters[TAIL]) == 6


def test_another_tensor_in_a_field_is_checked_again(keyed):
    rng = random.Random(6)
    w = _world()
    vplan = random_verify_plan(rng, w)
    _launch_verify(w, vplan, "native")
    before = {n: t.clone() for n, t in w.tensors().items()}
    # the same tensors but one, of the wrong dtype
    vplan = dataclasses.replace(vplan, verify_num_valid=vplan.verify_num_valid.to(torch.int64))
    with pytest.raises(TypeError, match="verify_num_valid"):
        _launch_verify(w, vplan, "native")
    assert keyed["verify"] == 2
    assert_same_bytes(w.tensors(), before, "a refused launch")


def test_a_short_source_is_checked_at_every_launch(keyed):
    """A launch whose sources do not cover the canary buffer reads its slots at every launch: a slot past the
    source is refused at the second launch of the very same tensors, after a first that passed."""
    w = World.make(random.Random(0), num_slots=16, ring=8, sources=((torch.uint8, 1, 16, 16, 0),), mode=2)
    w.kv[0] = w.kv[0][:8].clone()  # 8 rows for 16 slots
    plan = sglang.WritePlan(
        write_offsets=torch.tensor([0, 1], dtype=torch.int64),
        write_seed_slot_indices=torch.tensor([-1], dtype=torch.int64),
        write_num_valid_reqs=torch.tensor([1], dtype=torch.int32),
    )
    kw = dict(
        input_ids=torch.tensor([7], dtype=torch.int64),
        positions=torch.tensor([0], dtype=torch.int64),
        out_cache_loc=torch.tensor([3], dtype=torch.int64),
        enable_write_input_assert=False,
        expected_input_tokens=None,
        expected_input_positions=None,
    )
    _launch_write(w, plan, kw, "native")
    kw["out_cache_loc"].fill_(11)  # past the source's 8 rows; the same tensor, so the same key
    before = {n: t.clone() for n, t in w.tensors().items()}
    with pytest.raises(ValueError, match=r"write hashes slot 11 \(out_cache_loc\[0\]\)"):
        _launch_write(w, plan, kw, "native")
    assert keyed["write"] == 2 and len(sglang_launch.CHECKED) == len(sglang_launch.LAYOUTS) == 0
    assert_same_bytes(w.tensors(), before, "a refused launch")


def test_fresh_tensors_of_a_checked_layout_skip_the_checks_but_not_the_address_checks(keyed):
    """New tensors with the layout of a launch already checked (a decode step's fresh plan tensors) skip the
    launcher's checks; what depends on addresses still runs: a plan tensor inside the violation ring is refused
    (where the launch reads the plan's own tensors: a padded plan is read from its staging copy, on both paths)."""
    rng = random.Random(8)
    w = _world()
    twin = w.clone()
    vplan = random_verify_plan(rng, w, cap=16)  # a bucket size: the launch reads the plan's own tensors
    _launch_verify(w, vplan, "native")
    _launch_verify(twin, vplan, "dlpack")
    fresh = dataclasses.replace(vplan, **{f: getattr(vplan, f).clone() for f in ("verify_slot_indices", "enable")})
    _launch_verify(w, fresh, "native")
    _launch_verify(twin, fresh, "dlpack")
    assert keyed["verify"] == 1 + 2  # the first native launch, and both DLPack ones
    assert_same_bytes(w.tensors(), twin.tensors(), "a fresh plan of a checked layout")
    cap = vplan.verify_slot_indices.shape[0]
    inside = w.state.violation_ring.view(-1)[:cap]  # same shape, strides and dtype: the layout key matches
    bad = dataclasses.replace(vplan, verify_slot_indices=inside)
    before = {n: t.clone() for n, t in w.tensors().items()}
    with pytest.raises(ValueError, match="violation_ring overlaps plan.verify_slot_indices"):
        _launch_verify(w, bad, "native")
    assert keyed["verify"] == 3
    assert_same_bytes(w.tensors(), before, "a refused launch")


def test_a_bad_path_name_is_cached_as_its_message_not_its_exception():
    """A cached exception would be raised again and again, its traceback growing and keeping every raising
    launch's tensors alive; the resolution caches the message and raises a fresh error each time."""
    for _ in range(2):
        with pytest.raises(ValueError, match="path must be one of"):
            sglang_launch._native_for("verify", "bogus", "pallas", (None, None), torch.device("cpu"))
    assert not any(isinstance(v, BaseException) for v in sglang_launch._RESOLVED.values())


def test_staging_made_in_inference_mode_is_not_refilled_outside_it():
    """A padded launch inside ``torch.inference_mode()`` and then outside it, on the same ordinary tensors: each
    mode has its own staging tensors (torch refuses to refill an inference tensor outside inference mode)."""
    rng = random.Random(9)
    w = _world()
    twin = w.clone()
    vplan = random_verify_plan(rng, w, cap=9)  # padded to 16
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            _launch_verify(w, vplan, "native")
            _launch_verify(twin, vplan, "dlpack")
    assert_same_bytes(w.tensors(), twin.tensors(), "inference mode, then outside it")


def test_an_object_is_read_once_so_what_is_keyed_is_what_is_launched(keyed):
    """A duck-typed context whose ``violation_ring`` flips between the int64 ring and a uint8 view of it on every
    read: each launch keys, checks and launches one read, so the uint8 one is refused every time, never launched
    under the int64 one's key (as a second read after the key would)."""
    rng = random.Random(10)
    w = _world()
    vplan = random_verify_plan(rng, w)
    inner = w.context(TAIL)

    class Flip:
        reads = 0

        def __getattr__(self, name):
            return getattr(inner, name)

        @property
        def violation_ring(self):
            Flip.reads += 1
            ring = inner.violation_ring
            return ring if Flip.reads % 2 else ring.view(torch.uint8)

    before = {n: t.clone() for n, t in w.tensors().items()}
    launched = 0
    for _ in range(4):
        try:
            sglang.launch_canary_verify_kernel(
                context=Flip(), plan=vplan, check_verify_expected_token=True, backend="pallas", path="native"
            )
            launched += 1
        except TypeError as e:
            assert "violation_ring must have dtype torch.int64" in str(e)
    assert Flip.reads == 4 and launched == 2  # one read per launch; the int64 reads ran, the uint8 ones were refused
    assert int(w.state.kernel_run_counters[TAIL]) == int(before["kernel_run_counters"][TAIL]) + 2


def test_a_launch_computes_each_tensors_facts_once(monkeypatch):
    """The checks of one launch read a tensor's facts two or three times; ``arguments.facts_once`` computes them
    once per tensor (25 to 13 for a write, 23 to 12 for a verify)."""
    from interop import arguments, dlpack

    seen = []
    real = dlpack.facts

    def spy(t):
        if getattr(arguments._MEMO, "facts", None) is not None:  # inside the launcher's checks
            seen.append(t)
        return real(t)

    monkeypatch.setattr(dlpack, "facts", spy)
    rng = random.Random(11)
    w = _world()
    plan, kw = random_write_args(rng, w)
    _launch_write(w, plan, kw, "dlpack")
    ids = [id(t) for t in seen]  # seen holds the tensors: no id is reused
    assert len(ids) == len(set(ids)) >= 12


def test_duck_sources_in_a_frozen_context_are_read_once_too(keyed):
    """This package's frozen context does not check what its ``real_kv_sources`` holds: duck-typed sources inside
    it are read once per launch too (a source tensor that shrinks on some read is refused, never launched)."""
    rng = random.Random(12)
    w = _world()
    vplan = random_verify_plan(rng, w, cap=16)
    good = w.kv[0]
    reads = []

    class Src:
        page_size, num_bytes_per_token, read_bytes = w.source_meta[0]

        @property
        def tensor(self):
            reads.append(1)
            return good if len(reads) % 3 else good[:1]  # every third read: one row for 64 slots

    ctx = dataclasses.replace(w.context(TAIL), real_kv_sources=(Src(),))
    for _ in range(6):
        try:
            sglang.launch_canary_verify_kernel(
                context=ctx, plan=vplan, check_verify_expected_token=True, backend="pallas", path="native"
            )
        except ValueError as e:  # the short read: refused by the checks, by name
            assert "real_kv_sources[0]" in str(e)
    assert len(reads) == 6  # one read per launch


def test_a_snapshot_names_the_callers_class_in_its_errors():
    class Ctx:
        pass

    snap = sglang_launch.stable(Ctx(), ("kernel_kind",))
    with pytest.raises(AttributeError, match="'Ctx' object has no attribute 'kernel_kind'"):
        getattr(snap, "kernel_kind")  # noqa: B009
    assert sglang_launch.stable(Ctx(), ()).__class__ is snap.__class__  # one snapshot class per caller class
