"""The step API on a mesh (:mod:`canary_jax.runtime.sharded`): :class:`ShardedCanary`'s plan, HEAD, TAIL, step,
sweep and head-shard consistency programs, each one jitted ``shard_map`` program running
:mod:`canary_jax.runtime.phases`' traced bodies on every shard, cached per (layout, config, functions, key).

Calling contract: HEAD, TAIL and the step donate the state's canary buffers (use the returned state); the
violation log is not donated. Called inside a caller's ``jit`` the programs inline. Nothing syncs with the
host; data faults go to each shard's ring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from canary_jax.runtime import phases
from canary_jax.runtime.sharded_layout import (
    ShardLayout,
    check_kv_placement,
    check_live_tokens,
    check_sharded_batch,
    check_sharded_state,
)
from canary_jax.runtime.sharded_trace import (
    fields_digest,
    global2,
    local1,
    local2,
    plans_shape,
    shard_map,
    spec_tree,
    summary_specs,
)
from canary_jax.runtime.state import CanaryBatch, CanaryPlans, CanaryState, CanaryStepConfig, StepSummary
from canary_jax.runtime.step import _check_config

__all__ = ["ShardedCanary"]

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
        check_sharded_state(self.layout, state, "ShardedCanary.plan")
        check_sharded_batch(self.layout, batch, "ShardedCanary.plan")
        lay, cfg = self.layout, self.config

        def build():
            def body(shell, b):
                p = phases.plan_impl(local2(shell), local1(b), cfg)
                return global2(p)

            def run(shell, b):
                out_specs = spec_tree(jax.eval_shape(lambda: plans_shape(shell, b, cfg)), lay.state_spec)
                return shard_map(
                    body,
                    mesh=lay.mesh,
                    in_specs=(spec_tree(shell, lay.state_spec), spec_tree(b, lay.batch_spec)),
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
        check_sharded_state(self.layout, state, "ShardedCanary.head")
        check_sharded_batch(self.layout, batch, "ShardedCanary.head")
        check_live_tokens(self.layout, num_tokens, "ShardedCanary.head")
        lay, cfg = self.layout, self.config
        have_plans = plans is not None

        def build():
            def body(bufs, shell, b, n, p):
                st = phases.join(local2(bufs), local2(shell))
                st, pl = phases.head_impl(st, local1(b), None if p is None else local2(p), n[0], cfg)
                nb, ns = phases.split(st)
                return global2(nb), global2(ns), global2(pl)

            def run(bufs, shell, b, n, p):
                s2, s1 = lay.state_spec, lay.batch_spec
                pl_shape = jax.eval_shape(lambda: plans_shape(shell, b, cfg))
                return shard_map(
                    body,
                    mesh=lay.mesh,
                    in_specs=(spec_tree(bufs, s2), spec_tree(shell, s2), spec_tree(b, s1), s1, spec_tree(p, s2)),
                    out_specs=(spec_tree(bufs, s2), spec_tree(shell, s2), spec_tree(pl_shape, s2)),
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
        check_sharded_state(self.layout, state, "ShardedCanary.tail")
        check_sharded_batch(self.layout, batch, "ShardedCanary.tail")
        check_live_tokens(self.layout, num_tokens, "ShardedCanary.tail")
        lay, cfg = self.layout, self.config
        kv_specs = self._need_kv_specs() if kv_state is not None else None
        check_kv_placement(self.layout, self.config, kv_state, kv_specs, state, "ShardedCanary.tail")

        def build():
            def body(bufs, shell, p, b, n, kv):
                st = phases.join(local2(bufs), local2(shell))
                srcs = self._sources(kv, st, "ShardedCanary.tail")
                st, summary = phases.tail_impl(st, local2(p), local1(b), srcs, n[0], cfg)
                nb, ns = phases.split(st)
                return global2(nb), global2(ns), global2(summary)

            def run(bufs, shell, p, b, n, kv):
                s2, s1 = lay.state_spec, lay.batch_spec
                return shard_map(
                    body,
                    mesh=lay.mesh,
                    in_specs=(
                        spec_tree(bufs, s2),
                        spec_tree(shell, s2),
                        spec_tree(p, s2),
                        spec_tree(b, s1),
                        s1,
                        kv_specs,
                    ),
                    out_specs=(spec_tree(bufs, s2), spec_tree(shell, s2), summary_specs(s2)),
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
        check_sharded_state(self.layout, state, "ShardedCanary.step")
        check_sharded_batch(self.layout, batch, "ShardedCanary.step")
        check_live_tokens(self.layout, num_tokens, "ShardedCanary.step")
        if not callable(kv_write_fn):
            raise TypeError(f"kv-canary: kv_write_fn must be callable, got {type(kv_write_fn).__name__}")
        lay, cfg = self.layout, self.config
        kv_specs = self._need_kv_specs()
        check_kv_placement(self.layout, self.config, kv_state, kv_specs, state, "ShardedCanary.step")

        def build():
            def body(bufs, shell, b, n, kv):
                st = phases.join(local2(bufs), local2(shell))
                st, kv, summary = phases.step_impl(st, local1(b), kv_write_fn, kv, n[0], cfg)
                nb, ns = phases.split(st)
                return global2(nb), global2(ns), kv, global2(summary)

            def run(bufs, shell, b, n, kv):
                s2, s1 = lay.state_spec, lay.batch_spec
                return shard_map(
                    body,
                    mesh=lay.mesh,
                    in_specs=(spec_tree(bufs, s2), spec_tree(shell, s2), spec_tree(b, s1), s1, kv_specs),
                    out_specs=(spec_tree(bufs, s2), spec_tree(shell, s2), kv_specs, summary_specs(s2)),
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
        check_sharded_state(self.layout, state, "ShardedCanary.sweep")
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
        check_kv_placement(self.layout, self.config, kv_state, kv_specs, state, "ShardedCanary.sweep")

        def build():
            def body(st, sp, kv):
                st = local2(st)
                srcs = self._sources(kv, st, "ShardedCanary.sweep")
                log = phases.sweep_impl(st, local1(sp), srcs, cfg)
                return global2(log)

            def run(st, sp, kv):
                s2, s1 = lay.state_spec, lay.batch_spec
                return shard_map(
                    body,
                    mesh=lay.mesh,
                    in_specs=(spec_tree(st, s2), spec_tree(sp, s1), kv_specs),
                    out_specs=spec_tree(st.log, s2),
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
        check_sharded_state(self.layout, state, "ShardedCanary.consistency")
        lay = self.layout

        def build():
            def body(st):
                dig = fields_digest(local2(st))
                every = jax.lax.all_gather(dig, lay.tp_axis)  # uint32[tp, 2]
                differ = jnp.any(every != dig[None, :], axis=1)
                return jnp.sum(differ.astype(jnp.int32))[None, None]

            def run(st):
                return shard_map(
                    body, mesh=lay.mesh, in_specs=(spec_tree(st, lay.state_spec),), out_specs=lay.state_spec
                )(st)

            return jax.jit(run)

        return self._program("consistency", build)(state)
