"""Launch shapes padded to buckets (issue #12, defect 5): one program per bucket, the same bytes as unpadded.

``canary_jax.verify`` / ``write`` outside ``jit`` pad ``C``, ``Cw`` and ``T`` to buckets; padded entries are
never written or counted. The 300-launch test drives token counts 1..300 (out-of-contract offsets,
``num_valid`` above capacity, skipped and out-of-range slots included) through the reference backend and
checks every launch against the independent Python-int oracle (the unpadded semantics), and a few sizes
against unpadded launches of the implementations themselves (reference and Pallas interpret).
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys

import jax
import jax.monitoring
import numpy as np
import pytest

import canary_jax
from canary_jax.contract import constants
from canary_jax.ops import backends, buckets, launch
from helpers import oracle

TAG = constants.CanaryLaunchTag.TAIL_K_FULL
N = 96  # canary slots


def _pairs(values) -> np.ndarray:
    arr = np.array([oracle.u64(int(v)) for v in values], dtype=np.uint64).astype("<u8")
    return arr.view("<u4").reshape(-1, 2).copy()


def _state(ctx) -> list[np.ndarray]:
    log = ctx.log
    return [np.asarray(x).copy() for x in (ctx.canary_buf, log.ring, log.write_index, log.slot_run_counters,
                                            log.kernel_run_counters)]  # fmt: skip


def _oracle_state(st: oracle.State) -> list[np.ndarray]:
    ring = _pairs(st.ring.reshape(-1)).reshape(st.ring.shape[0], 8, 2)
    wi = np.array([st.write_index], np.int32)
    return [st.buf.copy(), ring, wi, _pairs(st.slot_counters), _pairs(st.kernel_counters)]


def _assert_same(got, want, what):
    names = ("canary_buf", "ring", "write_index", "slot_run_counters", "kernel_run_counters")
    for n, a, b in zip(names, got, want):
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: {n}")


def _write_case(rng: random.Random, t: int):
    """A write launch of ``t`` tokens: 1..5 requests, sometimes an out-of-contract last offset (past ``t``) or
    ``num_valid_reqs`` above the capacity, slots -1 / out of range now and then."""
    nreq = rng.randint(1, 5)
    cuts = sorted(rng.randint(0, t) for _ in range(nreq - 1))
    offsets = [0, *cuts, t]
    if rng.random() < 0.3:
        offsets[-1] = t + rng.randint(1, 40)  # past T: the kernels clamp to T; padding must not reach its tokens
    seeds = [rng.choice([-1, -1, rng.randrange(N)]) for _ in range(nreq)]
    nv = nreq + (rng.randint(1, 3) if rng.random() < 0.2 else 0)
    ids = [rng.randrange(1000) for _ in range(t)]
    pos = [rng.randrange(8) for _ in range(t)]
    loc = [rng.choice([-1, N + 3] if rng.random() < 0.1 else [rng.randrange(N)]) for _ in range(t)]
    return offsets, seeds, nv, ids, pos, loc


def _verify_case(rng: random.Random, c: int):
    slots = [rng.choice([0, rng.randrange(N), N + 1]) if rng.random() < 0.1 else rng.randrange(N) for _ in range(c)]
    prev = [rng.choice([-1, 0, rng.randrange(N)]) for _ in range(c)]
    pos = [rng.randrange(8) for _ in range(c)]
    nv = c + (rng.randint(1, 50) if rng.random() < 0.3 else 0)  # above C: entries past C stay dead
    return slots, prev, pos, nv


@contextlib.contextmanager
def _count_compiles():
    """Counts XLA backend compiles (every program, whatever compiled it) while the block runs."""
    n = [0]

    def listener(event, duration, **kw):
        del duration, kw
        if event == "/jax/core/compile/backend_compile_duration":
            n[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield n
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_bucket_policy():
    b = buckets.Buckets()
    assert [b.size_for(n) for n in (0, 1, 16, 17, 300, 512, 513)] == [16, 16, 16, 32, 512, 512, 1024]
    lst = buckets.Buckets(sizes=(8, 24, 100))
    assert [lst.size_for(n) for n in (1, 9, 24, 99, 101, 300)] == [8, 24, 24, 100, 128, 512]
    with pytest.raises(ValueError, match="strictly ascending"):
        buckets.Buckets(sizes=(8, 8))
    with pytest.raises(ValueError, match="power of two"):
        buckets.Buckets(minimum=12)


def test_300_token_counts_compile_few_programs_and_match_the_oracle():
    rng = random.Random(12)
    ctx = canary_jax.VerifyOrWriteContext(
        canary_buf=canary_jax.allocate_canary_buffer(N),
        kernel_kind=TAG,
        log=canary_jax.ViolationLog.allocate(ring_capacity=4096),
    )
    st = oracle.State.fresh(N, ring_capacity=4096)
    traces = getattr(launch, "trace_count", lambda op: 0)  # (absent before issue #12: the compile count fails)
    w0, v0 = traces("write"), traces("verify")
    with _count_compiles() as compiles:
        _run_300(ctx, st, rng, compiles)
    # Buckets 16, 32, 64, 128, 256, 512: one program each per op (the old code compiled one per T and op).
    assert launch.trace_count("write") - w0 <= 6
    assert launch.trace_count("verify") - v0 <= 6
    assert launch.live_programs("write") <= launch.MAX_PROGRAMS_PER_OP


def _run_300(ctx, st, rng, compiles):
    """300 write + verify launches, T = C = 1..300; at most 12 compiles (6 buckets x 2 ops) in all."""
    for t in range(1, 301):
        offsets, seeds, nv, ids, pos, loc = _write_case(rng, t)
        cw = len(seeds)
        wplan = canary_jax.WritePlan(
            write_offsets=_pairs(offsets),
            write_seed_slot_indices=_pairs(seeds),
            write_num_valid_reqs=np.array([nv], np.int32),
        )
        exp_pos = [p if rng.random() < 0.9 else p + 1 for p in pos]
        ctx = canary_jax.write(
            ctx,
            wplan,
            np.array(ids),
            np.array(pos),
            np.array(loc),
            enable_write_input_assert=True,
            expected_input_tokens=np.array(ids),
            expected_input_positions=np.array(exp_pos),
            backend="reference",
        )
        oracle.write(
            st, tag=TAG, offsets=offsets, seeds=seeds, input_ids=ids, positions=pos, out_cache_loc=loc,
            num_valid_reqs=nv, input_assert=True, expected_tokens=ids, expected_positions=exp_pos,
        )  # fmt: skip
        assert cw <= 5
        slots, prev, vpos, vnv = _verify_case(rng, t)
        vplan = canary_jax.VerifyPlan.from_entries(slots=slots, positions=vpos, prev_slots=prev, num_valid=vnv)
        ctx = canary_jax.verify(ctx, vplan, backend="reference")
        oracle.verify(st, tag=TAG, slots=slots, positions=vpos, prev_slots=prev, num_valid=vnv)
        assert compiles[0] <= 12, f"{compiles[0]} programs compiled by T={t}"
        if t % 25 == 0 or t < 4:
            _assert_same(_state(ctx), _oracle_state(st), f"T={t}")
    _assert_same(_state(ctx), _oracle_state(st), "end")
    assert st.write_index > 100  # the ring saw real traffic


def _one_launch(backend: str, t: int, seed: int, padded: bool):
    """A write then a verify on a fresh context; ``padded`` goes through the public entry points, otherwise
    the implementation is called directly on the unpadded shapes."""
    rng = random.Random(seed)
    offsets, seeds, nv, ids, pos, loc = _write_case(rng, max(t, 1))
    if t == 0:
        offsets, ids, pos, loc = [0] + [rng.randint(0, 3) for _ in seeds], [], [], []
    slots, prev, vpos, vnv = _verify_case(rng, max(t, 1))
    ctx = canary_jax.VerifyOrWriteContext(
        canary_buf=canary_jax.allocate_canary_buffer(N),
        kernel_kind=TAG,
        log=canary_jax.ViolationLog.allocate(ring_capacity=256),
    )
    wplan = canary_jax.WritePlan(
        write_offsets=jax.numpy.asarray(_pairs(offsets)),
        write_seed_slot_indices=jax.numpy.asarray(_pairs(seeds)),
        write_num_valid_reqs=jax.numpy.asarray(np.array([nv], np.int32)),
    )
    toks = [jax.numpy.asarray(_pairs(x).reshape(-1, 2)) for x in (ids, pos, loc)]
    vplan = canary_jax.VerifyPlan.from_entries(slots=slots, positions=vpos, prev_slots=prev, num_valid=vnv)
    if padded:
        ctx = canary_jax.write(ctx, wplan, *toks, backend=backend)
        ctx = canary_jax.verify(ctx, vplan, backend=backend)
    else:
        ctx = backends.implementation("write", backend)(ctx, wplan, *toks)
        ctx = backends.implementation("verify", backend)(ctx, vplan)
    return _state(ctx)


def _compare(backend: str, sizes) -> None:
    for t in sizes:
        for seed in range(2 if backend == "reference" else 1):
            _assert_same(_one_launch(backend, t, seed, True), _one_launch(backend, t, seed, False), f"{backend} T={t}")


def test_padded_launch_equals_unpadded_reference():
    _compare("reference", (0, 5, 17))


def test_padded_launch_equals_unpadded_pallas():
    """In a child process: each compiled Pallas write keeps ~500 memory mappings on XLA:CPU until the process
    exits (PITFALLS), and the whole suite runs in one process."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    code = "import test_buckets as T; T._compare('pallas', (0, 17)); print('same bytes')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "same bytes" in out.stdout, out.stdout + out.stderr


class _FakeGpu:
    """What a device of another platform reports (the padding must not care)."""

    platform = "gpu"
    id = 0


def test_padding_compiles_nothing_for_device_resident_inputs(monkeypatch):
    """On the H200 the 300-launch test compiled 13 programs by T=5: the plans (``VerifyPlan.from_entries``) live on
    the GPU, and the old padding ran a jitted pad per input length (2 per C: fills 0 and -1) plus an eager
    ``jnp.minimum``, while CPU-resident arrays were padded with numpy. Simulated here on a CPU: the arrays report a
    GPU device while the padding runs. It must compile nothing, place the copies on the launch's device, and
    produce the bytes of the unpadded arrays plus dead rows."""
    from canary_jax.ops import padding

    buf = jax.device_put(np.zeros((N, 32), np.uint8), jax.devices()[0])  # the launch's (committed) device
    cases = []
    for c in range(1, 6):
        vplan = canary_jax.VerifyPlan.from_entries(
            slots=list(range(1, c + 1)), positions=[7] * c, prev_slots=[-1] * c, num_valid=c + 3
        )
        wplan = canary_jax.WritePlan(
            write_offsets=jax.device_put(_pairs([0, c, c + 40])),  # the last offset past T: clamped to T
            write_seed_slot_indices=jax.device_put(_pairs([-1, 5])),
            write_num_valid_reqs=jax.device_put(np.array([9], np.int32)),
        )
        ids = jax.device_put(_pairs(range(100, 100 + c)))
        cases.append((c, vplan, wplan, ids))
    out = []
    monkeypatch.setattr(type(buf), "devices", lambda self: {_FakeGpu()})
    with _count_compiles() as compiles:
        for c, vplan, wplan, ids in cases:
            vp = padding.pad_verify_plan(vplan, 16, device=buf.sharding)
            wp = padding.pad_write_plan(wplan, 16, num_tokens=c, padded_tokens=16, device=buf.sharding)
            out.append((c, vp, wp, padding.pad_rows(ids, 16, fill=0, device=buf.sharding)))
    monkeypatch.undo()
    assert compiles[0] == 0, f"{compiles[0]} programs compiled while padding"
    for c, vp, wp, padded_ids in out:
        for x in (*jax.tree_util.tree_leaves((vp, wp)), padded_ids):
            assert x.devices() == buf.devices()
        slots = canary_jax.pairs_to_int64_np(vp.verify_slot_indices).tolist()
        assert slots == list(range(1, c + 1)) + [0] * (16 - c)
        assert canary_jax.pairs_to_int64_np(vp.verify_expected_tokens).tolist() == [-1] * 16
        assert canary_jax.pairs_to_int64_np(vp.verify_expected_positions).tolist() == [7] * c + [0] * (16 - c)
        assert np.asarray(vp.verify_num_valid).tolist() == [c]  # min(num_valid, C): entries past C stay dead
        assert canary_jax.pairs_to_int64_np(wp.write_offsets).tolist() == [0, c, c] + [c] * 14
        assert canary_jax.pairs_to_int64_np(wp.write_seed_slot_indices).tolist() == [-1, 5] + [-1] * 14
        assert np.asarray(wp.write_num_valid_reqs).tolist() == [2]
        assert canary_jax.pairs_to_int64_np(padded_ids).tolist() == list(range(100, 100 + c)) + [0] * (16 - c)


def test_committed_buffer_compiles_one_program_per_bucket():
    """A canary buffer committed to a device gets its padded inputs there too (committed), so bucket-sized and
    padded launches share one program per bucket: a compiled program is keyed on committedness as well."""
    dev = jax.devices()[0]

    def run(commit: bool):
        rng = random.Random(5)
        buf, log = canary_jax.allocate_canary_buffer(N), canary_jax.ViolationLog.allocate(ring_capacity=256)
        if commit:  # the log too: a launch's outputs are committed where its inputs are
            buf, log = jax.device_put((buf, log), dev)
        ctx = canary_jax.VerifyOrWriteContext(canary_buf=buf, kernel_kind=TAG, log=log)
        with _count_compiles() as compiles:
            for t in (3, 16, 5, 32, 17):  # buckets 16 and 32, sizes at and below them
                offsets, seeds, nv, ids, pos, loc = _write_case(rng, t)
                plan = canary_jax.WritePlan(
                    write_offsets=_pairs(offsets),
                    write_seed_slot_indices=_pairs(seeds),
                    write_num_valid_reqs=np.array([nv], np.int32),
                )
                ctx = canary_jax.write(ctx, plan, np.array(ids), np.array(pos), np.array(loc), backend="reference")
                slots, prev, vpos, vnv = _verify_case(rng, t)
                vplan = canary_jax.VerifyPlan.from_entries(slots=slots, positions=vpos, prev_slots=prev, num_valid=vnv)
                ctx = canary_jax.verify(ctx, vplan, backend="reference")
        return compiles[0], _state(ctx), ctx.canary_buf.committed

    n_committed, committed, still = run(True)
    n_default, default, _ = run(False)
    assert still  # the buffer stays on its device
    assert n_committed == 4, f"{n_committed} programs for 2 buckets (16, 32) x 2 ops"
    assert n_default <= 4  # (fewer when earlier tests in this process compiled them already)
    _assert_same(committed, default, "committed vs default placement")


def test_program_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(launch, "MAX_PROGRAMS_PER_OP", 2)
    ctx = canary_jax.VerifyOrWriteContext(
        canary_buf=canary_jax.allocate_canary_buffer(N), kernel_kind=TAG, log=canary_jax.ViolationLog.allocate()
    )
    before = launch.trace_count("verify")
    for c in (1, 20, 40):  # buckets 16, 32, 64
        plan = canary_jax.VerifyPlan.from_entries(slots=[1] * c, positions=[0] * c, prev_slots=[-1] * c)
        ctx = canary_jax.verify(ctx, plan, backend="reference")
        assert launch.live_programs("verify") <= 2
    assert launch.trace_count("verify") - before == 3
    assert ctx.log.kernel_run_counter(TAG) == 3
