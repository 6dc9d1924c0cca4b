"""Fault injection for your own serving stack: the bugs the KV canary exists to catch, as pure functions, plus a
host-side campaign tracker that says which faults were caught, how fast, and what fired falsely.

Every fault models a serving bug class SGLang's self-test perturbations inject (``python/sglang/srt/kv_canary/
perturb/``: ``real_kv_used``, ``real_kv_unused_cache``, ``real_kv_post_forward``, ``req_to_token``,
``next_token_swap``). The functions take arrays (numpy, or JAX and then jit-able, indices may be traced) and
return new ones; nothing is changed in place:

=========================  ===============================================  =====================================
function                   the bug                                          what catches it
=========================  ===============================================  =====================================
:func:`flip_kv_bits`       KV bytes of a slot change after they were        TAIL verify ``verify_real_kv_hash`` of
                           written: a slot a running request reads          the next step reading the slot
                           (``kv_flip_used``), a slot the step just wrote,  (the same for post-TAIL flips); an
                           after TAIL (``kv_flip_post_tail``), or a cached  orphan only by the SWEEP verify
                           slot no request reads (``kv_flip_orphan``)       (``sweep_interval > 0``)
:func:`remap_req_to_token`  a ``req_to_token`` entry points at another      HEAD/TAIL ``verify_position`` +
                           live slot (``r2t_remap``)                        ``verify_chain_hash``
:func:`remap_block_table`  a block-table (page-table) entry points at       the same, on every slot of the page
                           another page (``block_table_remap``)
:func:`swap_token`,        the token fed to the model differs from the      ``write_token`` (write input assert),
:func:`swap_tokens`        request's history (``token_swap``)               then ``verify_token`` (token oracle)
:func:`shift_position`     a token fed at the wrong position (``pos_shift``)  ``write_position``, then
                                                                              ``verify_position``
:func:`flip_canary_bits`   a canary record itself corrupted                 verify chain / position
=========================  ===============================================  =====================================

PARTIAL real-KV hashing sees only bytes ``[0, 16)`` of a slot; NONE sees no KV fault at all. SGLang's own
perturbation XORs ``0xFF`` into byte 0 of a slot (the defaults here).

The slot pickers (:func:`pick_used_slot`, :func:`pick_orphan_slot`, :func:`pick_written_slot`) choose targets
on the host from your batch metadata, and :class:`FaultCampaign` tracks episodes: inject, observe the violations
each step recorded (e.g. ``CanaryGuard(on_violations=campaign.observe)``), and :meth:`FaultCampaign.report`.

The package holds one job a module: :mod:`canary_jax.tools.faults.buffers` (KV and canary bytes),
:mod:`canary_jax.tools.faults.metadata` (slot tables and the token stream), :mod:`canary_jax.tools.faults.pickers` (the
slot pickers), :mod:`canary_jax.tools.faults.campaign` (the tracker) and :mod:`canary_jax.tools.faults.array_checks`
(the checks they share); every name is re-exported here, and the fault kind names are defined here.
"""

from __future__ import annotations

from canary_jax.tools.faults.buffers import flip_canary_bits, flip_kv_bits
from canary_jax.tools.faults.campaign import (
    CampaignReport,
    Episode,
    FaultCampaign,
    KindReport,
    kind_report,
    reason_keys,
)
from canary_jax.tools.faults.metadata import (
    remap_block_table,
    remap_req_to_token,
    shift_position,
    swap_token,
    swap_tokens,
)
from canary_jax.tools.faults.pickers import pick_orphan_slot, pick_used_slot, pick_written_slot

__all__ = [
    "BLOCK_TABLE_REMAP",
    "CANARY_CORRUPT",
    "FAULT_KINDS",
    "KV_FLIP_ORPHAN",
    "KV_FLIP_POST_TAIL",
    "KV_FLIP_USED",
    "POSITION_SHIFT",
    "REQ_TO_TOKEN_REMAP",
    "TOKEN_SWAP",
    "CampaignReport",
    "Episode",
    "FaultCampaign",
    "KindReport",
    "flip_canary_bits",
    "flip_kv_bits",
    "kind_report",
    "pick_orphan_slot",
    "pick_used_slot",
    "pick_written_slot",
    "reason_keys",
    "remap_block_table",
    "remap_req_to_token",
    "shift_position",
    "swap_token",
    "swap_tokens",
]

KV_FLIP_USED = "kv_flip_used"
KV_FLIP_POST_TAIL = "kv_flip_post_tail"
KV_FLIP_ORPHAN = "kv_flip_orphan"
REQ_TO_TOKEN_REMAP = "r2t_remap"
BLOCK_TABLE_REMAP = "block_table_remap"
TOKEN_SWAP = "token_swap"
POSITION_SHIFT = "pos_shift"
CANARY_CORRUPT = "canary_corrupt"
FAULT_KINDS = (
    KV_FLIP_USED,
    KV_FLIP_POST_TAIL,
    KV_FLIP_ORPHAN,
    REQ_TO_TOKEN_REMAP,
    BLOCK_TABLE_REMAP,
    TOKEN_SWAP,
    POSITION_SHIFT,
    CANARY_CORRUPT,
)
