"""Host reads of a sharded canary log (:mod:`canary_jax.runtime.sharded`): each *addressable* shard's ring,
write index and counters as a host :class:`~canary_jax.contract.layout.ViolationLog`, keyed by its shard
``(dp, tp)``. Shared by the sharded report (:mod:`canary_jax.runtime.sharded_report`) and the sharded stats and
health check (:mod:`canary_jax.runtime.sharded_stats`).

In a multi-process run (``jax.distributed``) a process reads only the shards its devices hold.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from canary_jax.contract import layout
from canary_jax.runtime.sharded_layout import Shard


def _shard_of(index: tuple) -> Shard:
    return (index[0].start or 0, index[1].start or 0)


def _by_shard(x: jax.Array) -> dict[Shard, Any]:
    """This process's shards of a ``[dp, tp, ...]`` array: ``{(dp, tp): device block without the two axes}``."""
    return {_shard_of(s.index): s.data for s in x.addressable_shards}


def shard_logs(log: layout.ViolationLog) -> dict[Shard, layout.ViolationLog]:
    """The sharded log's addressable shards as host :class:`~canary_jax.contract.layout.ViolationLog` s (numpy leaves).

    One device-to-host copy of each addressable shard's ring, index, counters and launch ticket
    (``jax.device_get``); shards held by other processes are not in the result.

    Raises:
      ValueError: a log whose leaves are not laid out ``[dp, tp, ...]``.
    """
    names = ("ring", "write_index", "slot_run_counters", "kernel_run_counters", "enable_chain_position_assert")
    if log.launch_ticket is not None:
        names += ("launch_ticket",)
    if log.write_index.ndim != 3:
        raise ValueError(
            f"kv-canary: a sharded log has write_index int32[dp, tp, 1], got shape {tuple(log.write_index.shape)}"
        )
    parts = {n: _by_shard(getattr(log, n)) for n in names}
    host = jax.device_get(parts)
    shards = sorted(host["write_index"])
    return {
        s: layout.ViolationLog(**{n: np.asarray(host[n][s]).reshape(np.shape(host[n][s])[2:]) for n in names})
        for s in shards
    }
