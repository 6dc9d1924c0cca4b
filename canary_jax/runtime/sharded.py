"""The canary on a device mesh: one canary per shard of a sharded KV pool, under ``shard_map``, with one report.

Serving stacks shard the KV pool: tensor parallelism splits KV heads over devices (``tp``), data parallelism
splits requests (``dp``, each shard with its own slot space), large deployments span processes. SGLang runs one
canary per rank; so does this module, on a 2-D :class:`jax.sharding.Mesh` with axes ``(dp, tp)``:

* **State.** :class:`ShardLayout.shard_state` stacks one :class:`~canary_jax.runtime.state.CanaryState` per
  shard: every leaf gets two leading axes ``[dp, tp, ...]`` sharded ``PartitionSpec(dp, tp)``, so each device
  holds exactly its own shard's canary buffers and violation log.
* **Batches.** :func:`ShardLayout.shard_batch` stacks one :class:`~canary_jax.runtime.state.CanaryBatch` per
  dp shard (leaves ``[dp, ...]``, ``PartitionSpec(dp)``, replicated over ``tp``), padded to one bucket shape.
* **Programs.** :class:`ShardedCanary` runs the step API's traced bodies (:mod:`canary_jax.runtime.phases`)
  inside ``shard_map``: plan, HEAD, TAIL, the whole step and the sweep. Each shard hashes only its local KV
  bytes: the caller's ``sources_fn`` / ``kv_write_fn`` see the local block of the pool (its own heads of layer
  0 on a tp shard). No collective touches pool- or canary-sized data (``tests/test_sharded.py`` reads the
  compiled HLO); the step programs have no collective at all.
* **Parity.** A shard's canary bytes, ring and counters are exactly what the single-device canary gives on that
  shard's data (its requests, its heads). Token, position and chain fields are the same on every head shard of
  a dp row (the chain does not include the real-KV hash, SPEC 2.3); only ``real_kv_hash`` differs.
  :meth:`ShardedCanary.consistency` compares a 64-bit digest of those fields between head shards (a ``[tp, 2]``
  uint32 all-gather, nothing pool-sized): a shard that disagrees is itself a finding.
* **One report.** :class:`ShardedViolationReporter` / :class:`ShardedViolationMonitor` read each *addressable*
  shard's log (``jax.Array.addressable_shards``), tag every record with its shard ``(dp, tp)``, and print
  SGLang's text with `` shard=(dp,tp)`` appended. In a multi-process run (``jax.distributed``) a process reads
  only the shards its devices hold, so each violation is reported exactly once, by its owner.
  :func:`sharded_stats` and :class:`ShardedHealthChecker` give stats and the counter health check per shard
  and in total.

Modules (the public names are re-exported here): :mod:`~canary_jax.runtime.sharded_layout` (the mesh, host
data laid out on it, the checks that a value follows it), :mod:`~canary_jax.runtime.sharded_trace`
(``shard_map`` and the traced per-shard pieces), :mod:`~canary_jax.runtime.sharded_canary`
(:class:`ShardedCanary`'s programs), :mod:`~canary_jax.runtime.sharded_logs` (the host reads of each shard's
log), :mod:`~canary_jax.runtime.sharded_report` (the host-side violation report) and
:mod:`~canary_jax.runtime.sharded_stats` (stats and the health check).

Calling contract: each program is jitted once per (layout, config, functions, shapes). HEAD, TAIL and the step
donate the state's canary buffers (use the returned state); the violation log is not donated. Called inside a
caller's ``jit`` the programs inline. Nothing syncs with the host; data faults go to each shard's ring.
"""

from __future__ import annotations

from canary_jax.runtime.sharded_canary import ShardedCanary
from canary_jax.runtime.sharded_layout import Shard as Shard
from canary_jax.runtime.sharded_layout import ShardLayout
from canary_jax.runtime.sharded_logs import shard_logs
from canary_jax.runtime.sharded_report import (
    ShardedViolationMonitor,
    ShardedViolationRecord,
    ShardedViolationReporter,
    format_sharded_violation,
)
from canary_jax.runtime.sharded_report import logger as logger
from canary_jax.runtime.sharded_stats import ShardedHealthChecker, ShardedStats, sharded_stats
from canary_jax.runtime.sharded_trace import fields_digest as fields_digest
from canary_jax.runtime.sharded_trace import shard_map

__all__ = [
    "ShardLayout",
    "ShardedCanary",
    "ShardedHealthChecker",
    "ShardedStats",
    "ShardedViolationMonitor",
    "ShardedViolationRecord",
    "ShardedViolationReporter",
    "format_sharded_violation",
    "shard_logs",
    "shard_map",
    "sharded_stats",
]
