"""``canary-jax demo --devices N``: the demo's KV pools and KV canary sharded over N devices by KV heads.

The demo engine, scheduler, model and fault campaign are the single-device demo's; what changes is where the KV
lives and the canary:

* a ``1 x N`` (dp, tp) mesh (:class:`canary_jax.runtime.sharded.ShardLayout`). The K and V pools are
  ``bf16[layers, pages, page_size, kv_heads, head_dim]`` (the single-device pool's bytes, heads an axis),
  sharded over heads (``NamedSharding``, ``P(None, None, None, "tp", None)``): each device holds only its own
  heads of every layer. The model's forward is one ``jit`` over the sharded pools with replicated weights (XLA's
  SPMD partitioning splits it), its pools donated and returned with the same sharding, so they stay on their
  devices from step to step;
* every head shard runs its own canary (:class:`~canary_jax.runtime.sharded.ShardedCanary` under ``shard_map``)
  over the same requests; TAIL and SWEEP take the sharded pools as they are, and each shard fingerprints its
  own local heads of layer 0 (the K pool, and V with ``--mha-v``): no resharding and no ``device_put`` of the
  pool per step;
* violations of every shard go through one :class:`~canary_jax.runtime.sharded.ShardedViolationReporter`: a KV
  flip is reported by the head shard that owns the flipped byte, a bookkeeping fault by every head shard, a
  canary-record flip (injected into one head shard's canary, :attr:`ShardedCanaryRuntime.fault_shard`) by that
  shard; the campaign's first-violation text carries `` shard=(dp,tp)``;
* the kernel-counter health check runs per shard (:class:`~canary_jax.runtime.sharded.ShardedHealthChecker`).

On a CPU, N devices are forced host devices: :func:`force_host_devices` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts its backends.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from canary_jax.cli.demo import campaign as campaign_lib
from canary_jax.cli.demo import canary_ops, model
from canary_jax.cli.demo.engine import Engine
from canary_jax.contract import constants, layout
from canary_jax.contract.decode import ViolationRecord
from canary_jax.contract.sources import RealKvSource
from canary_jax.runtime import sharded
from canary_jax.runtime.state import active_tags

_FLAG = "--xla_force_host_platform_device_count"


def force_host_devices(n: int) -> str | None:
    """Makes ``n`` devices available: on a CPU-only run, sets ``XLA_FLAGS`` to force ``n`` host devices (before
    JAX starts its backends; an existing count is replaced). Returns an error text when ``n`` devices cannot be
    had (the backend already started with fewer), else None."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(rf"{_FLAG}=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={int(n)}".strip()
    have = len(jax.devices())
    if have < n:
        return f"--devices {n}: only {have} devices are available ({jax.default_backend()})"
    return None


def fit_kv_heads(kv_heads: int, q_heads: int, devices: int) -> tuple[int, int, str | None]:
    """``(kv_heads, q_heads, note)``: KV heads split evenly over ``devices`` head shards; when they do not, the
    smallest multiple of ``devices`` above ``kv_heads`` (and q heads a multiple of it), with a note."""
    if kv_heads % devices == 0:
        return kv_heads, q_heads, None
    kv = ((kv_heads + devices - 1) // devices) * devices
    q = ((max(q_heads, kv) + kv - 1) // kv) * kv
    return kv, q, f"--devices {devices}: using --kv-heads {kv} --q-heads {q} so that KV heads split evenly"


@dataclasses.dataclass(frozen=True, slots=True)
class _LocalSources:
    """``sources_fn`` of the demo's sharded canary: layer 0 of one head shard's local K (and V) pool block
    ``bf16[layers, pages, page_size, heads / N, head_dim]`` as the real-KV sources (hashable: a static
    argument)."""

    page_size: int
    bytes_per_token: int
    mode: int
    v_half: bool

    def _one(self, block):
        if self.mode == constants.RealKvHashMode.NONE:
            return ()
        read = constants.PARTIAL_READ_BYTES if self.mode == constants.RealKvHashMode.PARTIAL else self.bytes_per_token
        rows = block[0].reshape(block.shape[1], -1)  # layer 0: [pages, page_size * heads / N * head_dim]
        return (
            RealKvSource(
                tensor=rows, page_size=self.page_size, num_bytes_per_token=self.bytes_per_token, read_bytes=read
            ),
        )

    def __call__(self, kv_local):
        k, v = kv_local
        return ((self._one(k), self._one(v) if self.v_half else ()),)


@dataclasses.dataclass(frozen=True)
class _DemoLog(layout.ViolationLog):
    """A sharded log whose host readers count every shard (the campaign reads ``num_violations()``)."""

    def num_violations(self) -> int:
        return sum(sl.num_violations() for sl in sharded.shard_logs(self).values())

    @property
    def ring_capacity(self) -> int:
        return int(self.ring.shape[-3])


@dataclasses.dataclass(frozen=True, slots=True)
class ShardedRecord(ViolationRecord):
    """A :class:`~canary_jax.contract.decode.ViolationRecord` with the shard ``(dp, tp)`` that recorded it."""

    shard: tuple = (0, 0)


POOL_SPEC = P(None, None, None, "tp", None)  # [layers, pages, page_size, kv_heads, head_dim]: heads over tp


@functools.partial(jax.jit, static_argnames=("cfg", "sharding"), donate_argnames=("k_pool", "v_pool"))
def sharded_forward(params, k_pool, v_pool, *args, cfg, sharding):
    """:func:`canary_jax.cli.demo.model.forward` on head-sharded pools: XLA's SPMD partitioning runs the model
    over the mesh; the new pools (donated in) come back with the same ``sharding``."""
    k_pool, v_pool, next_tokens = model.forward_impl(params, k_pool, v_pool, *args, cfg=cfg)
    return (
        jax.lax.with_sharding_constraint(k_pool, sharding),
        jax.lax.with_sharding_constraint(v_pool, sharding),
        next_tokens,
    )


@functools.partial(jax.jit, static_argnames=("shape", "sharding"))
def _zeros(*, shape, sharding):
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, jnp.bfloat16), sharding)


class ShardedCanaryRuntime(canary_ops.CanaryRuntimeBase):
    """The demo's canary runtime (:class:`canary_jax.cli.demo.canary_ops.CanaryRuntime`'s interface) on a
    ``1 x devices`` mesh split by KV heads.

    Args: as CanaryRuntime (but ``kv_bytes_per_token``), plus ``devices`` (head shards), ``num_kv_heads`` and
    ``head_dim`` (bf16).

    Raises:
      ValueError: ``num_kv_heads`` not a multiple of ``devices``, or a head shard's row not a multiple of 16
        bytes.
    """

    def __init__(self, *, devices: int, num_kv_heads: int, head_dim: int, page_size: int, **kw):
        if num_kv_heads % devices:
            raise ValueError(f"--kv-heads {num_kv_heads} must be a multiple of --devices {devices}")
        self.heads_per_shard = num_kv_heads // devices
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        bytes_per_token = self.heads_per_shard * head_dim * 2
        if bytes_per_token % 16:
            raise ValueError(
                f"--devices {devices}: a head shard's KV row is {bytes_per_token} bytes, not a multiple of 16; "
                "raise --head-dim"
            )
        super().__init__(page_size=page_size, **kw)
        # single_state: the one-device state every shard starts from (the template of active tags)
        self.single_state = self.state
        self.layout = sharded.ShardLayout.create(dp=1, tp=devices, devices=jax.devices()[:devices])
        self.kv_specs = (POOL_SPEC, POOL_SPEC)
        self.pool_sharding = NamedSharding(self.layout.mesh, POOL_SPEC)
        self._state_sharding = NamedSharding(self.layout.mesh, self.layout.state_spec)
        self.canary = sharded.ShardedCanary(
            self.layout,
            self.config,
            kv_specs=self.kv_specs,
            sources_fn=_LocalSources(page_size, bytes_per_token, int(self.mode), self.config.enable_v_half),
        )
        self.state = self.layout.shard_state(self.single_state)
        self.fault_shard = (0, devices - 1)  # canary-record faults land in this head shard
        self._plans = self._batch = self._n = None

    @property
    def log(self):
        """The sharded violation log (leaves ``[1, devices, ...]``; its ``num_violations()`` is the total over
        the shards)."""
        log = self.state.log
        return _DemoLog(**{f.name: getattr(log, f.name) for f in dataclasses.fields(layout.ViolationLog)})

    def buffer(self, name: str):
        """The K-half canary buffer ``name`` of :attr:`fault_shard` (``uint8[num_slots, 32]``)."""
        d, t = self.fault_shard
        return np.asarray(jax.device_get(getattr(self.state.groups[0], name)))[d, t]

    def set_buffer(self, name: str, value) -> None:
        """Stores ``value`` as :attr:`fault_shard`'s buffer ``name`` (the other shards keep theirs)."""
        d, t = self.fault_shard
        host = np.asarray(jax.device_get(getattr(self.state.groups[0], name))).copy()
        host[d, t] = np.asarray(value)
        glob = jax.device_put(host, self._state_sharding)
        self.state = self.state.replace(groups=(self.state.groups[0].with_buffers(**{name: glob}),))

    def allocate_pools(self, num_layers: int, num_pages: int):
        """Zeroed K and V pools ``bf16[layers, pages, page_size, kv_heads, head_dim]``, created sharded over
        heads (each device zeroes its own block)."""
        shape = (num_layers, num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        return _zeros(shape=shape, sharding=self.pool_sharding), _zeros(shape=shape, sharding=self.pool_sharding)

    def _kv(self, k_pool, v_pool):
        """The pools as the canary programs take them: as they are, already sharded over heads (the shard_map
        reads each device's block in place). A pool laid out otherwise is refused rather than moved."""
        for name, p in (("k_pool", k_pool), ("v_pool", v_pool)):
            if p.ndim != 5 or not p.sharding.is_equivalent_to(self.pool_sharding, p.ndim):
                raise ValueError(f"--devices: {name} {p.shape} is not head-sharded as {POOL_SPEC} ({p.sharding})")
        return k_pool, v_pool

    def head(self, batch, req_to_token: np.ndarray, expected_pool: np.ndarray) -> None:
        """Plans the batch, then every head shard's HEAD verify + write."""
        cb = canary_ops.canary_batch(self.config, batch, req_to_token, expected_pool)
        self._batch, self._n = self.layout.shard_batch([cb], self.config)
        self.state, self._plans = self.canary.head(self.state, self._batch, self._n)

    def tail(self, k_pool, v_pool) -> None:
        """Every head shard's TAIL verify + write, fingerprinting its own heads."""
        self.state, self.summary = self.canary.tail(
            self.state, self._plans, self._batch, self._n, self._kv(k_pool, v_pool)
        )

    def sweep(self, tree, k_pool, v_pool) -> int:
        """Every head shard's SWEEP verify of the cached prefixes; returns the number of entries."""
        plan = self.sweep_plan(tree)
        self.state = self.canary.sweep(self.state, (self.layout.shard_per_dp([plan]),), self._kv(k_pool, v_pool))
        return self.swept(plan)


class ShardedEngine(Engine):
    """The demo engine with its K/V pools head-sharded over the mesh (:meth:`ShardedCanaryRuntime.allocate_pools`,
    the model's forward :func:`sharded_forward`), :class:`ShardedCanaryRuntime` as its canary, one report over
    every head shard and the health check per shard."""

    devices = 1

    def __init__(self, cfg, model_cfg, requests, **kw):
        super().__init__(cfg, model_cfg, requests, **kw)
        self.canary = ShardedCanaryRuntime(
            devices=self.devices,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            **canary_ops.runtime_args(cfg),
        )
        self.params = jax.device_put(self.params, NamedSharding(self.canary.layout.mesh, P()))  # replicated, once
        # replaces the base engine's one-device pools: the same bytes per slot, heads an axis, sharded over heads
        self.k_pool, self.v_pool = self.canary.allocate_pools(model_cfg.num_layers, cfg.num_pages)
        every = max(16, cfg.sweep_interval)
        self.health = sharded.ShardedHealthChecker(
            active_tags(self.canary.single_state, sweep=cfg.sweep_interval > 0, enable_v_half=cfg.enable_v_half),
            sweep_interval=cfg.sweep_interval,
            enable_v_half=cfg.enable_v_half,
            every_n_steps=every,
            warmup_steps=every,
        )
        self.reporter = sharded.ShardedViolationReporter("none")
        self.messages: list[str] = []

    def model_forward(self, params, k_pool, v_pool, *args, cfg):
        """The model's program on the head-sharded pools (:func:`sharded_forward`)."""
        return sharded_forward(params, k_pool, v_pool, *args, cfg=cfg, sharding=self.canary.pool_sharding)

    def poll_violations(self) -> list[ViolationRecord]:
        """Every shard's violations since the last poll, as :class:`ShardedRecord` s (shard order)."""
        self.messages += self.reporter.messages(self.canary.log, step=self.step_index)
        return [
            ShardedRecord(*(getattr(r.record, f.name) for f in dataclasses.fields(ViolationRecord)), shard=r.shard)
            for r in self.reporter.last_records
        ]


class ShardedCampaign(campaign_lib.Campaign):
    """The demo's fault campaign on :class:`ShardedEngine`; each trial's first-violation text names its shard."""

    devices = 1

    def _engine(self) -> Engine:
        reqs = campaign_lib.workload.build_requests(
            self.prompts, num_requests=self.cfg.num_requests, max_new_tokens=self.cfg.max_new_tokens, seed=self.cfg.seed
        )
        eng_cls = type("ShardedEngineN", (ShardedEngine,), {"devices": self.devices})
        eng = eng_cls(self.cfg.engine, self.cfg.model, reqs, params=self.params, sample_seed=self.cfg.seed)
        self.last_engine = eng
        return eng

    def run_trial(self, fault, trial: int):
        out = super().run_trial(fault, trial)
        ep = self.tracker.episodes[-1]
        rec = ep.first_violation
        if isinstance(rec, ShardedRecord):
            d, t = rec.shard
            out.first_violation = f"{out.first_violation} shard=({d},{t})"
            eng = self.last_engine
            text = [m for m in eng.messages if m.endswith(f" shard=({d},{t})") and _same_row(m, rec)]
            out.first_violation_text = text[0] if text else f"{out.first_violation_text} shard=({d},{t})"
        return out


def _same_row(message: str, rec: ViolationRecord) -> bool:
    return message.startswith(f"kv_canary violation: launch_tag={rec.tag} ") and f" slot_idx={rec.slot_idx} " in message


def shard_lines(result) -> list[str]:
    """The sharded demo's extra report: per fault episode, its first violation and the shard that recorded it
    (``kind#trial: TAG reasons slot=S position=P shard=(dp,tp)``), after a header naming the mesh."""
    trials = [t for t in result.trials if t.first_violation]
    out = ["first violation per episode, with the shard (dp, tp) that recorded it:"]
    out += [f"  {t.kind}#{t.trial}: {t.first_violation}" for t in trials]
    return out


def campaign_class(devices: int) -> type:
    """:class:`ShardedCampaign` for ``devices`` head shards."""
    return type("ShardedCampaignN", (ShardedCampaign,), {"devices": int(devices)})


def note(text: str) -> None:
    print(f"canary-jax: note: {text}", file=sys.stderr)
