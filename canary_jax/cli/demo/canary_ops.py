"""The demo engine's canary: one jitted program per forward, on the runtime's step API (:mod:`canary_jax.runtime.step`).

One FULL :class:`~canary_jax.runtime.groups.CanaryBufferGroup` (the demo pool has no SWA part) with HEAD and
TAIL buffers for the K half and, with ``enable_v_half``, the V half (SGLang launches only K halves by default).
TAIL and SWEEP launches fingerprint layer 0 of the K (and V) pool: the pool is
``bf16[layers, pages, page_size * kv_dim]``, so ``pool[0]``, taken inside the program, is a
:class:`~canary_jax.contract.sources.RealKvSource` with ``page_size`` slots per row (SGLang's packed-page layout; page
size 1 is its MHA layout).

Per forward (SPEC 8.3), :func:`served_step` is the whole served step as one jitted program, the way a JAX serving
stack should run the canary: :func:`canary_jax.runtime.step.canary_step` plans the batch
(:func:`canary_jax.planning.plan_builder.build_plans`) and runs HEAD verify + write, then the model
(:func:`canary_jax.cli.demo.model.forward_impl`) writes its KV, attends and samples, then TAIL verify + write runs
with the same plans and real-KV sources built from the new pool inside the program (a view, no pool copy). The
pools and the canary buffers are donated, so both are updated in place. Every array has a fixed capacity (tokens,
rows, verify entries), so the program compiles once per run; ``canary=False`` is the same step without the canary
(the model alone), the baseline the demo's time table measures the canary against.

Every ``sweep_interval`` steps :func:`canary_jax.runtime.step.canary_sweep` verifies every slot of the prefix
cache against the TAIL buffer (:func:`canary_jax.runtime.sweep.build_sweep_plan_from_radix`, fixed capacity,
SPEC 9 "Sweep"), its own jitted program. The backend is picked by :func:`canary_jax.ops.backends.resolve_backend`
(Pallas on GPU, the Pallas TPU verify on a TPU, the jnp reference elsewhere).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from canary_jax.cli.demo import model
from canary_jax.contract import constants
from canary_jax.contract.sources import RealKvSource
from canary_jax.ops import backends
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_step, canary_sweep
from canary_jax.runtime.sweep import build_sweep_plan_from_radix


def _pool_sources(pool, *, page_size: int, kv_bytes: int, mode: constants.RealKvHashMode) -> tuple:
    """Layer 0 of a pool as the one real-KV source (none in NONE mode, as SGLang's factories do)."""
    if mode == constants.RealKvHashMode.NONE:
        return ()
    read = constants.PARTIAL_READ_BYTES if mode == constants.RealKvHashMode.PARTIAL else kv_bytes
    return (RealKvSource(tensor=pool[0], page_size=page_size, num_bytes_per_token=kv_bytes, read_bytes=read),)


def pool_sources(k_pool, v_pool, *, page_size: int, kv_bytes: int, config: CanaryStepConfig) -> tuple:
    """The one group's ``(sources_k, sources_v)``: layer 0 of each pool, built inside the caller's ``jit`` (a
    slice there, not a copy); the V pool only when the V half is launched."""
    mode = config.real_kv_hash_mode
    src_k = _pool_sources(k_pool, page_size=page_size, kv_bytes=kv_bytes, mode=mode)
    src_v = _pool_sources(v_pool, page_size=page_size, kv_bytes=kv_bytes, mode=mode) if config.enable_v_half else ()
    return ((src_k, src_v),)


@functools.partial(jax.jit, static_argnames=("model_cfg", "config", "page_size", "canary"), donate_argnums=(0, 3, 4))
def served_step(groups, log, params, k_pool, v_pool, batch, model_in, *, model_cfg, config, page_size, canary=True):
    """One served forward as one program: plan + HEAD, the model (KV write, attention, sampling), TAIL.

    Args:
      groups: the canary state's buffer groups (donated: updated in place), or None with ``canary=False``.
      log: the canary state's violation log (not donated, so a log read earlier stays valid), or None.
      params: the model's weights.
      k_pool, v_pool: ``bf16[num_layers, num_pages, page_size * kv_dim]`` (donated).
      batch: the step's :class:`~canary_jax.runtime.state.CanaryBatch` (fixed capacities), or None.
      model_in: what the model is fed (the int32 arrays of :meth:`CanaryRuntime.model_inputs`).
      model_cfg, config, page_size: static; ``canary=False`` runs the model alone (the timing baseline).

    Returns:
      ``(groups, log, k_pool, v_pool, next_tokens int32[B], summary)`` (``groups``, ``log`` and ``summary`` None
      without the canary).
    """
    key = jax.random.fold_in(model_in["key"], model_in["step"])

    def model_step(k, v):
        return model.forward_impl(
            params,
            k,
            v,
            model_in["input_ids"],
            model_in["positions"],
            model_in["out_cache_loc"],
            model_in["token_rows"],
            model_in["req_to_token"],
            model_in["sample_index"],
            key,
            cfg=model_cfg,
        )

    if not canary:
        k_pool, v_pool, next_tokens = model_step(k_pool, v_pool)
        return None, None, k_pool, v_pool, next_tokens, None

    def kv_write(kv, _batch):  # the model's forward; the sources view its pool after the write
        k, v, tokens = model_step(kv[0], kv[1])
        return (k, v, tokens), pool_sources(
            k, v, page_size=page_size, kv_bytes=model_cfg.kv_bytes_per_token, config=config
        )

    state = CanaryState(groups=groups, log=log)
    state, (k_pool, v_pool, next_tokens), summary = canary_step(
        state, batch, kv_write, (k_pool, v_pool, None), config=config
    )
    return state.groups, state.log, k_pool, v_pool, next_tokens, summary


@functools.partial(jax.jit, static_argnames=("config", "page_size", "kv_bytes"))
def _sweep(state, plan, k_pool, v_pool, *, config, page_size, kv_bytes):
    srcs = pool_sources(k_pool, v_pool, page_size=page_size, kv_bytes=kv_bytes, config=config)
    return canary_sweep(state, (plan,), config=config, real_kv_sources=srcs)


def step_config(
    *,
    verify_capacity: int,
    write_req_capacity: int,
    real_kv_hash_mode: constants.RealKvHashMode,
    token_oracle: bool,
    enable_v_half: bool,
    backend: str,
) -> CanaryStepConfig:
    """The demo's canary step configuration: the token oracle turns on both of SGLang's token asserts."""
    return CanaryStepConfig(
        verify_capacity=verify_capacity,
        write_req_capacity=write_req_capacity,
        real_kv_hash_mode=constants.RealKvHashMode(int(real_kv_hash_mode)),
        enable_write_input_assert=bool(token_oracle),
        enable_verify_token_assert=bool(token_oracle),
        enable_v_half=bool(enable_v_half),
        backend=backend,
    )


def canary_setup(
    *,
    num_slots: int,
    verify_capacity: int,
    write_req_capacity: int,
    real_kv_hash_mode: constants.RealKvHashMode,
    token_oracle: bool,
    ring_capacity: int,
    backend: str | None,
    enable_v_half: bool,
) -> tuple[str, CanaryStepConfig, CanaryState]:
    """What every demo canary runtime starts from (:class:`CanaryRuntime` and the sharded demo's): ``(backend,
    config, state)``, the resolved backend, its :func:`step_config` and a fresh single-device state of one FULL
    group of ``num_slots`` slots (the V half with ``enable_v_half``)."""
    backend = backends.resolve_backend(backend)
    config = step_config(
        verify_capacity=verify_capacity,
        write_req_capacity=write_req_capacity,
        real_kv_hash_mode=real_kv_hash_mode,
        token_oracle=token_oracle,
        enable_v_half=enable_v_half,
        backend=backend,
    )
    group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=num_slots, has_v_half=bool(enable_v_half))
    return backend, config, CanaryState.create((group,), ring_capacity=ring_capacity)


def canary_batch(config: CanaryStepConfig, batch, req_to_token: np.ndarray, expected_pool: np.ndarray) -> CanaryBatch:
    """The scheduler's batch as the canary's :class:`CanaryBatch` (host data stays on the host); the token
    oracle's arrays only where ``config`` turns its asserts on."""
    verify_tokens = config.enable_verify_token_assert
    return CanaryBatch(
        req_pool_indices=batch.req_pool_indices.astype(np.int32),
        prefix_lens=batch.prefix_lens.astype(np.int32),
        extend_seq_lens=batch.extend_seq_lens.astype(np.int32),
        input_ids=batch.input_ids,
        positions=batch.positions,
        out_cache_loc=batch.out_cache_loc,
        req_to_token=req_to_token,
        expected_inputs=(
            ExpectedInputs(tokens=batch.expected_input_ids, positions=batch.expected_positions)
            if config.enable_write_input_assert
            else None
        ),
        req_to_verify_expected_tokens=expected_pool if verify_tokens else None,
        req_to_verify_expected_tokens_valid_lens=batch.valid_lens.astype(np.int32) if verify_tokens else None,
    )


def runtime_args(cfg) -> dict:
    """The keyword arguments both demo canary runtimes (:class:`CanaryRuntime` and the sharded demo's) take from
    the engine's :class:`~canary_jax.cli.demo.config.EngineConfig` ``cfg``: :func:`canary_setup`'s, ``page_size``
    and ``sweep_capacity`` (slots and entries; ``write_req_capacity`` is ``cfg.max_running``)."""
    return dict(
        num_slots=cfg.num_slots,
        page_size=cfg.page_size,
        verify_capacity=cfg.verify_capacity,
        write_req_capacity=cfg.max_running,
        sweep_capacity=cfg.sweep_capacity,
        real_kv_hash_mode=cfg.real_kv_hash_mode,
        token_oracle=cfg.token_oracle,
        ring_capacity=cfg.ring_capacity,
        backend=cfg.backend,
        enable_v_half=cfg.enable_v_half,
    )


class CanaryRuntimeBase:
    """What both demo canary runtimes share: the setup (:func:`canary_setup`), the last step's summary, the
    sweep count and the checks the engine makes after a step.

    Args:
      page_size: KV slots per page.
      sweep_capacity: entries of a SWEEP plan.
      setup: :func:`canary_setup`'s keyword arguments (``enable_v_half`` defaults to False).
    """

    def __init__(self, *, page_size: int, sweep_capacity: int, **setup):
        self.page_size = page_size
        self.sweep_capacity = sweep_capacity
        self.backend, self.config, self.state = canary_setup(**{"enable_v_half": False, **setup})
        self.summary = None
        self.sweep_passes = 0

    @property
    def mode(self) -> constants.RealKvHashMode:
        return self.config.real_kv_hash_mode

    def sweep_plan(self, tree):
        """The SWEEP plan of every cached prefix slot of the radix ``tree`` (:attr:`sweep_capacity` entries)."""
        return build_sweep_plan_from_radix(tree.root_node, verify_capacity=self.sweep_capacity)

    def swept(self, plan) -> int:
        """Counts a SWEEP pass of ``plan``; returns its number of entries."""
        self.sweep_passes += 1
        return int(np.asarray(plan.verify_num_valid)[0])

    def block(self) -> None:
        jax.block_until_ready(self.state)

    def plan_overflowed(self) -> bool:
        return self.summary is not None and int(np.asarray(self.summary.verify_enable).min()) == 0


class CanaryRuntime(CanaryRuntimeBase):
    """Canary state of the demo engine, its served step (:meth:`forward`: plan, HEAD, the model, TAIL in one
    program) and its SWEEP.

    Args: ``kv_bytes_per_token`` (bytes of one slot's K row in layer 0's pool), and
    :class:`CanaryRuntimeBase`'s (:func:`runtime_args` gives them from the engine config).
    """

    def __init__(self, *, kv_bytes_per_token: int, **kw):
        super().__init__(**kw)
        self.kv_bytes = kv_bytes_per_token

    @property
    def log(self):
        return self.state.log

    # Canary buffers of the K half (fault injection edits them).
    def buffer(self, name: str):
        return getattr(self.state.groups[0], name)

    def set_buffer(self, name: str, value) -> None:
        self.state = self.state.replace(groups=(self.state.groups[0].replace(**{name: value}),))

    def _batch_of(self, batch, req_to_token: np.ndarray, expected_pool: np.ndarray) -> CanaryBatch:
        return canary_batch(self.config, batch, req_to_token, expected_pool)

    @staticmethod
    def model_inputs(batch, req_to_token: np.ndarray, key, step: int) -> dict:
        """What the model is fed for ``batch``: its int32 token arrays, ``req_to_token``, the sampling rows, and
        the run's PRNG key with the step index (folded in inside the program)."""
        return dict(
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=batch.out_cache_loc,
            token_rows=batch.token_rows,
            req_to_token=req_to_token,
            sample_index=batch.sample_index,
            key=key,
            step=np.int32(step),
        )

    def forward(self, batch, req_to_token, expected_pool, params, k_pool, v_pool, model_in, *, model_cfg):
        """The served step with the canary, one jitted program (:func:`served_step`): returns ``(k_pool, v_pool,
        next_tokens)`` and keeps the new canary state and the step's summary. The pools and the canary buffers
        passed in are donated."""
        cb = self._batch_of(batch, req_to_token, expected_pool)
        groups, log, k_pool, v_pool, next_tokens, self.summary = served_step(
            self.state.groups,
            self.state.log,
            params,
            k_pool,
            v_pool,
            cb,
            model_in,
            model_cfg=model_cfg,
            config=self.config,
            page_size=self.page_size,
        )
        self.state = CanaryState(groups=groups, log=log)
        return k_pool, v_pool, next_tokens

    def model_only(self, params, k_pool, v_pool, model_in, *, model_cfg):
        """The same served step without the canary (the timing baseline): returns ``(k_pool, v_pool,
        next_tokens)``; the pools passed in are donated."""
        _, _, k_pool, v_pool, next_tokens, _ = served_step(
            None,
            None,
            params,
            k_pool,
            v_pool,
            None,
            model_in,
            model_cfg=model_cfg,
            config=self.config,
            page_size=self.page_size,
            canary=False,
        )
        return k_pool, v_pool, next_tokens

    def sweep(self, tree, k_pool, v_pool) -> int:
        """SWEEP verify of every cached prefix slot; returns the number of entries."""
        plan = self.sweep_plan(tree)
        self.state = _sweep(
            self.state, plan, k_pool, v_pool, config=self.config, page_size=self.page_size, kv_bytes=self.kv_bytes
        )
        return self.swept(plan)
