"""The sharded child's ``errors`` run (:mod:`tests.helpers.sharded_child`): the sharded programs' refusals,
saved as ``{case: [error type, text] or None}`` for the parent to assert on.

Imports JAX: only the child imports it, after it has forced the CPU devices.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from canary_jax.runtime import sharded
from tests.helpers.sharded_world import (
    CONFIG,
    DIM,
    DP,
    HEADS,
    KV_SPECS,
    SLOTS,
    TP,
    Workload,
    fresh_state,
    sharded_sources,
    sharded_write,
)


def run_errors(out: str) -> None:
    """Refusals before any shard_map error (issue #14): mis-sharded pools, unsharded or foreign states and
    batches, bad live token counts, None for a held dp shard, no KV in a hashing mode."""
    lay = sharded.ShardLayout.create(dp=DP, tp=TP)
    canary = sharded.ShardedCanary(lay, CONFIG, kv_specs=KV_SPECS, sources_fn=sharded_sources)
    wl = Workload()
    batches = [wl.batch(d) for d in range(DP)]
    sb, n = lay.shard_batch(batches, CONFIG)
    sweep = lay.shard_per_dp([wl.sweep_plan(d) for d in range(DP)])
    zeros = jnp.zeros((DP, SLOTS, HEADS, DIM), jnp.bfloat16)
    good = jax.device_put(zeros, NamedSharding(lay.mesh, KV_SPECS))
    result: dict = {}

    def refused(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the parent asserts the type and text
            result[name] = [type(e).__name__, str(e)]
        else:
            result[name] = None

    state = lay.shard_state(fresh_state())
    state, plans = canary.head(state, sb, n)
    before = jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x)), state)
    wrong = {
        "replicated": P(),
        "transposed": P("tp", None, "dp", None),
        "slots_over_tp": P("dp", "tp", None, None),
    }
    for name, spec in wrong.items():
        pool = jax.device_put(zeros, NamedSharding(lay.mesh, spec))
        refused(f"tail_{name}", lambda pool=pool: canary.tail(state, plans, sb, n, pool))
        refused(f"step_{name}", lambda pool=pool: canary.step(state, sb, n, sharded_write, pool))
        refused(f"sweep_{name}", lambda pool=pool: canary.sweep(state, (sweep,), pool))
        result[f"pool_alive_{name}"] = not pool.is_deleted()
    refused("tail_tree", lambda: canary.tail(state, plans, sb, n, {"k": zeros}))
    after = jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x)), state)
    result["state_unchanged"] = all(
        np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after))
    )
    # the correctly sharded pool still runs (tail, then step, then sweep)
    state, _ = canary.tail(state, plans, sb, n, good)
    state, good, _ = canary.step(state, sb, n, sharded_write, good)
    state = canary.sweep(state, (sweep,), good)
    result["good_ran"] = int(np.asarray(jax.device_get(state.log.kernel_run_counters)).sum()) > 0
    # state / batch / num_tokens refusals
    single = fresh_state()
    refused("head_unsharded_state", lambda: canary.head(single, sb, n))
    refused("plan_unsharded_state", lambda: canary.plan(single, sb))
    refused("consistency_unsharded_state", lambda: canary.consistency(single))
    lay41 = sharded.ShardLayout.create(dp=4, tp=1)
    c41 = sharded.ShardedCanary(lay41, CONFIG, kv_specs=KV_SPECS, sources_fn=sharded_sources)
    refused("head_other_layout", lambda: c41.head(lay.shard_state(fresh_state()), sb, n))
    refused("head_unsharded_batch", lambda: canary.head(lay.shard_state(fresh_state()), batches[0], n))
    refused("head_num_tokens_list", lambda: canary.head(lay.shard_state(fresh_state()), sb, [5, 3]))
    refused("head_num_tokens_len3", lambda: canary.head(lay.shard_state(fresh_state()), sb, jnp.zeros(3, jnp.int32)))
    refused("head_num_tokens_scalar", lambda: canary.head(lay.shard_state(fresh_state()), sb, jnp.int32(5)))
    refused("head_num_tokens_float", lambda: canary.head(lay.shard_state(fresh_state()), sb, jnp.zeros(2)))
    refused("shard_batch_none_held", lambda: lay.shard_batch([batches[0], None], CONFIG))
    refused("shard_per_dp_none_held", lambda: lay.shard_per_dp([wl.sweep_plan(0), None]))
    refused("sweep_kv_none", lambda: canary.sweep(lay.shard_state(fresh_state()), (sweep,), None))
    refused("sweep_unsharded_plan", lambda: canary.sweep(lay.shard_state(fresh_state()), (wl.sweep_plan(0),), good))
    s2 = lay.shard_state(fresh_state())
    s2, p2 = canary.head(s2, sb, n)
    refused("tail_kv_none", lambda: canary.tail(s2, p2, sb, n, None))
    np.savez(out, json=np.array(json.dumps(result)))
