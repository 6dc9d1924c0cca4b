"""What the canary needs, read from EasyDeL eSurge's own ragged-page KV cache: pass the objects you already hold.

``esurge_cache(cache, max_num_seqs=...)`` returns an :class:`EsurgeCache`: the canary's slot count, page size,
capacities and buffer group, layer 0's K-half sources viewing the cache's ``kv_pages`` as they are, and the
block-table batch adapter with eSurge's page size and null page. Nothing here imports ``easydel``: the cache is
read by attribute (duck-typed), every attribute listed with the easydel 0.3.0 file it comes from.

easydel 0.3.0 (``easydel/caching/ragged_page/cache.py``), the attributes read:

* ``RaggedPagesCache``: ``views`` (one ``RaggedPagesCacheView`` per layer) and ``metadata`` (its
  ``RaggedPagesCacheConfig``; a bare config may be passed instead of the cache).
* ``RaggedPagesCacheConfig``: ``num_pages``, ``page_size``, ``num_kv_heads``, ``k_headdim`` (= ``v_headdim``),
  ``max_model_length``, ``version`` (``"v2"``: ``kv_pages`` ``[num_pages, page_size, 2 * num_kv_heads,
  head_dim]``, K head h at combined head 2h; ``"v3"``: ``[num_pages, page_size, 2 * num_kv_heads // packing,
  packing, head_dim]``, the same interleave).
* ``RaggedPagesCacheView.kv_pages``: the layer's fused pages.

Slots are ``page * page_size + offset`` (what eSurge's ``slot_mapping`` and the block tables index), so the
canary has ``num_pages * page_size`` slots. Page 0 is eSurge's null page (block-table padding): the batch
reads it as "no slot" (``null_block=0``), and slot 0 is the canary's padding slot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from canary_jax.adapters.block_tables import from_block_tables
from canary_jax.adapters.layouts import sources_for_fused_kv
from canary_jax.adapters.slot_pieces import _check_pos_int
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryStepConfig
from canary_jax.runtime.step_inputs import CanaryCapacities

_WHO = "esurge_cache"


def _pos_int(obj: Any, name: str) -> int:
    if not hasattr(obj, name):
        raise TypeError(
            f"kv-canary: {_WHO}: {type(obj).__name__} has no attribute {name!r}; expected easydel 0.3.0's "
            "RaggedPagesCache or RaggedPagesCacheConfig (easydel/caching/ragged_page/cache.py)"
        )
    return _check_pos_int(_WHO, f"cache config {name}", getattr(obj, name))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EsurgeCache:
    """The canary's sizes for one eSurge engine (build it with :func:`esurge_cache`).

    Fields:
      num_slots: canary slots, ``num_pages * page_size`` (the null page 0 included).
      page_size: eSurge's page size (the block tables' ``block_size``).
      num_kv_heads, head_dim: the cache's KV heads and head size.
      max_batch_size: write rows a step may carry (``max_num_seqs + 1``).
      max_seq_len: ``max_model_length``.
      capacities: :meth:`CanaryCapacities.from_pool` of those sizes (SGLang's rule).
    """

    num_slots: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    max_batch_size: int
    max_seq_len: int
    capacities: CanaryCapacities

    def step_config(self, **kw: Any) -> CanaryStepConfig:
        """A :class:`CanaryStepConfig` with these capacities (``real_kv_hash_mode`` ALL unless given)."""
        return self.capacities.step_config(**kw)

    def groups(self) -> list[CanaryBufferGroup]:
        """One FULL group of ``num_slots`` slots (K half only)."""
        return [CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=self.num_slots, has_v_half=False)]

    def sources(self, cache: Any, *, read_bytes: int | None = None) -> tuple:
        """Layer 0's ``((sources_k, ()),)`` for ``real_kv_sources=``: the K heads of ``views[0].kv_pages`` as
        strided chunks (no copy). ``cache``: the ``RaggedPagesCache``, its ``views`` list, or layer 0's
        ``kv_pages`` array (traced or not).

        Raises:
          TypeError / ValueError: no ``views`` / ``kv_pages``, or pages of another slot count than
            ``num_slots`` (naming the shape found).
        """
        pages = cache
        views = getattr(cache, "views", cache)
        if isinstance(views, (list, tuple)):
            if not views:
                raise TypeError("kv-canary: EsurgeCache.sources: the cache has no views")
            pages = getattr(views[0], "kv_pages", views[0])
        shape = tuple(int(d) for d in getattr(pages, "shape", ()))
        if len(shape) < 3 or shape[0] * shape[1] != self.num_slots:
            raise ValueError(
                f"kv-canary: EsurgeCache.sources: layer 0's kv_pages must be [num_pages, page_size, ...] with "
                f"num_pages * page_size = {self.num_slots}, got shape {shape}"
            )
        k = sources_for_fused_kv(pages, half="k", num_kv_heads=self.num_kv_heads, read_bytes=read_bytes)
        return ((k, ()),)

    def batch(self, **fields: Any) -> CanaryBatch:
        """:func:`~canary_jax.adapters.block_tables.from_block_tables` with eSurge's ``block_size`` and null page 0.

        Fields, from ``BatchMetadataPreparer.prepare_batch_metadata``'s metadata (easydel 0.3.0
        ``esurge/runners/executors/batch_preparer.py``): ``input_ids`` / ``positions`` (``input_ids_buf``,
        ``position_ids_buf``, ``int32[T]``), ``query_start_loc`` (``int32[rows + 1]``), ``seq_lens``
        (``int32[rows]``, after the step), ``block_table`` (``pages_tables``, ``int32[rows, max_pages]``),
        ``num_reqs``; and the optional expected inputs / tokens.
        """
        fields.setdefault("block_size", self.page_size)
        fields.setdefault("null_block", 0)
        return from_block_tables(**fields)


def esurge_cache(cache: Any, *, max_num_seqs: int) -> EsurgeCache:
    """Reads the canary's sizes from eSurge's own ``RaggedPagesCache`` (or its ``RaggedPagesCacheConfig``).

    Args:
      cache: the engine's ``RaggedPagesCache`` (``RaggedPagesCache.init_cache(...)``) or its config.
      max_num_seqs: the scheduler's ``SchedulerConfig.max_num_seqs`` (rows per step).

    Returns:
      An :class:`EsurgeCache`.

    Raises:
      TypeError: an object missing an attribute this reads.
      ValueError: a size that is not a positive int, K and V head sizes that differ, or a layout version other
        than v2 / v3 (naming the value).
    """
    cfg = getattr(cache, "metadata", cache)
    pages, ps = _pos_int(cfg, "num_pages"), _pos_int(cfg, "page_size")
    heads, dim = _pos_int(cfg, "num_kv_heads"), _pos_int(cfg, "k_headdim")
    if getattr(cfg, "v_headdim", dim) != dim:
        raise ValueError(f"kv-canary: {_WHO}: k_headdim={dim} but v_headdim={cfg.v_headdim}: not a fused layout")
    version = getattr(cfg, "version", "v3")
    if version not in ("v2", "v3"):
        raise ValueError(f"kv-canary: {_WHO}: cache version must be 'v2' or 'v3', got {version!r}")
    ctx = _pos_int(cfg, "max_model_length")
    max_num_seqs = _check_pos_int(_WHO, "max_num_seqs", max_num_seqs)
    num_slots, bs = pages * ps, max_num_seqs + 1
    return EsurgeCache(
        num_slots=num_slots,
        page_size=ps,
        num_kv_heads=heads,
        head_dim=dim,
        max_batch_size=bs,
        max_seq_len=ctx,
        capacities=CanaryCapacities.from_pool(num_slots=num_slots, max_batch_size=bs, max_seq_len=ctx),
    )
