"""What the canary needs, read from sglang-jax's own pool objects: pass the objects you already hold.

``sglang_jax_pools(token_to_kv_pool, req_to_token_pool, allocator=...)`` returns a :class:`SglangJaxPools`:
the canary's slot count (padding rows included), page sizes, capacities and buffer groups, a function giving
layer 0's ``(sources_k, sources_v)`` from the pool's ``kv_buffer`` inside your traced step, and the batch
adapter with the right ``cache_loc_page_size``. Nothing here imports ``sgl_jax``: the pools are read by
attribute (duck-typed), and every attribute read is listed below with the sglang-jax 0.0.2 file it comes from.

sglang-jax 0.0.2 (``sgl_jax/srt/mem_cache/``), the attributes read:

* ``memory_pool.py`` ``KVCache.__init__``: ``size`` (tokens, page-aligned by ``ModelRunner.init_memory_pool``),
  ``page_size``, ``layer_num``, ``start_layer`` (``kv_buffer[0]`` is layer ``start_layer``).
* ``memory_pool.py`` ``MHATokenToKVPool``: ``head_num``, ``head_dim``, ``kv_buffer`` (a list of ``layer_num``
  arrays, each ``[size + page_size, 2 * head_num, head_dim]`` from ``_create_buffers``, K head h in row 2h, V
  head h in row 2h + 1 by ``merge_kv``). ``MLATokenToKVPool`` (``kv_lora_rank``, one latent row per slot) has
  no K/V halves and is refused.
* ``memory_pool.py`` ``ReqToTokenPool``: ``size`` (rows; ``ModelRunner`` passes ``max_num_reqs + 1``),
  ``max_context_len``, ``req_to_token`` (host ``int32[size, max_context_len]``, rows from 0).
* ``allocator.py`` ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``: ``page_size``, ``size`` and
  ``get_kvcache()`` (checked to be the same pool). Slot 0 (page 0) is never handed out: it is the canary's
  padding slot too, and padded tokens (``out_cache_loc = -1``) are never written.

The slot count is ``size + page_size``: every row of ``kv_buffer`` is a slot the canary may be asked about
(``cache_loc`` pads with slot 0), so the canary buffer covers the pool exactly, rows and all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from canary_jax.adapters.layouts import sources_for_fused_kv
from canary_jax.adapters.sglang_jax import from_sglang_jax_batch
from canary_jax.adapters.slot_pieces import _check_pos_int
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.guard import CanaryGuard
from canary_jax.runtime.state import CanaryBatch, CanaryStepConfig
from canary_jax.runtime.step_inputs import CanaryCapacities

_WHO = "sglang_jax_pools"
_GUARD_STEPS: dict = {}  # (pools, write_fn, v_half, read_bytes) -> step_fn: guards of one runner share programs


def _attr(obj: Any, name: str, what: str) -> Any:
    if not hasattr(obj, name):
        raise TypeError(
            f"kv-canary: {_WHO}: {what} ({type(obj).__name__}) has no attribute {name!r}; expected sglang-jax "
            f"0.0.2's {what} (sgl_jax/srt/mem_cache)"
        )
    return getattr(obj, name)


def _pos_int(obj: Any, name: str, what: str) -> int:
    return _check_pos_int(_WHO, f"{what}.{name}", _attr(obj, name, what))


def _kv_layer0(kv_buffer: Any, who: str) -> Any:
    """``kv_buffer[0]`` of a pool object or of its ``kv_buffer`` list."""
    bufs = getattr(kv_buffer, "kv_buffer", kv_buffer)
    if not isinstance(bufs, (list, tuple)) or not bufs:
        raise TypeError(
            f"kv-canary: {who}: needs the pool's kv_buffer (a non-empty list of per-layer arrays) or the pool, "
            f"got {type(bufs).__name__}"
        )
    return bufs[0]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SglangJaxPools:
    """The canary's sizes for one sglang-jax model runner (build it with :func:`sglang_jax_pools`).

    Fields:
      num_slots: canary slots = KV pool rows, ``size + page_size`` (page 0 / slot 0 included).
      page_size: the KV pool's page size (1: token allocator).
      cache_loc_page_size: the page size ``get_model_worker_batch`` aligns each ``cache_loc`` span to (the
        Scheduler passes its ``page_size``: the same number).
      num_kv_heads, head_dim: ``head_num`` and ``head_dim`` of the pool.
      max_batch_size: rows a step may carry (``req_to_token_pool.size`` unless given).
      max_seq_len: ``req_to_token_pool.max_context_len``.
      capacities: :meth:`CanaryCapacities.from_pool` of those sizes (SGLang's rule).
    """

    num_slots: int
    page_size: int
    cache_loc_page_size: int
    num_kv_heads: int
    head_dim: int
    max_batch_size: int
    max_seq_len: int
    capacities: CanaryCapacities

    def step_config(self, **kw: Any) -> CanaryStepConfig:
        """A :class:`CanaryStepConfig` with these capacities; keywords add the rest (``real_kv_hash_mode``: ALL
        unless given, as :class:`~canary_jax.runtime.guard.CanaryGuard`; the asserts, ``backend``)."""
        return self.capacities.step_config(**kw)

    def groups(self, *, has_v_half: bool = False) -> list[CanaryBufferGroup]:
        """One FULL group of ``num_slots`` slots (sglang-jax 0.0.2 has no SWA pool)."""
        return [CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=self.num_slots, has_v_half=has_v_half)]

    def sources(self, kv_buffer: Any, *, v_half: bool = False, read_bytes: int | None = None) -> tuple:
        """Layer 0's ``((sources_k, sources_v),)`` for ``real_kv_sources=``, viewing the fused layer as it is.

        Call it inside your traced step on the ``kv_buffer`` the step just wrote (or outside on the pool):
        the sources hold ``kv_buffer[0]`` itself, K heads as strided chunks (rows 0, 2, ...), V heads (rows 1,
        3, ...) only with ``v_half=True``; nothing is reshaped or copied.

        Args:
          kv_buffer: the pool's ``kv_buffer`` list (arrays or tracers), or the pool object.
          v_half: also return the V half's source (for groups made with ``has_v_half=True``).
          read_bytes: bytes hashed per half under ALL; None = all ``num_kv_heads * head_dim`` elements.

        Raises:
          TypeError / ValueError: not a list of arrays, or a layer whose shape is not ``[num_slots, 2 *
            num_kv_heads, head_dim]`` (naming the shape found).
        """
        layer = _kv_layer0(kv_buffer, "SglangJaxPools.sources")
        want = (self.num_slots, 2 * self.num_kv_heads, self.head_dim)
        got = tuple(int(d) for d in getattr(layer, "shape", ()))
        if got != want:
            raise ValueError(
                f"kv-canary: SglangJaxPools.sources: kv_buffer[0] must be [size + page_size, 2 * head_num, "
                f"head_dim] = {want}, got shape {got}"
            )
        kw = dict(num_kv_heads=self.num_kv_heads, paged=False, read_bytes=read_bytes)
        k = sources_for_fused_kv(layer, half="k", **kw)
        v = sources_for_fused_kv(layer, half="v", **kw) if v_half else ()
        return ((k, v),)

    def guard(self, write_fn: Any, *, v_half: bool = False, read_bytes: int | None = None, **kw: Any) -> CanaryGuard:
        """A :class:`~canary_jax.runtime.guard.CanaryGuard` sized from these pools, around your KV write.

        ``write_fn(kv_buffer, inputs)`` is your model step: it gets the pool's ``kv_buffer`` list (traced) and
        the guard's :class:`~canary_jax.runtime.step_inputs.StepInputs` (int32 ``input_ids`` / ``positions`` /
        ``out_cache_loc``, padding tokens at slot 0), and returns the new ``kv_buffer`` list, or
        ``(kv_buffer, outputs)``. The guard hashes :meth:`sources` of the returned list, so no source is built
        by hand. Per forward: ``pool.kv_buffer = guard.step(pool.kv_buffer, canary.batch(forward_batch))``
        (``kv_buffer`` is donated; with outputs, ``step`` returns ``(kv_buffer, outputs)``).

        Args:
          write_fn: the KV write; pass the same function object for every guard of this runner (the step
            program is keyed on it).
          v_half, read_bytes: as :meth:`sources` (``v_half=True`` also sets ``has_v_half`` / ``enable_v_half``).
          **kw: the rest of :class:`CanaryGuard`'s keywords (``mode``, ``real_kv_hash_mode``, ``sweep_interval``,
            ``on_violations``, the asserts, ...); ``num_slots``, ``max_batch_size``, ``max_seq_len`` and
            ``capacities`` come from these pools.

        Raises:
          TypeError: ``write_fn`` not callable, or a sizing keyword given (the pools fix them).
        """
        if not callable(write_fn):
            raise TypeError(
                f"kv-canary: SglangJaxPools.guard: write_fn must be callable, got {type(write_fn).__name__}"
            )
        fixed = sorted({"num_slots", "max_batch_size", "max_seq_len", "capacities", "groups"} & set(kw))
        if fixed:
            raise TypeError(f"kv-canary: SglangJaxPools.guard: {fixed} come from the pools; do not pass them")
        key = (self, write_fn, bool(v_half), read_bytes)
        step_fn = _GUARD_STEPS.get(key)
        if step_fn is None:

            def step_fn(kv_buffer, inputs):
                out = write_fn(kv_buffer, inputs)
                kv, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
                return (kv, self.sources(kv, v_half=v_half, read_bytes=read_bytes), *rest)

            _GUARD_STEPS[key] = step_fn
        if v_half:
            kw.setdefault("has_v_half", True)
            kw.setdefault("enable_v_half", True)
        return CanaryGuard(
            step_fn,
            num_slots=self.num_slots,
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_seq_len,
            capacities=self.capacities,
            **kw,
        )

    def batch(self, forward_batch: Any, **kw: Any) -> CanaryBatch:
        """:func:`~canary_jax.adapters.sglang_jax.from_sglang_jax_batch` with this runner's
        ``cache_loc_page_size`` (keywords add the expected inputs / tokens)."""
        kw.setdefault("cache_loc_page_size", self.cache_loc_page_size)
        return from_sglang_jax_batch(forward_batch, **kw)


def sglang_jax_pools(
    token_to_kv_pool: Any,
    req_to_token_pool: Any,
    *,
    allocator: Any = None,
    max_batch_size: int | None = None,
) -> SglangJaxPools:
    """Reads the canary's sizes from sglang-jax's own ``MHATokenToKVPool`` and ``ReqToTokenPool``.

    Args:
      token_to_kv_pool: the model runner's ``MHATokenToKVPool`` (``model_runner.token_to_kv_pool``).
      req_to_token_pool: its ``ReqToTokenPool``.
      allocator: optional ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``; checked to serve this
        pool with its page size.
      max_batch_size: rows a step may carry, padding rows included (``ModelWorker``'s largest ``bs_paddings``
        bucket fits); None = ``req_to_token_pool.size``.

    Returns:
      A :class:`SglangJaxPools`.

    Raises:
      NotImplementedError: an MLA pool (``kv_lora_rank``: no K/V halves to hash).
      TypeError: an object missing an attribute this reads (naming it and the object's type).
      ValueError: a size that is not a positive int, a ``kv_buffer`` layer of another shape than
        ``[size + page_size, 2 * head_num, head_dim]``, an allocator of another page size or pool (each naming
        the attribute and the value found).
    """
    pool, r2t = token_to_kv_pool, req_to_token_pool
    if hasattr(pool, "kv_lora_rank"):
        raise NotImplementedError(
            f"kv-canary: {_WHO}: token_to_kv_pool is an MLA pool ({type(pool).__name__}, kv_lora_rank="
            f"{pool.kv_lora_rank!r}): one latent row per slot has no K/V halves; hash it with "
            "canary_jax.adapters.layouts.sources_for_token_major(kv_buffer[0], paged=False) and your own sizes"
        )
    size = _pos_int(pool, "size", "token_to_kv_pool")
    page = _pos_int(pool, "page_size", "token_to_kv_pool")
    heads = _pos_int(pool, "head_num", "token_to_kv_pool")
    dim = _pos_int(pool, "head_dim", "token_to_kv_pool")
    layers = _pos_int(pool, "layer_num", "token_to_kv_pool")
    if size % page:
        raise ValueError(f"kv-canary: {_WHO}: token_to_kv_pool.size={size} is not a multiple of page_size={page}")
    bufs = _attr(pool, "kv_buffer", "token_to_kv_pool")
    layer0 = _kv_layer0(bufs, _WHO)
    want = (size + page, 2 * heads, dim)
    got = tuple(int(d) for d in getattr(layer0, "shape", ()))
    if len(bufs) != layers or got != want:
        raise ValueError(
            f"kv-canary: {_WHO}: token_to_kv_pool.kv_buffer must be layer_num={layers} arrays [size + page_size, "
            f"2 * head_num, head_dim] = {want} (sglang-jax 0.0.2's fused layout), got {len(bufs)} with "
            f"kv_buffer[0] shape {got}"
        )
    rows = _pos_int(r2t, "size", "req_to_token_pool")
    ctx = _pos_int(r2t, "max_context_len", "req_to_token_pool")
    if allocator is not None:
        a_page = _pos_int(allocator, "page_size", "allocator")
        if a_page != page:
            raise ValueError(f"kv-canary: {_WHO}: allocator.page_size={a_page} but token_to_kv_pool.page_size={page}")
        get = getattr(allocator, "get_kvcache", None)
        if callable(get) and get() is not pool:
            raise ValueError(f"kv-canary: {_WHO}: allocator.get_kvcache() is not token_to_kv_pool")
    bs = rows if max_batch_size is None else _check_pos_int(_WHO, "max_batch_size", max_batch_size)
    num_slots = size + page
    return SglangJaxPools(
        num_slots=num_slots,
        page_size=page,
        cache_loc_page_size=page,
        num_kv_heads=heads,
        head_dim=dim,
        max_batch_size=bs,
        max_seq_len=ctx,
        capacities=CanaryCapacities.from_pool(num_slots=num_slots, max_batch_size=bs, max_seq_len=ctx),
    )
