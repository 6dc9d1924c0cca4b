"""The demo engine's canary, on the runtime's per-forward step API (:mod:`canary_jax.runtime.step`).

One FULL :class:`~canary_jax.runtime.groups.CanaryBufferGroup` (the demo pool has no SWA part) with HEAD and
TAIL buffers for the K half and, with ``enable_v_half``, the V half (SGLang launches only K halves by default).
TAIL and SWEEP launches fingerprint layer 0 of the K (and V) pool: the pool is
``bf16[layers, pages, page_size * kv_dim]``, so ``pool[0]`` is a :class:`~canary_jax.sources.RealKvSource`
with ``page_size`` slots per row (SGLang's packed-page layout; page size 1 is its MHA layout).

Per forward (SPEC 8.3): :func:`canary_jax.runtime.step.canary_head` plans the batch
(:func:`canary_jax.plan_builder.build_plans`) and runs HEAD verify + write; the model writes its KV;
:func:`canary_jax.runtime.step.canary_tail` runs TAIL verify + write with the same plans and the new KV. Every
``sweep_interval`` steps :func:`canary_jax.runtime.step.canary_sweep` verifies every slot of the prefix cache
against the TAIL buffer (:func:`canary_jax.runtime.sweep.build_sweep_plan_from_radix`, fixed capacity, SPEC 9
"Sweep"). All shapes are fixed, so each function compiles once; the backend is picked by
:func:`canary_jax.backends.resolve_backend` (Pallas on GPU, the jnp reference elsewhere).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from canary_jax import backends, constants
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_head, canary_sweep, canary_tail
from canary_jax.runtime.sweep import build_sweep_plan_from_radix
from canary_jax.sources import RealKvSource


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


@functools.partial(jax.jit, static_argnames=("config", "page_size", "kv_bytes"))
def _tail(state, plans, batch, k_pool, v_pool, *, config, page_size, kv_bytes):
    srcs = pool_sources(k_pool, v_pool, page_size=page_size, kv_bytes=kv_bytes, config=config)
    return canary_tail(state, plans, batch, config=config, real_kv_sources=srcs)


@functools.partial(jax.jit, static_argnames=("config", "page_size", "kv_bytes"))
def _sweep(state, plan, k_pool, v_pool, *, config, page_size, kv_bytes):
    srcs = pool_sources(k_pool, v_pool, page_size=page_size, kv_bytes=kv_bytes, config=config)
    return canary_sweep(state, (plan,), config=config, real_kv_sources=srcs)


class CanaryRuntime:
    """Canary state of the demo engine and its three phases (HEAD, TAIL, SWEEP)."""

    def __init__(
        self,
        *,
        num_slots: int,
        page_size: int,
        kv_bytes_per_token: int,
        verify_capacity: int,
        write_req_capacity: int,
        sweep_capacity: int,
        real_kv_hash_mode: constants.RealKvHashMode,
        token_oracle: bool,
        ring_capacity: int,
        backend: str | None,
        enable_v_half: bool = False,
    ):
        self.page_size = page_size
        self.kv_bytes = kv_bytes_per_token
        self.sweep_capacity = sweep_capacity
        self.backend = backends.resolve_backend(backend)
        self.config = CanaryStepConfig(
            verify_capacity=verify_capacity,
            write_req_capacity=write_req_capacity,
            real_kv_hash_mode=constants.RealKvHashMode(int(real_kv_hash_mode)),
            enable_write_input_assert=bool(token_oracle),
            enable_verify_token_assert=bool(token_oracle),
            enable_v_half=bool(enable_v_half),
            backend=self.backend,
        )
        group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=num_slots, has_v_half=bool(enable_v_half))
        self.state = CanaryState.create((group,), ring_capacity=ring_capacity)
        self._plans = None
        self._batch = None
        self.summary = None
        self.sweep_passes = 0

    @property
    def mode(self) -> constants.RealKvHashMode:
        return self.config.real_kv_hash_mode

    @property
    def log(self):
        return self.state.log

    # Canary buffers of the K half (fault injection edits them).
    def buffer(self, name: str):
        return getattr(self.state.groups[0], name)

    def set_buffer(self, name: str, value) -> None:
        self.state = self.state.replace(groups=(self.state.groups[0].replace(**{name: value}),))

    def _batch_of(self, batch, req_to_token: np.ndarray, expected_pool: np.ndarray) -> CanaryBatch:
        oracle = self.config.enable_write_input_assert
        return CanaryBatch(
            req_pool_indices=batch.req_pool_indices.astype(np.int32),
            prefix_lens=batch.prefix_lens.astype(np.int32),
            extend_seq_lens=batch.extend_seq_lens.astype(np.int32),
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=batch.out_cache_loc,
            req_to_token=req_to_token,
            expected_inputs=(
                ExpectedInputs(tokens=batch.expected_input_ids, positions=batch.expected_positions) if oracle else None
            ),
            req_to_verify_expected_tokens=expected_pool if self.config.enable_verify_token_assert else None,
            req_to_verify_expected_tokens_valid_lens=(
                batch.valid_lens.astype(np.int32) if self.config.enable_verify_token_assert else None
            ),
        )

    def head(self, batch, req_to_token: np.ndarray, expected_pool: np.ndarray) -> None:
        """Plans the batch, then HEAD verify + write."""
        self._batch = self._batch_of(batch, req_to_token, expected_pool)
        self.state, self._plans = canary_head(self.state, self._batch, config=self.config)

    def tail(self, k_pool, v_pool) -> None:
        """TAIL verify + write with this step's plans and the freshly written pools."""
        self.state, self.summary = _tail(
            self.state,
            self._plans,
            self._batch,
            k_pool,
            v_pool,
            config=self.config,
            page_size=self.page_size,
            kv_bytes=self.kv_bytes,
        )

    def sweep(self, tree, k_pool, v_pool) -> int:
        """SWEEP verify of every cached prefix slot; returns the number of entries."""
        plan = build_sweep_plan_from_radix(tree.root_node, verify_capacity=self.sweep_capacity)
        self.state = _sweep(
            self.state, plan, k_pool, v_pool, config=self.config, page_size=self.page_size, kv_bytes=self.kv_bytes
        )
        self.sweep_passes += 1
        return int(np.asarray(plan.verify_num_valid)[0])

    def block(self) -> None:
        jax.block_until_ready(self.state)

    def plan_overflowed(self) -> bool:
        return self.summary is not None and int(np.asarray(self.summary.verify_enable).min()) == 0
