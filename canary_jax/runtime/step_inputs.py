"""The guard's fixed sizes and what its step function exchanges: capacities, step inputs, real-KV sources.

:class:`~canary_jax.runtime.guard.CanaryGuard` fixes its sizes once and then, per call, hands ``step_fn`` the
batch and takes back the real-KV sources. This module holds those contracts, so the guard itself
(:mod:`canary_jax.runtime.guard`) only sequences the program and the host pump. Its public names are
re-exported by :mod:`canary_jax.runtime`, by :mod:`canary_jax.integration` (their first home) and by
:mod:`canary_jax.step_inputs` (their previous one).

* :class:`CanaryCapacities`: the per-forward verify entries, write rows and sweep entries the guard's plans
  hold, by SGLang's rule (``python/sglang/srt/kv_canary/capacities.py``, ``CanaryLaunchCapacities``;
  :data:`VERIFY_CAPACITY_POOL_FACTOR` is its ``pool_slot_count * 3``). Fixed sizes are what keep the guard to
  one compiled program per bucket shape.
* :class:`StepInputs`: the batch as ``step_fn`` sees it, an ``int32`` view of the padded
  :class:`~canary_jax.runtime.state.CanaryBatch` (``int32[T]`` per token, ``int32[bs]`` per row,
  ``req_to_token`` as given, ``int32[]`` live tokens), a JAX pytree. The canary checks the exact int64 values
  itself; host (numpy) values outside int32 are refused before anything runs (``ValueError`` naming the field
  and index), JAX arrays are not read on the host.
* :func:`normalize_sources`: the short forms of the real-KV sources ``step_fn`` returns, to one
  ``(sources_k, sources_v)`` pair per buffer group (``TypeError`` for a short form with several groups).
* :func:`parse_real_kv_hash_mode`: the hash mode as SGLang's ``--kv-canary-real-data`` spells it
  (``none`` / ``partial`` / ``all``, or the enum or its int; ``ValueError`` otherwise).
* ``req_to_token``'s static signature (shape, or a slot table's structure and leaf shapes), which must stay
  fixed across steps, and its dense ``int32[rows, max_seq_len]`` form for dumps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import constants, ints
from canary_jax.contract.sources import RealKvSource
from canary_jax.runtime.state import _INDEX_FIELDS, CanaryBatch, CanaryStepConfig

__all__ = [
    "VERIFY_CAPACITY_POOL_FACTOR",
    "CanaryCapacities",
    "StepInputs",
    "normalize_sources",
    "parse_real_kv_hash_mode",
]

# the int64-valued batch fields step_fn receives as int32 (StepInputs; the guard's host int32 check,
# :func:`canary_jax.runtime.prepare.check_host_int32`, reads the same tuple)
_STEP_INPUT_INT32_FIELDS = _INDEX_FIELDS
VERIFY_CAPACITY_POOL_FACTOR = 3  # SGLang: per_forward_verify_capacity = pool_slot_count * 3


# --- capacities ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryCapacities:
    """The fixed sizes of the guard's per-forward and sweep plans (SGLang ``CanaryLaunchCapacities``).

    Fields:
      verify_capacity: per-forward VerifyPlan entries C. A step that plans more verifies nothing and is
        reported (SGLang's overflow warning, :class:`~canary_jax.runtime.report.EnableWarner`).
      write_req_capacity: WritePlan rows Cw: the most batch rows one step may have.
      sweep_capacity: sweep VerifyPlan entries (a sweep source with more raises SGLang's RuntimeError).

    Raises:
      ValueError: a capacity that is not a positive int (SGLang's ``kv-canary: {name} must be positive, got
        {v}``).
    """

    verify_capacity: int
    write_req_capacity: int
    sweep_capacity: int

    def __post_init__(self) -> None:
        for name in ("verify_capacity", "write_req_capacity", "sweep_capacity"):
            if ints.check_int(getattr(self, name), name=name) <= 0:
                raise ValueError(f"kv-canary: {name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_pool(cls, *, num_slots: int, max_batch_size: int, max_seq_len: int) -> CanaryCapacities:
        """Capacities from the pool and batch sizes, by SGLang's rule.

        SGLang (``python/sglang/srt/kv_canary/capacities.py``, ``CanaryLaunchCapacities.from_args``, called by
        ``install_canary`` with ``pool_slot_count = model_runner.max_total_num_tokens``):

        * ``per_forward_verify_capacity = pool_slot_count * 3``: the KV tokens a step can verify, with 3x
          headroom because radix prefix sharing lets ``sum(prefix_lens)`` exceed the pool (observed ~2x).
          canary-jax caps it at ``max_batch_size * max_seq_len``, the most entries a batch can ever plan (each
          row verifies at most its ``max_seq_len`` positions), so a small pool of long contexts allocates no
          entry that can never be used; with the cap, a plan can never overflow.
        * ``per_forward_write_req_capacity = max(cuda_graph_max_bs, req_to_token_pool_size)``: here
          ``max_batch_size``, the most rows one step may carry.
        * sweep capacity: ``pool_slot_count`` (SGLang's ``_compute_launch_capacities``: ``min(pool_slot_count,
          1_000_000)``; a prefix cache never holds more slots than the pool).

        Args:
          num_slots: KV slots of the pool (``pool_slot_count``; slot 0, the padding slot, included).
          max_batch_size: rows a step may carry (``req_to_token_pool_size``).
          max_seq_len: ``req_to_token``'s width, the longest context.

        Raises:
          ValueError: a non-positive size, naming it.
        """
        for name, v in (("num_slots", num_slots), ("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len)):
            if ints.check_int(v, name=name) <= 0:
                raise ValueError(f"kv-canary: {name} must be positive, got {v}")
        return cls(
            verify_capacity=min(VERIFY_CAPACITY_POOL_FACTOR * int(num_slots), int(max_batch_size) * int(max_seq_len)),
            write_req_capacity=int(max_batch_size),
            sweep_capacity=int(num_slots),
        )

    def step_config(self, **kw: Any) -> CanaryStepConfig:
        """A :class:`~canary_jax.runtime.state.CanaryStepConfig` with these verify and write capacities; keywords
        add the rest (``real_kv_hash_mode``: ALL unless given, as :class:`~canary_jax.runtime.guard.CanaryGuard`;
        the asserts, ``backend``)."""
        kw.setdefault("real_kv_hash_mode", constants.RealKvHashMode.ALL)
        return CanaryStepConfig(verify_capacity=self.verify_capacity, write_req_capacity=self.write_req_capacity, **kw)


# --- what the step function sees -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepInputs:
    """The batch as ``step_fn`` sees it: int32 JAX arrays, padded to the step's bucket shapes.

    Fields (T = the token bucket, bs = the row bucket):
      input_ids, positions, out_cache_loc: ``int32[T]``; entries ``>= num_tokens`` are padding (id 0,
        position 0, slot 0).
      req_pool_indices, prefix_lens, extend_seq_lens: ``int32[bs]``; padding rows have index 0 and zero
        lengths.
      req_to_token: ``int32[max_reqs, max_seq_len]`` as given (or the batch's slot table, a
        :class:`~canary_jax.planning.slot_tables.SlotTable` pytree, when the batch carries one).
      num_tokens: ``int32[]``, the live tokens of the step.

    The canary itself checks the exact int64 values, with x64 off or on; ``step_fn`` gets them as int32
    (serving-stack ids, positions and slots fit in int32). :meth:`~canary_jax.integration.CanaryGuard.step`
    refuses host (numpy / list) values outside int32 in these fields
    (:func:`~canary_jax.runtime.prepare.check_host_int32`), naming the
    field, so ``step_fn`` never sees a truncated value of host data. Fields given as JAX arrays are not read on
    the host (no sync): that they fit int32 is then the caller's contract, and ``step_fn`` would see the low 32
    bits of a value that does not.
    """

    input_ids: jax.Array
    positions: jax.Array
    out_cache_loc: jax.Array
    req_pool_indices: jax.Array
    prefix_lens: jax.Array
    extend_seq_lens: jax.Array
    req_to_token: Any
    num_tokens: jax.Array

    @property
    def seq_lens(self) -> jax.Array:
        """``prefix_lens + extend_seq_lens`` (``int32[bs]``): each row's KV length after the step."""
        return self.prefix_lens + self.extend_seq_lens

    @classmethod
    def of(cls, batch: CanaryBatch, num_tokens: Any) -> StepInputs:
        """The int32 view of a (padded) CanaryBatch whose int64 fields are ``uint32[..., 2]`` pairs."""
        low = lambda p: jax.lax.bitcast_convert_type(jnp.asarray(p)[..., 0], jnp.int32)  # noqa: E731
        return cls(
            **{name: low(getattr(batch, name)) for name in _STEP_INPUT_INT32_FIELDS},
            req_to_token=batch.req_to_token,
            num_tokens=jnp.asarray(num_tokens, jnp.int32),
        )


jax.tree_util.register_dataclass(
    StepInputs,
    data_fields=[f.name for f in dataclasses.fields(StepInputs)],
    meta_fields=[],
)


def parse_real_kv_hash_mode(mode: Any) -> constants.RealKvHashMode:
    """A :class:`~canary_jax.contract.constants.RealKvHashMode`, its int value, or a name (``none`` / ``partial`` /
    ``all``, any case: SGLang's ``--kv-canary-real-data`` is upper-cased and looked up by member name).

    Raises:
      ValueError: an unknown name or value, listing the known ones.
    """
    if isinstance(mode, str):
        try:
            return constants.RealKvHashMode[mode.strip().upper()]
        except KeyError:
            raise ValueError(f"kv-canary: real_kv_hash_mode must be one of none/partial/all, got {mode!r}") from None
    try:
        return constants.RealKvHashMode(int(mode))
    except (TypeError, ValueError):
        raise ValueError(f"kv-canary: real_kv_hash_mode must be one of none/partial/all, got {mode!r}") from None


def normalize_sources(real_kv_sources: Any, num_groups: int) -> Any:
    """Accepts the short forms of a step's real-KV sources and returns one ``(sources_k, sources_v)`` pair per
    group (the form :func:`canary_jax.runtime.step.canary_tail` takes).

    * ``None``: no sources (only valid with ``real_kv_hash_mode`` NONE);
    * one :class:`~canary_jax.contract.sources.RealKvSource`, or a tuple / list of them: the K half of a single group;
    * anything else is passed through (one pair per group, checked by the step).

    Raises:
      TypeError: a short form with more than one group (which group would it belong to?).
    """
    if real_kv_sources is None:
        return None
    short = isinstance(real_kv_sources, RealKvSource) or (
        isinstance(real_kv_sources, (tuple, list))
        and real_kv_sources
        and all(isinstance(s, RealKvSource) for s in real_kv_sources)
    )
    if not short:
        return real_kv_sources
    if num_groups != 1:
        raise TypeError(
            f"kv-canary: step_fn returned RealKvSource(s) without a group, but the guard has {num_groups} buffer "
            "groups; return one (sources_k, sources_v) pair per group"
        )
    srcs = (real_kv_sources,) if isinstance(real_kv_sources, RealKvSource) else tuple(real_kv_sources)
    return ((srcs, ()),)


def _table_signature(table: Any) -> tuple:
    """The static shape of ``req_to_token``: an array's shape, or a slot table's structure and leaf shapes."""
    if getattr(table, "ndim", None) is not None and hasattr(table, "shape"):
        return tuple(table.shape)
    leaves, treedef = jax.tree_util.tree_flatten(table)
    return (treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))


def _describe_signature(sig: tuple) -> str:
    if sig and isinstance(sig[0], int):
        return str(sig)
    return f"a {sig[0]} with leaves {list(sig[1])}"


def _dense_req_to_token(table: Any, rpi: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``int32[rows, max_seq_len]`` with each live row's slots, from an array or a slot table (for dumps)."""
    if getattr(table, "ndim", None) == 2:
        return np.asarray(table)
    full = getattr(table, "full", table)  # GroupSlotTables: the full-pool table
    width = int(full.max_seq_len)
    out = np.zeros((int(max(rpi.max(initial=0), 0)) + 1, width), np.int32)
    for b, (r, n) in enumerate(zip(rpi.tolist(), lens.tolist())):
        n = min(int(n), width)
        if r <= 0 or n <= 0:
            continue
        pos = np.arange(n, dtype=np.int64)
        got = full.lookup(
            jax.device_put(np.full((n,), b, np.int32)),
            jax.device_put(ints.int64_to_pairs_np(np.full((n,), r, np.int64))),
            jax.device_put(ints.int64_to_pairs_np(pos)),
        )
        out[r, :n] = ints.pairs_to_int64_np(np.asarray(got)).astype(np.int32)
    return out
