"""The mesh the sharded canary runs on (:mod:`canary_jax.runtime.sharded`): :class:`ShardLayout` (a 2-D
``(dp, tp)`` mesh), how host data is laid out on it (per-shard states, per-dp-shard batches and plans), and the
checks that a state, batch or KV state given to :class:`~canary_jax.runtime.sharded_canary.ShardedCanary`
follows it.

Everything here runs on the host, before any program: a value laid out for another layout is refused with
its shape, never resharded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from canary_jax.contract import ints
from canary_jax.runtime import phases, shapes
from canary_jax.runtime.prepare import check_batch, check_batch_values
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import _check_config, _check_state

__all__ = [
    "Shard",
    "ShardLayout",
    "check_kv_placement",
    "check_live_tokens",
    "check_sharded_batch",
    "check_sharded_state",
]

Shard = tuple[int, int]


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
        state: CanaryState | None = None,
    ) -> tuple[CanaryBatch, jax.Array]:
        """One batch per dp shard, padded to one shape and laid out ``[dp, ...]`` (``PartitionSpec(dp)``).

        Args:
          batches: ``num_dp`` CanaryBatches (host data), dp shard ``d``'s requests in its own slot space; None for
            a dp shard that no device of this process holds (multi-process runs). Every batch's tables
            (``req_to_token``, the expected-token pool) must have one shape.
          config: the step config (its buckets pick the padded shapes).
          num_tokens, num_rows: the padded token count T and row count bs; default: the buckets of the largest
            given batch. In a multi-process run pass them, so that every process builds the same global shape.
          state: the single-device :class:`CanaryState` every shard holds (the one given to
            :meth:`shard_state`), to bound ``out_cache_loc`` by its slots; None skips that one bound.

        Returns:
          ``(batch, live_tokens)``: the stacked batch (leaves ``[dp, ...]``) and ``int32[dp]`` live token counts
          (padding tokens past them are never written or counted).

        Raises:
          ValueError: not one entry per dp shard, no batch at all, None for a dp shard this process holds, a
            batch larger than ``num_tokens`` / ``num_rows``, tables of different shapes, or a host value the
            canary cannot honour (:func:`~canary_jax.runtime.prepare.check_batch_values`, naming the field and index).
          TypeError: an entry that is not a CanaryBatch or None.

        Each batch gets :func:`canary_jax.runtime.prepare.check_batch` and
        :func:`~canary_jax.runtime.prepare.check_batch_values` (the checks of
        :func:`~canary_jax.runtime.prepare.prepare_batch`, ``out_cache_loc``'s bound only with ``state``) and the
        bucket padding of :mod:`canary_jax.runtime.shapes`, but to one shape shared by every dp shard (the largest
        bucket, or ``num_tokens`` / ``num_rows``), not each batch's own.
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
            check_batch(b, config)  # prepare_batch's checks: static, then the host values
            check_batch_values(state, b)
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
        """Any pytree given once per dp shard (e.g. sweep :class:`~canary_jax.planning.plans.VerifyPlan` s of equal
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


# --- checks: a value laid out for this layout -------------------------------------------------------------------
def check_sharded_state(lay: ShardLayout, state: Any, who: str) -> None:
    """A sharded state of this layout: every leaf ``[num_dp, num_tp, ...]`` (before any shard_map error)."""
    _check_state(state)
    want = (lay.num_dp, lay.num_tp)
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


def check_sharded_batch(lay: ShardLayout, batch: Any, who: str) -> None:
    """A batch from this layout's :meth:`ShardLayout.shard_batch` (leaves ``[dp, ...]``)."""
    dp = lay.num_dp
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


def check_live_tokens(lay: ShardLayout, num_tokens: Any, who: str) -> None:
    """Live token counts from this layout's :meth:`ShardLayout.shard_batch` (``int32[dp]``)."""
    dp = lay.num_dp
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


def check_kv_placement(
    lay: ShardLayout, config: CanaryStepConfig, kv_state: Any, kv_specs: Any, state: CanaryState, who: str
) -> None:
    """``kv_state`` given when hashing, and every concrete leaf already laid out as ``kv_specs`` says (else
    XLA would reshard the pool with pool-sized collectives before the shard_map)."""
    if kv_state is None:
        phases.check_sources(None, state, config, who)  # raises in a hashing mode
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
        expected = NamedSharding(lay.mesh, spec)
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
