"""The sharded child's runs (:mod:`tests.helpers.sharded_child`): ``mesh`` (the sharded canary against the
single-device canary once per shard, two faults, the compiled programs' collectives) and ``multi`` (one of two
``jax.distributed`` processes, a KV fault in the shard process 1 holds).

Imports JAX: only the child imports it, after it has forced the CPU devices and, in ``multi``, started
``jax.distributed``.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import canary_jax as cj
from canary_jax.runtime import sharded
from canary_jax.runtime.report import ViolationReporter
from canary_jax.runtime.state import active_tags
from canary_jax.runtime.step import canary_step, canary_sweep
from tests.helpers.sharded_world import (
    CONFIG,
    DECODES,
    DIM,
    DP,
    HEADS,
    HL,
    KV_SPECS,
    SLOTS,
    TP,
    Workload,
    collectives,
    flip_kv,
    fresh_state,
    sharded_sources,
    sharded_write,
    single_sweep_sources,
    single_write,
    slot_of,
    write_rows,
)


def run_mesh(out: str) -> None:
    lay = sharded.ShardLayout.create(dp=DP, tp=TP)
    canary = sharded.ShardedCanary(lay, CONFIG, kv_specs=KV_SPECS, sources_fn=sharded_sources)
    kv_sharding = NamedSharding(lay.mesh, KV_SPECS)
    state = lay.shard_state(fresh_state())
    pool = jax.device_put(jnp.zeros((DP, SLOTS, HEADS, DIM), jnp.bfloat16), kv_sharding)
    reporter = sharded.ShardedViolationReporter("log")
    monitor = sharded.ShardedViolationMonitor(reporter, delayed=True)
    wl = Workload()
    result: dict = {"messages": [], "records": []}
    # single-device runs, one per shard (its dp shard's requests, its heads)
    single = {(d, t): fresh_state() for d in range(DP) for t in range(TP)}
    spool = {(d, t): jnp.zeros((SLOTS, HL, DIM), jnp.bfloat16) for d in range(DP) for t in range(TP)}

    def pump(step):
        result["messages"] += monitor.step(state.log, step=step)
        result["records"] += [r.as_dict() for r in monitor.last_records]

    step = 0
    hlo_done = False
    for _ in range(1 + DECODES):
        batches = [wl.batch(d) for d in range(DP)]
        sb, n = lay.shard_batch(batches, CONFIG)
        if not hlo_done:
            hlo = jax.jit(lambda s, b, nn, kv: canary.step(s, b, nn, sharded_write, kv)).lower(state, sb, n, pool)
            result["hlo_step"] = collectives(hlo.compile().as_text())

            def head_tail(s, b, nn, kv):
                s, plans = canary.head(s, b, nn, plans=canary.plan(s, b))
                return canary.tail(s, plans, b, nn, kv)

            result["hlo_head_tail"] = collectives(jax.jit(head_tail).lower(state, sb, n, pool).compile().as_text())
            hlo_done = True
        state, pool, summary = canary.step(state, sb, n, sharded_write, pool)
        for (d, t), st in single.items():
            kv = (spool[(d, t)], jnp.array([t * HL], jnp.int32))
            st, kv, _ = canary_step(st, batches[d], single_write, kv, config=CONFIG)
            single[(d, t)], spool[(d, t)] = st, kv[0]
        for d in range(DP):
            wl.advance(d)
        pump(step)
        step += 1

    def sweep_all():
        nonlocal state
        plans = [wl.sweep_plan(d) for d in range(DP)]
        state = canary.sweep(state, (lay.shard_per_dp(plans),), pool)
        for (d, t), st in single.items():
            single[(d, t)] = canary_sweep(
                st, (plans[d],), config=CONFIG, real_kv_sources=single_sweep_sources(spool[(d, t)])
            )
        return plans

    plans = sweep_all()
    result["hlo_sweep"] = collectives(
        jax.jit(lambda s, p, kv: canary.sweep(s, (p,), kv))
        .lower(state, lay.shard_per_dp(plans), pool)
        .compile()
        .as_text()
    )
    result["hlo_consistency"] = collectives(jax.jit(canary.consistency).lower(state).compile().as_text())
    pump(step)
    step += 1
    result["consistency_clean"] = np.asarray(canary.consistency(state)).tolist()

    # fault 1: a KV bit flip in dp shard 1, head 1 (tp shard 0), slot of request 2 position 1
    kv_slot = slot_of(2, 1)
    pool = flip_kv(pool, 1, kv_slot, 1, kv_sharding)
    host = np.asarray(spool[(1, 0)]).copy()
    host.view(np.uint16)[kv_slot, 1, 0] ^= 0x0100
    spool[(1, 0)] = jnp.asarray(host)
    result["kv_fault"] = [1, 0, kv_slot]
    sweep_all()
    pump(step)
    step += 1

    # fault 2: a token flip in shard (0, 1)'s TAIL canary record of request 1 position 2 (bookkeeping on one
    # head shard only: the shard disagrees with its peer)
    tok_slot = slot_of(1, 2)
    k_tail = np.asarray(jax.device_get(state.groups[0].k_tail)).copy()
    k_tail[0, 1, tok_slot, 0] ^= 0x04
    state = state.replace(
        groups=(state.groups[0].with_buffers(k_tail=jax.device_put(k_tail, NamedSharding(lay.mesh, lay.state_spec))),)
    )
    st = single[(0, 1)]
    kt = np.asarray(st.groups[0].k_tail).copy()
    kt[tok_slot, 0] ^= 0x04
    single[(0, 1)] = st.replace(groups=(st.groups[0].with_buffers(k_tail=jnp.asarray(kt)),))
    result["token_fault"] = [0, 1, tok_slot]
    result["consistency_fault"] = np.asarray(canary.consistency(state)).tolist()
    result["disagreement"] = reporter.report_disagreement(canary.consistency(state), step=step)
    batches = [wl.batch(d) for d in range(DP)]
    sb, n = lay.shard_batch(batches, CONFIG)
    state, pool, summary = canary.step(state, sb, n, sharded_write, pool)
    for (d, t), st in single.items():
        kv = (spool[(d, t)], jnp.array([t * HL], jnp.int32))
        st, kv, _ = canary_step(st, batches[d], single_write, kv, config=CONFIG)
        single[(d, t)], spool[(d, t)] = st, kv[0]
    pump(step)
    step += 1
    result["messages"] += monitor.flush(state.log, step=step)
    result["records"] += [r.as_dict() for r in monitor.last_records]

    stats = sharded.sharded_stats(state.log, step=step, sweep_passes=2, active_tags=active_tags(state, sweep=True))
    result["stats_lines"] = stats.lines()
    result["single_messages"] = {
        f"{d},{t}": ViolationReporter("none").messages(st.log, step=0) for (d, t), st in single.items()
    }
    arrays = {}
    for name in ("k_head", "k_tail"):
        glob = np.asarray(jax.device_get(getattr(state.groups[0], name)))
        for (d, t), st in single.items():
            arrays[f"sharded_{name}_{d}{t}"] = glob[d, t]
            arrays[f"single_{name}_{d}{t}"] = np.asarray(getattr(st.groups[0], name))
    for field in ("ring", "write_index", "slot_run_counters", "kernel_run_counters"):
        glob = np.asarray(jax.device_get(getattr(state.log, field)))
        for (d, t), st in single.items():
            arrays[f"sharded_{field}_{d}{t}"] = glob[d, t]
            arrays[f"single_{field}_{d}{t}"] = np.asarray(getattr(st.log, field))
    gpool = np.asarray(jax.device_get(pool))
    for d, t in single:
        arrays[f"sharded_pool_{d}{t}"] = gpool[d, :, t * HL : (t + 1) * HL]
        arrays[f"single_pool_{d}{t}"] = np.asarray(spool[(d, t)])
    # the control: the single-device step under a plain jit on a head-sharded pool (no shard_map)
    lay1 = sharded.ShardLayout.create(dp=1, tp=4)
    hs = NamedSharding(lay1.mesh, P(None, "tp", None))
    pool4 = jax.device_put(jnp.zeros((SLOTS, HEADS, DIM), jnp.bfloat16), hs)
    b0 = Workload().batch(0)

    def plain(st, b, kv):
        def w(kv, b):
            kv = write_rows(kv, b, 0)
            src = cj.RealKvSource(
                tensor=kv.reshape(SLOTS, HEADS * DIM), page_size=1, num_bytes_per_token=HEADS * DIM * 2, read_bytes=32
            )
            return kv, (((src,), ()),)

        return canary_step(st, b, w, kv, config=CONFIG)

    result["hlo_plain_jit"] = collectives(jax.jit(plain).lower(fresh_state(), b0, pool4).compile().as_text())
    result["x64"] = bool(jax.config.jax_enable_x64)
    np.savez(out, json=np.array(json.dumps(result)), **arrays)


def run_multi(out: str, pid: int) -> None:
    lay = sharded.ShardLayout.create(dp=DP, tp=TP)  # jax.devices(): process 0's two devices are dp row 0
    canary = sharded.ShardedCanary(lay, CONFIG, kv_specs=KV_SPECS, sources_fn=sharded_sources)
    kv_sharding = NamedSharding(lay.mesh, KV_SPECS)
    state = lay.shard_state(fresh_state())
    pool = jax.make_array_from_callback(
        (DP, SLOTS, HEADS, DIM), kv_sharding, lambda idx: np.zeros((1, SLOTS, HL, DIM), jnp.bfloat16)
    )
    reporter = sharded.ShardedViolationReporter("log")
    monitor = sharded.ShardedViolationMonitor(reporter, delayed=True)
    wl = Workload()
    msgs: list[str] = []
    records: list = []
    mine = [d for d in range(DP) if any(s[0] == d for s in lay.local_shards())]
    step = 0
    for _ in range(1 + DECODES):
        batches = [wl.batch(d) if d in mine else None for d in range(DP)]
        sb, n = lay.shard_batch(batches, CONFIG, num_tokens=16, num_rows=4)
        state, pool, _ = canary.step(state, sb, n, sharded_write, pool)
        for d in range(DP):
            wl.advance(d)
        msgs += monitor.step(state.log, step=step)
        step += 1
    kv_slot = slot_of(1, 3)
    if pid == 1:  # the fault: a KV bit flip in shard (1, 1)'s heads, made by the process that holds it
        blocks = []
        for s in pool.addressable_shards:
            host = np.asarray(s.data).copy()
            if (s.index[0].start, s.index[2].start) == (1, HL):
                host.view(np.uint16)[0, kv_slot, 0, 3] ^= 0x0001
            blocks.append(jax.device_put(host, s.device))
        pool = jax.make_array_from_single_device_arrays(pool.shape, kv_sharding, blocks)
    else:
        blocks = [s.data for s in pool.addressable_shards]
        pool = jax.make_array_from_single_device_arrays(pool.shape, kv_sharding, blocks)
    plans = [wl.sweep_plan(d) if d in mine else None for d in range(DP)]
    state = canary.sweep(state, (lay.shard_per_dp(plans),), pool)
    msgs += monitor.step(state.log, step=step)
    records += [r.as_dict() for r in monitor.last_records]
    msgs += monitor.flush(state.log, step=step + 1)
    records += [r.as_dict() for r in monitor.last_records]
    stats = sharded.sharded_stats(state.log, step=step, all_processes=True)
    result = {
        "pid": pid,
        "local_shards": [list(s) for s in lay.local_shards()],
        "messages": msgs,
        "records": records,
        "total_line": stats.lines()[-1],
        "kv_fault": [1, 1, kv_slot],
    }
    np.savez(out, json=np.array(json.dumps(result)))
    jax.distributed.shutdown()
