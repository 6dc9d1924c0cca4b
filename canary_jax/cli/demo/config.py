"""The demo engine's sizes: :class:`EngineConfig` (pool, batch and canary capacities, validated against the
workload up front) and :class:`ConfigError`, the error it raises.

The engine (:mod:`canary_jax.cli.demo.engine`) and its scheduler (:mod:`canary_jax.cli.demo.scheduler`) both
read the config; neither is imported here. ``engine`` re-exports both names unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from canary_jax.contract import constants

__all__ = ["ConfigError", "EngineConfig"]


class ConfigError(ValueError):
    """Impossible sizes or inputs (the CLI prints the message and exits with status 2)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Serving and canary sizes.

    Fields:
      page_size: KV slots per page.
      num_pages: pages in the pool, including the reserved page 0 (dummy slot 0).
      max_running: concurrently running requests (= batch rows = usable ``req_to_token`` rows).
      max_tokens_per_step: token capacity of one forward (decodes + prefill chunks), fixed for jit.
      chunk_size: longest prefill chunk of one request in one step.
      max_context: ``req_to_token`` width; prompt + generated tokens must fit.
      real_kv_hash_mode: NONE / PARTIAL / ALL fingerprint of layer 0's K pool in the TAIL record.
      sweep_interval: steps between SWEEP launches over the prefix cache (0 = no sweep).
      token_oracle: feed the scheduler's intended tokens and positions to the canary
        (``enable_write_input_assert`` and ``check_verify_expected_token``).
      ring_capacity: violation ring rows.
      enable_v_half: also run the V-half endpoints (fingerprinting layer 0's V pool); SGLang's default is K only.
      backend: ``None`` (auto: Pallas on GPU, ``pallas_tpu`` on a TPU, reference elsewhere), ``"reference"``,
        ``"pallas"`` or ``"pallas_tpu"``.
    """

    page_size: int = 4
    num_pages: int = 128
    max_running: int = 8
    max_tokens_per_step: int = 64
    chunk_size: int = 32
    max_context: int = 192
    real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.ALL
    sweep_interval: int = 4
    token_oracle: bool = True
    ring_capacity: int = 1024
    backend: str | None = None
    enable_v_half: bool = False

    def __post_init__(self) -> None:
        for name, lo in (
            ("page_size", 1),
            ("num_pages", 2),
            ("max_running", 1),
            ("max_tokens_per_step", 1),
            ("chunk_size", 1),
            ("max_context", 2),
            ("sweep_interval", 0),
            ("ring_capacity", 1),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.max_tokens_per_step < self.max_running:
            raise ConfigError(
                f"max_tokens_per_step ({self.max_tokens_per_step}) must be >= max_running ({self.max_running}) "
                "so every running request can decode in one step"
            )
        if self.chunk_size > self.max_tokens_per_step:
            raise ConfigError(
                f"chunk_size ({self.chunk_size}) must be <= max_tokens_per_step ({self.max_tokens_per_step})"
            )

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def verify_capacity(self) -> int:
        """Per-forward verify entries: every running request's whole context."""
        return self.max_running * self.max_context

    @property
    def sweep_capacity(self) -> int:
        """Sweep entries: the tree can never hold more slots than the pool."""
        return self.num_slots

    def check_workload(self, lengths: Sequence[int], max_new_tokens: int) -> None:
        """Refuses a workload this engine can never serve.

        Raises:
          ConfigError: a request longer than ``max_context``, or a pool smaller than one request.
        """
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        longest = max(lengths) + max_new_tokens
        if longest > self.max_context:
            raise ConfigError(
                f"a request needs {longest} tokens (prompt {max(lengths)} + max_new_tokens {max_new_tokens}) "
                f"but max_context is {self.max_context}"
            )
        need = math.ceil((longest - 1) / self.page_size)
        if need > self.num_pages - 1:
            raise ConfigError(
                f"pool too small: one request needs {need} pages of {self.page_size} slots but the pool has "
                f"{self.num_pages - 1} usable pages (num_pages={self.num_pages}, page 0 is reserved)"
            )
