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

Calling contract: each program is jitted once per (layout, config, functions, shapes). HEAD, TAIL and the step
donate the state's canary buffers (use the returned state); the violation log is not donated. Called inside a
caller's ``jit`` the programs inline. Nothing syncs with the host; data faults go to each shard's ring.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from canary_jax import constants, decode, ints, layout
from canary_jax.runtime import phases, shapes
from canary_jax.runtime.report import (
    CanaryStats,
    CanaryViolationError,
    HealthChecker,
    ViolationReporter,
    _snapshot,
    format_stats,
    log_or_raise_messages,
    validate_mode,
)
from canary_jax.runtime.state import CanaryBatch, CanaryPlans, CanaryState, CanaryStepConfig, StepSummary
from canary_jax.runtime.step import _check_batch, _check_config, _check_state

try:  # jax >= 0.6: the public name
    _shard_map_fn = jax.shard_map
    _SHARD_MAP_CHECK = "check_vma"
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map_fn

    _SHARD_MAP_CHECK = "check_rep"

logger = logging.getLogger("canary_jax")

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

Shard = tuple[int, int]


def shard_map(f: Callable, *, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """``jax.shard_map`` (or ``jax.experimental.shard_map.shard_map`` on older jax) with replication checks off
    (the canary's kernels are per-shard programs; nothing is replicated by a collective)."""
    return _shard_map_fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{_SHARD_MAP_CHECK: False})


# --- layout -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShardLayout:
    """The mesh the canary shards over: axis ``dp_axis`` splits requests, ``tp_axis`` splits KV heads.

    Fields:
      mesh: a 2-D :class:`jax.sharding.Mesh` whose axis names are ``(dp_axis, tp_axis)`` in that order (either
        axis may have size 1). In a multi-process run it is the global mesh (every process builds the same one).
      dp_axis, tp_axis: the axis names (default ``"dp"``, ``"tp"``).

    Raises:
      TypeError: ``mesh`` not a Mesh.
      ValueError: the mesh's axis names are not exactly ``(dp_axis, tp_axis)``.
    """

    mesh: Mesh
    dp_axis: str = "dp"
    tp_axis: str = "tp"

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"kv-canary: ShardLayout.mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
        if tuple(self.mesh.axis_names) != (self.dp_axis, self.tp_axis):
            raise ValueError(
                f"kv-canary: ShardLayout.mesh axis names must be ({self.dp_axis!r}, {self.tp_axis!r}), "
                f"got {tuple(self.mesh.axis_names)}"
            )

    @classmethod
    def create(cls, *, dp: int, tp: int, devices: Sequence[Any] | None = None) -> ShardLayout:
        """A ``dp x tp`` mesh over ``devices`` (default ``jax.devices()``, i.e. every process's devices in a
        multi-process run, process-major), axes ``("dp", "tp")``.

        Raises:
          ValueError: ``dp`` or ``tp`` not positive, or ``dp * tp`` not the number of devices.
        """
        dp, tp = ints.check_int(dp, name="dp"), ints.check_int(tp, name="tp")
        if dp <= 0 or tp <= 0:
            raise ValueError(f"kv-canary: dp and tp must be positive, got dp={dp} tp={tp}")
        devs = list(jax.devices() if devices is None else devices)
        if len(devs) != dp * tp:
            raise ValueError(f"kv-canary: a {dp}x{tp} mesh needs {dp * tp} devices, got {len(devs)}")
        return cls(mesh=Mesh(np.array(devs, dtype=object).reshape(dp, tp), ("dp", "tp")))

    @property
    def num_dp(self) -> int:
        """The number of dp shards: the size of the mesh's ``dp_axis`` (request groups, each with its own slot
        space)."""
        return int(self.mesh.shape[self.dp_axis])

    @property
    def num_tp(self) -> int:
        """The number of tp (head) shards: the size of the mesh's ``tp_axis`` (each holds ``heads / num_tp`` KV
        heads)."""
        return int(self.mesh.shape[self.tp_axis])

    @property
    def shards(self) -> tuple[Shard, ...]:
        """Every shard ``(dp, tp)``, row-major."""
        return tuple((d, t) for d in range(self.num_dp) for t in range(self.num_tp))

    @property
    def state_spec(self) -> P:
        """``PartitionSpec(dp, tp)``: the leading two axes of every per-shard leaf."""
        return P(self.dp_axis, self.tp_axis)

    @property
    def batch_spec(self) -> P:
        """``PartitionSpec(dp)``: per-dp-shard leaves, replicated over tp."""
        return P(self.dp_axis)

    def local_shards(self) -> tuple[Shard, ...]:
        """The shards ``(dp, tp)`` whose device belongs to this process (all of them in a single-process run),
        row-major: the shards this process's reports and stats cover, and the dp shards whose batches (and
        :meth:`shard_per_dp` entries) it must give."""
        me = jax.process_index()
        devs = self.mesh.devices
        return tuple((d, t) for d, t in self.shards if devs[d, t].process_index == me)

    def _check_held(self, entries: Sequence[Any], who: str) -> None:
        """A None entry is allowed only for a dp shard no device of this process holds."""
        held = {d for d, _ in self.local_shards()}
        for d, x in enumerate(entries):
            if x is None and d in held:
                raise ValueError(
                    f"kv-canary: {who}: dp shard {d} is held by this process; got None (None is only for dp shards "
                    "that another process holds)"
                )

    def _global(self, leading: int, template: np.ndarray | None, block: Callable[[int, int], np.ndarray]) -> jax.Array:
        spec = self.state_spec if leading == 2 else self.batch_spec
        shape = ((self.num_dp, self.num_tp) if leading == 2 else (self.num_dp,)) + tuple(template.shape)
        sharding = NamedSharding(self.mesh, spec)

        def cb(index):
            d = index[0].start or 0
            t = (index[1].start or 0) if leading == 2 else 0
            x = np.asarray(block(d, t))
            return x.reshape((1,) * leading + x.shape)

        return jax.make_array_from_callback(shape, sharding, cb)

    def shard_state(self, state: CanaryState | Callable[[int, int], CanaryState]) -> CanaryState:
        """A per-shard CanaryState on the mesh: every leaf ``[dp, tp, *leaf_shape]``, ``PartitionSpec(dp, tp)``.

        Args:
          state: one CanaryState every shard starts from (e.g. fresh zero buffers), or ``fn(dp, tp)`` returning
            that shard's state (same shapes for every shard; called only for this process's shards, plus once
            for ``(0, 0)`` as the shape template).

        Returns:
          The sharded state (a CanaryState whose leaves carry the two leading shard axes; pass it to
          :class:`ShardedCanary`'s programs, never to the single-device step API).

        Raises:
          TypeError: not a CanaryState (or the function does not return one).
        """
        make = state if callable(state) and not isinstance(state, CanaryState) else (lambda d, t: state)
        template = make(0, 0)
        if not isinstance(template, CanaryState):
            raise TypeError(f"kv-canary: shard_state needs a CanaryState, got {type(template).__name__}")
        leaves, treedef = jax.tree_util.tree_flatten(template)
        cache: dict[Shard, list] = {(0, 0): [np.asarray(x) for x in leaves]}

        def leaf(i):
            def block(d, t):
                if (d, t) not in cache:
                    cache[(d, t)] = [np.asarray(x) for x in jax.tree_util.tree_leaves(make(d, t))]
                return cache[(d, t)][i]

            return block

        out = [self._global(2, cache[(0, 0)][i], leaf(i)) for i in range(len(leaves))]
        return jax.tree_util.tree_unflatten(treedef, out)

    def shard_batch(
        self,
        batches: Sequence[CanaryBatch | None],
        config: CanaryStepConfig,
        *,
        num_tokens: int | None = None,
        num_rows: int | None = None,
    ) -> tuple[CanaryBatch, jax.Array]:
        """One batch per dp shard, padded to one shape and laid out ``[dp, ...]`` (``PartitionSpec(dp)``).

        Args:
          batches: ``num_dp`` CanaryBatches (host data), dp shard ``d``'s requests in its own slot space; None for
            a dp shard that no device of this process holds (multi-process runs). Every batch's tables
            (``req_to_token``, the expected-token pool) must have one shape.
          config: the step config (its buckets pick the padded shapes).
          num_tokens, num_rows: the padded token count T and row count bs; default: the buckets of the largest
            given batch. In a multi-process run pass them, so that every process builds the same global shape.

        Returns:
          ``(batch, live_tokens)``: the stacked batch (leaves ``[dp, ...]``) and ``int32[dp]`` live token counts
          (padding tokens past them are never written or counted).

        Raises:
          ValueError: not one entry per dp shard, no batch at all, None for a dp shard this process holds, a
            batch larger than ``num_tokens`` / ``num_rows``, or tables of different shapes.
          TypeError: an entry that is not a CanaryBatch or None.
        """
        config = _check_config(config)
        batches = list(batches)
        if len(batches) != self.num_dp:
            raise ValueError(
                f"kv-canary: shard_batch needs {self.num_dp} batches (one per dp shard), got {len(batches)}"
            )
        given = [b for b in batches if b is not None]
        if not given:
            raise ValueError("kv-canary: shard_batch got no batch")
        self._check_held(batches, "shard_batch")
        for b in given:
            _check_batch(b, config)
        shapes_ = [shapes.padded_batch_shape(b, config) for b in given]
        t = max(s[0] for s in shapes_) if num_tokens is None else int(num_tokens)
        rows = max(s[1] for s in shapes_) if num_rows is None else int(num_rows)
        padded: list[Any] = []
        for d, b in enumerate(batches):
            if b is None:
                padded.append(None)
                continue
            if b.num_tokens > t or b.batch_size > rows:
                raise ValueError(
                    f"kv-canary: dp shard {d}'s batch has {b.num_tokens} tokens and {b.batch_size} rows, more than "
                    f"num_tokens={t} / num_rows={rows}"
                )
            pb = shapes.pad_batch(b, num_tokens=t, num_rows=rows)
            padded.append(jax.tree_util.tree_map(np.asarray, pb))
        first = next(p for p in padded if p is not None)
        leaves0, treedef = jax.tree_util.tree_flatten(first)
        per = [None if p is None else jax.tree_util.tree_leaves(p) for p in padded]
        for d, ls in enumerate(per):
            if ls is not None and [x.shape for x in ls] != [x.shape for x in leaves0]:
                raise ValueError(f"kv-canary: dp shard {d}'s batch tables differ in shape from the others")
        out = [self._global(1, leaves0[i], lambda d, _t, i=i: per[d][i]) for i in range(len(leaves0))]
        live = np.array([0 if b is None else b.num_tokens for b in batches], np.int32)
        n = self._global(1, np.zeros((), np.int32), lambda d, _t: live[d])
        return jax.tree_util.tree_unflatten(treedef, out), n

    def shard_per_dp(self, trees: Sequence[Any]) -> Any:
        """Any pytree given once per dp shard (e.g. sweep :class:`~canary_jax.plans.VerifyPlan` s of equal
        capacity; None for dp shards this process does not hold) as one pytree of ``[dp, ...]`` leaves,
        ``PartitionSpec(dp)``.

        Raises:
          ValueError: not one entry per dp shard, none given, None for a dp shard this process holds, or leaves
            of different shapes.
        """
        trees = list(trees)
        if len(trees) != self.num_dp:
            raise ValueError(f"kv-canary: need {self.num_dp} entries (one per dp shard), got {len(trees)}")
        given = [x for x in trees if x is not None]
        if not given:
            raise ValueError("kv-canary: shard_per_dp got no entry")
        self._check_held(trees, "shard_per_dp")
        leaves0, treedef = jax.tree_util.tree_flatten(jax.tree_util.tree_map(np.asarray, given[0]))
        per = [None if x is None else [np.asarray(v) for v in jax.tree_util.tree_leaves(x)] for x in trees]
        for d, ls in enumerate(per):
            if ls is not None and [v.shape for v in ls] != [v.shape for v in leaves0]:
                raise ValueError(f"kv-canary: dp shard {d}'s entry differs in shape from the others")
        out = [self._global(1, leaves0[i], lambda d, _t, i=i: per[d][i]) for i in range(len(leaves0))]
        return jax.tree_util.tree_unflatten(treedef, out)


# --- the per-shard programs -----------------------------------------------------------------------------------
def _local2(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x[0, 0], tree)


def _local1(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def _global2(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x[None, None], tree)


def _specs(tree: Any, spec: P) -> Any:
    return jax.tree_util.tree_map(lambda _: spec, tree)


_DIGEST_SEEDS = (0x9E3779B9, 0x85EBCA6B)


def _mix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser (uint32 in, uint32 out)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def fields_digest(state: CanaryState) -> jax.Array:
    """``uint32[2]``: a digest of every canary buffer's token, position and prev_hash fields (not real_kv_hash)
    of one shard's (unsharded) state: ``sum_i mix32(word_i ^ mix32(i + seed))`` for two seeds, wrapping.

    Equal on every head shard of one dp row when their bookkeeping agrees (SPEC 2.3: the chain leaves out the
    real-KV hash). Reads the shard's own canary buffers only (traced; no collective).
    """
    out = []
    for seed in _DIGEST_SEEDS:
        acc = jnp.zeros((), jnp.uint32)
        salt = 0
        for g in state.groups:
            for name in phases._BUFFERS:
                buf = getattr(g, name)
                if buf is None:
                    continue
                w = layout.canary_words(buf)[:, : 2 * constants.CANARY_FIELD_REAL_KV_HASH]
                idx = jnp.arange(w.size, dtype=jnp.uint32).reshape(w.shape) + jnp.uint32((seed + salt) & 0xFFFFFFFF)
                acc = acc + jnp.sum(_mix32(w ^ _mix32(idx)), dtype=jnp.uint32)
                salt += 0x1000193
        out.append(acc)
    return jnp.stack(out)


_PROGRAMS: dict[Any, Callable] = {}
_MAX_PROGRAMS = 64


def _hashable(tree: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: isinstance(x, P))
    return (treedef, tuple(leaves))


class ShardedCanary:
    """The step API on a mesh: plan, HEAD, TAIL, step, sweep and the head-shard consistency check, each one
    jitted ``shard_map`` program running :mod:`canary_jax.runtime.phases`' traced bodies on every shard.

    Args:
      layout: the :class:`ShardLayout`.
      config: the static :class:`~canary_jax.runtime.state.CanaryStepConfig` (shared by every shard).
      kv_specs: PartitionSpec pytree of the KV state (e.g. ``P("dp", None, "tp", None)`` for a
        ``[dp, slots, heads, head_dim]`` layer-0 pool: requests over dp, heads over tp). Its local block is
        what ``sources_fn`` and ``kv_write_fn`` see. None if no call takes KV data.
      sources_fn: ``sources_fn(kv_local) -> real_kv_sources`` (one ``(sources_k, sources_v)`` pair per group,
        as :func:`~canary_jax.runtime.step.canary_tail` takes them) built on the shard's *local* block: a head
        shard fingerprints only its own heads' bytes. Traced inside ``shard_map``; hashable (a module-level
        function). None in NONE mode.

    Every method takes the sharded state (:meth:`ShardLayout.shard_state`), the stacked batch and live token
    counts (:meth:`ShardLayout.shard_batch`), and returns sharded results (leaves ``[dp, tp, ...]``:
    :class:`~canary_jax.runtime.state.CanaryPlans`, :class:`~canary_jax.runtime.state.StepSummary`).

    Raises:
      TypeError: bad layout or config; not callable functions.
    """

    def __init__(
        self,
        layout: ShardLayout,
        config: CanaryStepConfig,
        *,
        kv_specs: Any = None,
        sources_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        if not isinstance(layout, ShardLayout):
            raise TypeError(f"kv-canary: layout must be a ShardLayout, got {type(layout).__name__}")
        self.layout = layout
        self.config = _check_config(config)
        self.kv_specs = kv_specs
        if sources_fn is not None and not callable(sources_fn):
            raise TypeError(f"kv-canary: sources_fn must be callable, got {type(sources_fn).__name__}")
        self.sources_fn = sources_fn

    # -- helpers
    def _sources(self, kv_local: Any, state: CanaryState, who: str) -> tuple:
        srcs = None if self.sources_fn is None or kv_local is None else self.sources_fn(kv_local)
        return phases.check_sources(srcs, state, self.config, who)

    def _check_state(self, state: Any, who: str) -> None:
        """A sharded state of this layout: every leaf ``[num_dp, num_tp, ...]`` (before any shard_map error)."""
        _check_state(state)
        want = (self.layout.num_dp, self.layout.num_tp)
        wi = tuple(state.log.write_index.shape)
        if len(wi) != 3:
            raise ValueError(
                f"kv-canary: {who}: state is not sharded (its log.write_index has shape {wi}; a sharded state's "
                f"leaves are [dp, tp, ...]); build it with layout.shard_state(state)"
            )
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            shape = tuple(getattr(leaf, "shape", ()))
            if shape[:2] != want:
                raise ValueError(
                    f"kv-canary: {who}: state is sharded for another layout (state{jax.tree_util.keystr(path)} has "
                    f"shape {shape}, leading axes [dp, tp] = {shape[:2]}; this canary's layout is "
                    f"dp={want[0]} x tp={want[1]}); build it with this layout's shard_state"
                )

    def _check_batch_only(self, batch: Any, who: str) -> None:
        """A batch from this layout's :meth:`ShardLayout.shard_batch` (leaves ``[dp, ...]``)."""
        dp = self.layout.num_dp
        if not isinstance(batch, CanaryBatch):
            raise TypeError(
                f"kv-canary: {who}: batch must be a CanaryBatch (layout.shard_batch), got {type(batch).__name__}"
            )
        r2t = tuple(getattr(batch.req_to_token, "shape", np.shape(batch.req_to_token)))
        if len(r2t) != 3 or r2t[0] != dp:
            raise ValueError(
                f"kv-canary: {who}: batch is not sharded for this layout (its req_to_token has shape {r2t}, a "
                f"sharded batch's is [dp={dp}, rows, len]); build it with layout.shard_batch(batches, config)"
            )

    def _check_batch(self, batch: Any, num_tokens: Any, who: str) -> None:
        """A batch and live token counts from this layout's :meth:`ShardLayout.shard_batch`."""
        self._check_batch_only(batch, who)
        dp = self.layout.num_dp
        if num_tokens is None or not hasattr(num_tokens, "shape") or not hasattr(num_tokens, "dtype"):
            raise TypeError(
                f"kv-canary: {who}: num_tokens must be an int32[{dp}] array (layout.shard_batch's live token "
                f"counts), got {type(num_tokens).__name__}"
            )
        if tuple(num_tokens.shape) != (dp,) or np.dtype(num_tokens.dtype) != np.int32:
            raise ValueError(
                f"kv-canary: {who}: num_tokens must be an int32[{dp}] array (layout.shard_batch's live token "
                f"counts), got {np.dtype(num_tokens.dtype).name}{list(num_tokens.shape)}"
            )

    def _check_kv(self, kv_state: Any, kv_specs: Any, state: CanaryState, who: str) -> None:
        """``kv_state`` given when hashing, and every concrete leaf already laid out as ``kv_specs`` says (else
        XLA would reshard the pool with pool-sized collectives before the shard_map)."""
        if kv_state is None:
            phases.check_sources(None, state, self.config, who)  # raises in a hashing mode
            return
        if kv_specs is None:
            return
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        try:
            full = jax.tree_util.tree_map(
                lambda spec, sub: jax.tree_util.tree_map(lambda _: spec, sub), kv_specs, kv_state, is_leaf=is_spec
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"kv-canary: {who}: kv_state's structure does not match kv_specs: {e}") from None
        specs = jax.tree_util.tree_leaves(full, is_leaf=is_spec)
        leaves = jax.tree_util.tree_flatten_with_path(kv_state)[0]
        for (path, leaf), spec in zip(leaves, specs):
            if not isinstance(leaf, jax.Array) or shapes.is_traced(leaf):
                continue
            expected = NamedSharding(self.layout.mesh, spec)
            try:
                ok = leaf.sharding.is_equivalent_to(expected, leaf.ndim)
            except Exception:  # noqa: BLE001 - a spec longer than the leaf: shard_map names it
                continue
            if not ok:
                raise ValueError(
                    f"kv-canary: {who}: kv_state{jax.tree_util.keystr(path)} is sharded {leaf.sharding}, not as "
                    f"kv_specs says ({spec} on the layout's mesh); XLA would move the whole pool with collectives. "
                    f"Place it with jax.device_put(x, NamedSharding(layout.mesh, {spec}))"
                )

    def _program(self, key: Any, build: Callable[[], Callable]) -> Callable:
        """The jitted program ``key`` of this (layout, config, kv_specs, sources_fn): built once per process and
        shared by every ShardedCanary of equal settings (a new canary does not recompile)."""
        full = (self.layout, self.config, _hashable(self.kv_specs), self.sources_fn, key)
        prog = _PROGRAMS.get(full)
        if prog is None:
            if len(_PROGRAMS) >= _MAX_PROGRAMS:
                _PROGRAMS.pop(next(iter(_PROGRAMS)))
            prog = _PROGRAMS[full] = build()
        return prog

    def _need_kv_specs(self) -> Any:
        if self.kv_specs is None:
            raise ValueError("kv-canary: this call reads KV data; pass kv_specs= to ShardedCanary")
        return self.kv_specs

    # -- programs
    def plan(self, state: CanaryState, batch: CanaryBatch) -> CanaryPlans:
        """Every shard's per-forward plans (:func:`~canary_jax.runtime.step.canary_plan` per shard).

        Returns:
          CanaryPlans with leaves ``[dp, tp, ...]`` (equal over tp).

        Raises:
          TypeError: ``state`` not a CanaryState, ``batch`` not a CanaryBatch.
          ValueError: a state not sharded for this layout (use :meth:`ShardLayout.shard_state`), a batch not
            from :meth:`ShardLayout.shard_batch`, or donated state buffers.
        """
        self._check_state(state, "ShardedCanary.plan")
        self._check_batch_only(batch, "ShardedCanary.plan")
        lay, cfg = self.layout, self.config

        def build():
            def body(shell, b):
                p = phases.plan_impl(_local2(shell), _local1(b), cfg)
                return _global2(p)

            def run(shell, b):
                out_specs = _specs(jax.eval_shape(lambda: _plans_shape(shell, b, cfg)), lay.state_spec)
                return shard_map(
                    body,
                    mesh=lay.mesh,
                    in_specs=(_specs(shell, lay.state_spec), _specs(b, lay.batch_spec)),
                    out_specs=out_specs,
                )(shell, b)

            return jax.jit(run)

        return self._program("plan", build)(phases.split(state)[1], batch)

    def head(
        self, state: CanaryState, batch: CanaryBatch, num_tokens: jax.Array, *, plans: CanaryPlans | None = None
    ) -> tuple[CanaryState, CanaryPlans]:
        """Every shard's HEAD (plan unless ``plans`` given, then verify + write), as
        :func:`~canary_jax.runtime.step.canary_head` on each shard's data.

        Args:
          state: the sharded state (its canary buffers are donated: use the returned state).
          batch, num_tokens: from :meth:`ShardLayout.shard_batch` (``num_tokens``: ``int32[dp]`` live tokens).
          plans: sharded plans from :meth:`plan`, or None.

        Returns:
          ``(state, plans)``, both sharded ``[dp, tp, ...]``.

        Raises:
          TypeError: ``state`` / ``batch`` of the wrong type, ``num_tokens`` not an array.
          ValueError: a state not sharded for this layout (use :meth:`ShardLayout.shard_state`), a batch not
            from :meth:`ShardLayout.shard_batch`, ``num_tokens`` not ``int32[dp]``, or donated state buffers.
        """
        self._check_state(state, "ShardedCanary.head")
        self._check_batch(batch, num_tokens, "ShardedCanary.head")
        lay, cfg = self.layout, self.config
        have_plans = plans is not None

        def build():
            def body(bufs, shell, b, n, p):
                st = phases.join(_local2(bufs), _local2(shell))
                st, pl = phases.head_impl(st, _local1(b), None if p is None else _local2(p), n[0], cfg)
                nb, ns = phases.split(st)
                return _global2(nb), _global2(ns), _global2(pl)

            def run(bufs, shell, b, n, p):
                s2, s1 = lay.state_spec, lay.batch_spec
                pl_shape = jax.eval_shape(lambda: _plans_shape(shell, b, cfg))
                return shard_map(
                    body,
                    mesh=lay.mesh,
                    in_specs=(_specs(bufs, s2), _specs(shell, s2), _specs(b, s1), s1, _specs(p, s2)),
                    out_specs=(_specs(bufs, s2), _specs(shell, s2), _specs(pl_shape, s2)),
                )(bufs, shell, b, n, p)

            return jax.jit(run, donate_argnums=(0,))

        bufs, shell = phases.split(state)
        nb, ns, pl = self._program(("head", have_plans), build)(bufs, shell, batch, num_tokens, plans)
        return phases.join(nb, ns), pl

    def tail(
        self, state: CanaryState, plans: CanaryPlans, batch: CanaryBatch, num_tokens: jax.Array, kv_state: Any
    ) -> tuple[CanaryState, StepSummary]:
        """Every shard's TAIL (verify + write with the real-KV fingerprint of ``sources_fn(local kv block)``), as
        :func:`~canary_jax.runtime.step.canary_tail` on each shard's data.

        Args:
          state, plans: from :meth:`head` (the state's canary buffers are donated).
          batch, num_tokens: the same stacked batch.
          kv_state: the global (sharded by ``kv_specs``) KV state *after* the model's write; read only.

        Returns:
          ``(state, summary)``; the summary's leaves are ``[dp, tp, ...]``.

        Raises:
          ValueError / TypeError: a hashing mode without ``kv_state`` or sources, bad sources (while tracing,
            before anything runs), or no ``kv_specs``; the state, batch or ``num_tokens`` as :meth:`head`.
          ValueError: a ``kv_state`` leaf not sharded as ``kv_specs`` says (nothing runs; the state is kept).
        """
        self._check_state(state, "ShardedCanary.tail")
        self._check_batch(batch, num_tokens, "ShardedCanary.tail")
        lay, cfg = self.layout, self.config
        kv_specs = self._need_kv_specs() if kv_state is not None else None
        self._check_kv(kv_state, kv_specs, state, "ShardedCanary.tail")

        def build():
            def body(bufs, shell, p, b, n, kv):
                st = phases.join(_local2(bufs), _local2(shell))
                srcs = self._sources(kv, st, "ShardedCanary.tail")
                st, summary = phases.tail_impl(st, _local2(p), _local1(b), srcs, n[0], cfg)
                nb, ns = phases.split(st)
                return _global2(nb), _global2(ns), _global2(summary)

            def run(bufs, shell, p, b, n, kv):
                s2, s1 = lay.state_spec, lay.batch_spec
                return shard_map(
                    body,
                    mesh=lay.mesh,
                    in_specs=(_specs(bufs, s2), _specs(shell, s2), _specs(p, s2), _specs(b, s1), s1, kv_specs),
                    out_specs=(_specs(bufs, s2), _specs(shell, s2), _summary_specs(s2)),
                )(bufs, shell, p, b, n, kv)

            return jax.jit(run, donate_argnums=(0,))

        bufs, shell = phases.split(state)
        nb, ns, summary = self._program("tail", build)(bufs, shell, plans, batch, num_tokens, kv_state)
        return phases.join(nb, ns), summary

    def step(
        self,
        state: CanaryState,
        batch: CanaryBatch,
        num_tokens: jax.Array,
        kv_write_fn: Callable[[Any, CanaryBatch], tuple[Any, Any]],
        kv_state: Any,
    ) -> tuple[CanaryState, Any, StepSummary]:
        """One protected forward on every shard in one program: plan + HEAD, ``kv_write_fn`` on the shard's
        local KV block, TAIL (:func:`~canary_jax.runtime.step.canary_step` per shard).

        Args:
          state: the sharded state (canary buffers donated).
          batch, num_tokens: from :meth:`ShardLayout.shard_batch`.
          kv_write_fn: ``kv_write_fn(kv_local, batch_local) -> (kv_local, real_kv_sources)``, traced inside
            ``shard_map`` on the shard's local block (``jax.lax.axis_index(layout.tp_axis)`` names its head
            shard) and its dp shard's batch; hashable (module-level). ``sources_fn`` is not used here.
          kv_state: the global KV state, sharded by ``kv_specs`` (donated).

        Returns:
          ``(state, kv_state, summary)``.

        Raises:
          TypeError: ``kv_write_fn`` not callable; the state, batch or ``num_tokens`` as :meth:`head`.
          ValueError: no ``kv_specs``; a ``kv_state`` leaf not sharded as ``kv_specs`` says (nothing runs,
            nothing is donated); the state, batch or ``num_tokens`` as :meth:`head`.
        """
        self._check_state(state, "ShardedCanary.step")
        self._check_batch(batch, num_tokens, "ShardedCanary.step")
        if not callable(kv_write_fn):
            raise TypeError(f"kv-canary: kv_write_fn must be callable, got {type(kv_write_fn).__name__}")
        lay, cfg = self.layout, self.config
        kv_specs = self._need_kv_specs()
        self._check_kv(kv_state, kv_specs, state, "ShardedCanary.step")

        def build():
            def body(bufs, shell, b, n, kv):
                st = phases.join(_local2(bufs), _local2(shell))
                st, kv, summary = phases.step_impl(st, _local1(b), kv_write_fn, kv, n[0], cfg)
                nb, ns = phases.split(st)
                return _global2(nb), _global2(ns), kv, _global2(summary)

            def run(bufs, shell, b, n, kv):
                s2, s1 = lay.state_spec, lay.batch_spec
                return shard_map(
                    body,
                    mesh=lay.mesh,
                    in_specs=(_specs(bufs, s2), _specs(shell, s2), _specs(b, s1), s1, kv_specs),
                    out_specs=(_specs(bufs, s2), _specs(shell, s2), kv_specs, _summary_specs(s2)),
                )(bufs, shell, b, n, kv)

            return jax.jit(run, donate_argnums=(0, 4))

        bufs, shell = phases.split(state)
        nb, ns, kv_state, summary = self._program(("step", kv_write_fn), build)(
            bufs, shell, batch, num_tokens, kv_state
        )
        return phases.join(nb, ns), kv_state, summary

    def sweep(self, state: CanaryState, sweep_plans: Sequence[Any], kv_state: Any) -> CanaryState:
        """Every shard's SWEEP verify (:func:`~canary_jax.runtime.step.canary_sweep` per shard).

        Args:
          state: the sharded state (nothing donated; only the log changes).
          sweep_plans: one entry per group: a VerifyPlan laid out per dp shard (:meth:`ShardLayout.shard_per_dp`
            of each dp shard's plan; equal capacities), or None to skip the group.
          kv_state: the global KV state, sharded by ``kv_specs``; read only.

        Returns:
          The state with every shard's new log.

        Raises:
          ValueError: not one plan entry per group; a plan not laid out per dp shard; a state not sharded for
            this layout; no ``kv_specs``; a hashing mode without ``kv_state``; a ``kv_state`` leaf not sharded as
            ``kv_specs`` says.
          TypeError: ``state`` not a CanaryState; bad sources (while tracing).
        """
        self._check_state(state, "ShardedCanary.sweep")
        sweep_plans = tuple(sweep_plans)
        if len(sweep_plans) != len(state.groups):
            raise ValueError(f"kv-canary: sweep_plans has {len(sweep_plans)} entries for {len(state.groups)} groups")
        lay, cfg = self.layout, self.config
        for g, plan in enumerate(sweep_plans):
            if plan is None:
                continue
            slots = getattr(plan, "verify_slot_indices", None)
            if slots is None or slots.ndim != 3 or int(slots.shape[0]) != lay.num_dp:
                raise ValueError(
                    f"kv-canary: ShardedCanary.sweep: sweep_plans[{g}] must be laid out per dp shard "
                    f"(verify_slot_indices [{lay.num_dp}, C, 2], from layout.shard_per_dp), got "
                    f"{None if slots is None else tuple(slots.shape)}"
                )
        kv_specs = self._need_kv_specs() if kv_state is not None else None
        self._check_kv(kv_state, kv_specs, state, "ShardedCanary.sweep")

        def build():
            def body(st, sp, kv):
                st = _local2(st)
                srcs = self._sources(kv, st, "ShardedCanary.sweep")
                log = phases.sweep_impl(st, _local1(sp), srcs, cfg)
                return _global2(log)

            def run(st, sp, kv):
                s2, s1 = lay.state_spec, lay.batch_spec
                return shard_map(
                    body,
                    mesh=lay.mesh,
                    in_specs=(_specs(st, s2), _specs(sp, s1), kv_specs),
                    out_specs=_specs(st.log, s2),
                )(st, sp, kv)

            return jax.jit(run)

        key = ("sweep", tuple(p is None for p in sweep_plans))
        return state.replace(log=self._program(key, build)(state, sweep_plans, kv_state))

    def consistency(self, state: CanaryState) -> jax.Array:
        """Per shard, how many head shards of its dp row hold token / position / chain fields that differ from
        its own (:func:`fields_digest`; 0 everywhere when the head shards agree).

        Each shard digests its own canary buffers (no pool data moves) and the ``uint32[2]`` digests are
        all-gathered over ``tp`` (``[tp, 2]`` words, the one collective of this module).

        Returns:
          ``int32[dp, tp]`` (sharded like the state): disagreeing peers per shard. A nonzero entry is a finding
          (:meth:`ShardedViolationReporter.report_disagreement` reports it with its shard).

        Raises:
          TypeError / ValueError: a state that is not a sharded state of this layout.
        """
        self._check_state(state, "ShardedCanary.consistency")
        lay = self.layout

        def build():
            def body(st):
                dig = fields_digest(_local2(st))
                every = jax.lax.all_gather(dig, lay.tp_axis)  # uint32[tp, 2]
                differ = jnp.any(every != dig[None, :], axis=1)
                return jnp.sum(differ.astype(jnp.int32))[None, None]

            def run(st):
                return shard_map(body, mesh=lay.mesh, in_specs=(_specs(st, lay.state_spec),), out_specs=lay.state_spec)(
                    st
                )

            return jax.jit(run)

        return self._program("consistency", build)(state)


def _plans_shape(shell: CanaryState, batch: CanaryBatch, config: CanaryStepConfig) -> CanaryPlans:
    """The local plans' shapes (abstract evaluation only), with the two leading shard axes."""
    return _global2(phases.plan_impl(_local2(shell), _local1(batch), config))


def _summary_specs(spec: P) -> StepSummary:
    return StepSummary(verify_enable=spec, verify_num_valid=spec, violations_total=spec, new_violations=spec)


# --- host side: one report over every shard ---------------------------------------------------------------------
def _shard_of(index: tuple) -> Shard:
    return (index[0].start or 0, index[1].start or 0)


def _by_shard(x: jax.Array) -> dict[Shard, Any]:
    """This process's shards of a ``[dp, tp, ...]`` array: ``{(dp, tp): device block without the two axes}``."""
    return {_shard_of(s.index): s.data for s in x.addressable_shards}


def shard_logs(log: layout.ViolationLog) -> dict[Shard, layout.ViolationLog]:
    """The sharded log's addressable shards as host :class:`~canary_jax.layout.ViolationLog` s (numpy leaves).

    One device-to-host copy of each addressable shard's ring, index and counters (``jax.device_get``); shards
    held by other processes are not in the result.

    Raises:
      ValueError: a log whose leaves are not laid out ``[dp, tp, ...]``.
    """
    names = ("ring", "write_index", "slot_run_counters", "kernel_run_counters", "enable_chain_position_assert")
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


@dataclasses.dataclass(frozen=True, slots=True)
class ShardedViolationRecord:
    """One ring row of one shard. Reads every :class:`~canary_jax.decode.ViolationRecord` field and property
    (``slot_idx``, ``tag``, ``reasons``, ...) through to ``record``, so it stands in for one (e.g. in
    :attr:`~canary_jax.runtime.report.CanaryViolationError.records`) while naming its shard.

    Fields:
      shard: ``(dp, tp)``.
      record: the decoded :class:`~canary_jax.decode.ViolationRecord` (its ``index`` is the shard's ring row).
    """

    shard: Shard
    record: decode.ViolationRecord

    def __getattr__(self, name: str) -> Any:
        """The record's fields and properties (``slot_idx``, ``tag``, ``reasons``, ...), read through."""
        if name in ("shard", "record") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.record, name)

    def as_dict(self) -> dict[str, Any]:
        d = self.record.as_dict()
        d["shard"] = list(self.shard)
        return d


def format_sharded_violation(
    rec: ShardedViolationRecord, *, total: int, ring_overflow: bool, step_when_pumped: int
) -> str:
    """SGLang's text (:func:`canary_jax.decode.format_violation`, unchanged, as the prefix) with
    `` shard=(dp,tp)`` appended to its last line; ``total`` and ``ring_overflow`` are the shard's."""
    text = decode.format_violation(
        rec.record, total=total, ring_overflow=ring_overflow, step_when_pumped=step_when_pumped
    )
    return f"{text} shard=({rec.shard[0]},{rec.shard[1]})"


class ShardedViolationReporter:
    """:class:`~canary_jax.runtime.report.ViolationReporter` over every addressable shard: one cursor per
    shard, every message SGLang's text with the shard appended.

    Args:
      mode: ``none`` / ``log`` / ``raise`` (raise: one :class:`~canary_jax.runtime.report.CanaryViolationError`
        with every new message of every shard, once).
      collapse: count a row equal (all 8 columns) to one already reported *on the same shard* instead of
        reporting it again.
      log: the logger (default ``canary_jax``).

    Attributes:
      last_records: the :class:`ShardedViolationRecord` s decoded by the latest call (repeats included).

    Raises:
      ValueError: a bad mode.
    """

    def __init__(self, mode: str = "log", *, collapse: bool = False, log: logging.Logger | None = None) -> None:
        self.mode = validate_mode(mode)
        self.collapse = bool(collapse)
        self._logger = log or logger
        self._per_shard: dict[Shard, ViolationReporter] = {}
        self._raised = False
        self.last_records: list[ShardedViolationRecord] = []

    @property
    def is_raised(self) -> bool:
        return self._raised

    def _reporter(self, shard: Shard) -> ViolationReporter:
        r = self._per_shard.get(shard)
        if r is None:
            r = self._per_shard[shard] = ViolationReporter("none", collapse=self.collapse, log=self._logger)
        return r

    def messages(self, log: layout.ViolationLog | dict[Shard, layout.ViolationLog], *, step: int) -> list[str]:
        """Formats the not-yet-reported rows of every addressable shard (shard order, then ring order) and
        advances each shard's cursor; no logging, no raising.

        Args:
          log: the sharded log (leaves ``[dp, tp, ...]``), or :func:`shard_logs`' result.
        """
        logs = shard_logs(log) if isinstance(log, layout.ViolationLog) else log
        out: list[str] = []
        self.last_records = []
        for shard, slog in sorted(logs.items()):
            r = self._reporter(shard)
            ring, wi = decode.ring_and_index(slog)
            r.messages(slog, step=step)  # advances the shard's cursor; its collapse mode picks r.last_shown
            overflow = wi > ring.shape[0] or wi < 0
            self.last_records.extend(ShardedViolationRecord(shard, rec) for rec in r.last_records)
            for rec in r.last_shown:
                srec = ShardedViolationRecord(shard, rec)
                out.append(format_sharded_violation(srec, total=wi, ring_overflow=overflow, step_when_pumped=step))
        return out

    def log_or_raise(self, log: layout.ViolationLog | dict[Shard, layout.ViolationLog], *, step: int = 0) -> list[str]:
        """Reports every addressable shard's new rows (log: one warning each; raise: one error, once).

        Returns:
          The messages reported (empty in none mode or when nothing is new).

        Raises:
          CanaryViolationError: raise mode, once, every message joined by newlines; its ``records`` are the
            :class:`ShardedViolationRecord` s (each with its ``shard``).
        """
        if self._raised:
            return []
        msgs = self.messages(log, step=step)
        if self.mode == "none" or not msgs:
            return []
        self._raised = self.mode == "raise"
        return log_or_raise_messages(self.mode, self._logger, msgs, list(self.last_records), step=step)

    def report_disagreement(self, disagreement: jax.Array, *, step: int = 0) -> list[str]:
        """Reports every addressable shard whose head-shard peers disagree (:meth:`ShardedCanary.consistency`):
        ``kv_canary shard disagreement: token/position/chain fields differ from N of T head shards of dp row D
        step=S shard=(dp,tp)``, logged (log mode) or raised (raise mode) like violations.

        Returns:
          The messages (one per disagreeing addressable shard).
        """
        host = jax.device_get(_by_shard(disagreement))
        msgs = []
        for (d, t), v in sorted(host.items()):
            n = int(np.asarray(v).reshape(-1)[0])
            if n:
                tp = int(disagreement.shape[1])
                msgs.append(
                    f"kv_canary shard disagreement: token/position/chain fields differ from {n} of {tp} head "
                    f"shards of dp row {d} step={step} shard=({d},{t})"
                )
        if msgs and self.mode == "log":
            for m in msgs:
                self._logger.warning(m)
        elif msgs and self.mode == "raise":
            self._raised = True
            raise CanaryViolationError(msgs, [], step=step)
        return msgs


class ShardedViolationMonitor:
    """SGLang's violation pump over every addressable shard (:class:`~canary_jax.runtime.report.ViolationMonitor`
    per shard, one report).

    Delayed (default), :meth:`step` keeps the log with a non-blocking snapshot of its write indices and reads
    them at the next call, so the host never waits for the step in flight.

    Args:
      reporter: the :class:`ShardedViolationReporter`.
      delayed: read the previous step's log (True) or the current one (False).

    Attributes:
      last_records: the :class:`ShardedViolationRecord` s read by the latest pump.
      last_recorded_step: the step whose log held them.
    """

    def __init__(self, reporter: ShardedViolationReporter, *, delayed: bool = True) -> None:
        self.reporter = reporter
        self.delayed = bool(delayed)
        self._pending = None
        self._seen: dict[Shard, int] = {}
        self.last_records: list[ShardedViolationRecord] = []
        self.last_recorded_step: int | None = None

    def step(self, log: layout.ViolationLog, *, step: int) -> list[str]:
        """Pumps once (after every outer step). Returns the messages reported now.

        Raises:
          CanaryViolationError: raise mode, on the first pump that sees violations (``recorded_step`` set).
        """
        self.last_records = []
        if self.delayed:
            prev, self._pending = self._pending, (log, _snapshot(log.write_index), int(step))
            if prev is None:
                return []
            log, wi, recorded = prev
        else:
            wi, recorded = log.write_index, int(step)
        return self._report(log, wi, step=step, recorded=recorded)

    def flush(self, log: layout.ViolationLog, *, step: int) -> list[str]:
        """Reports whatever the current log holds, without the delay (e.g. at shutdown)."""
        self._pending = None
        self.last_records = []
        return self._report(log, log.write_index, step=step, recorded=int(step))

    def _report(self, log: layout.ViolationLog, wi: jax.Array, *, step: int, recorded: int) -> list[str]:
        idx = {s: int(np.asarray(v).reshape(-1)[0]) for s, v in jax.device_get(_by_shard(wi)).items()}
        if all(self._seen.get(s, 0) == n for s, n in idx.items()) or self.reporter.is_raised:
            return []
        self._seen.update(idx)
        try:
            msgs = self.reporter.log_or_raise(log, step=step)
        except CanaryViolationError as e:
            e.recorded_step = recorded
            self.last_records, self.last_recorded_step = list(self.reporter.last_records), recorded
            raise
        self.last_records, self.last_recorded_step = list(self.reporter.last_records), recorded
        return msgs


@dataclasses.dataclass(frozen=True, slots=True)
class ShardedStats:
    """Stats per addressable shard and their total.

    Fields:
      per_shard: ``{(dp, tp): CanaryStats}`` for this process's shards.
      total: the sum over them (protected tokens, violations, counters; ``ring_overflow`` if any shard's
        overflowed). In a multi-process run it covers this process's shards only unless built with
        ``all_processes=True``.
    """

    per_shard: dict
    total: CanaryStats

    def lines(self) -> list[str]:
        """SGLang's stats line per shard (`` shard=(dp,tp)`` appended) and the total (`` shards=N``)."""
        out = [f"{format_stats(s)} shard=({d},{t})" for (d, t), s in sorted(self.per_shard.items())]
        out.append(f"{format_stats(self.total)} shards={len(self.per_shard)}")
        return out


def sharded_stats(
    log: layout.ViolationLog,
    *,
    step: int = 0,
    sweep_passes: int = 0,
    active_tags: Sequence[int] = (),
    all_processes: bool = False,
) -> ShardedStats:
    """Per-shard :class:`~canary_jax.runtime.report.CanaryStats` and their total (host reads of the small logs).

    Args:
      log: the sharded log (leaves ``[dp, tp, ...]``, e.g. ``state.log`` of a :class:`ShardedCanary` state).
      step: the outer step printed in each stats line.
      sweep_passes: sweep passes run so far (reported as given; the log does not count them).
      active_tags: the launch tags the canary runs (:func:`~canary_jax.runtime.state.active_tags`); only their
        number is reported (``launch_tags_active``).
      all_processes: in a multi-process run, first gather every shard's small counters and write index to every
        process (``jax.experimental.multihost_utils.process_allgather``, ``[dp, tp, 12, 2]`` words; a
        collective: every process must call it), so the total covers the whole mesh.

    Returns:
      A :class:`ShardedStats`: ``per_shard`` ``{(dp, tp): CanaryStats}`` (this process's shards, or every shard
      with ``all_processes``) and their ``total``; ``.lines()`` formats them.

    Raises:
      ValueError: a log whose leaves are not laid out ``[dp, tp, ...]``.
    """
    if all_processes and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        wi, slot, kern = (
            np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for x in (log.write_index, log.slot_run_counters, log.kernel_run_counters)
        )
        cap = int(log.ring.shape[2])
        parts = {
            (d, t): (int(wi[d, t, 0]), slot[d, t], kern[d, t]) for d in range(wi.shape[0]) for t in range(wi.shape[1])
        }
    else:
        cap = int(log.ring.shape[2])
        parts = {
            s: (sl.num_violations(), sl.slot_run_counters, sl.kernel_run_counters) for s, sl in shard_logs(log).items()
        }
    per = {}
    ntags = len(tuple(active_tags))
    for s, (n, slot_p, kern_p) in parts.items():
        slot_runs = ints.pairs_to_int64_np(np.asarray(slot_p))
        kernel_runs = ints.pairs_to_int64_np(np.asarray(kern_p))
        per[s] = CanaryStats(
            step=int(step),
            protected_tokens=int(slot_runs.sum()),
            sweep_passes=int(sweep_passes),
            violations=n,
            ring_overflow=n > cap or n < 0,
            launch_tags_active=ntags,
            num_tags=constants.NUM_LAUNCH_TAGS,
            kernel_runs=kernel_runs,
            slot_runs=slot_runs,
        )
    zeros = np.zeros((constants.NUM_LAUNCH_TAGS,), np.int64)
    total = CanaryStats(
        step=int(step),
        protected_tokens=sum(s.protected_tokens for s in per.values()),
        sweep_passes=int(sweep_passes),
        violations=sum(s.violations for s in per.values()),
        ring_overflow=any(s.ring_overflow for s in per.values()),
        launch_tags_active=ntags,
        num_tags=constants.NUM_LAUNCH_TAGS,
        kernel_runs=functools.reduce(np.add, (s.kernel_runs for s in per.values()), zeros),
        slot_runs=functools.reduce(np.add, (s.slot_runs for s in per.values()), zeros),
    )
    return ShardedStats(per_shard=per, total=total)


class ShardedHealthChecker:
    """SGLang's kernel-counter health check (:class:`~canary_jax.runtime.report.HealthChecker`) on every
    addressable shard: a shard whose canary path stopped running fails even when the others run.

    Args: as :class:`~canary_jax.runtime.report.HealthChecker` (``delayed`` not supported: checks read now).

    Raises:
      ValueError: ``delayed=True`` (at construction).
      RuntimeError (from :meth:`step`): HealthChecker's text with `` shard=(dp,tp)`` appended, for the first
        stalled shard.
    """

    def __init__(self, active_tags: Sequence[int], **kw: Any) -> None:
        if kw.get("delayed"):
            raise ValueError(
                "kv-canary: ShardedHealthChecker does not support delayed=True (each check reads the shards' "
                "counters now); leave delayed out"
            )
        kw.pop("delayed", None)
        self._kw = dict(active_tags=tuple(active_tags), **kw)
        self._per_shard: dict[Shard, HealthChecker] = {}

    def step(self, log: layout.ViolationLog, *, step: int) -> None:
        probe = HealthChecker(**self._kw)
        if not probe.due(step):
            return
        for s, slog in shard_logs(log).items():
            hc = self._per_shard.setdefault(s, HealthChecker(**self._kw))
            try:
                hc.check(slog.counters()[1], step=step)
            except RuntimeError as e:
                raise RuntimeError(f"{e} shard=({s[0]},{s[1]})") from None
