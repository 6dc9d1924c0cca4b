"""Faults in a batch's metadata: a slot table entry (:func:`remap_req_to_token`, :func:`remap_block_table`) and
the token stream fed to the model (:func:`swap_token`, :func:`swap_tokens`, :func:`shift_position`), as pure
functions (numpy or JAX, jit-able; nothing changed in place).

They model SGLang's ``req_to_token`` and ``next_token_swap`` perturbations; the verify position and chain checks
and the write input asserts catch them. Re-exported by :mod:`canary_jax.tools.faults`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from canary_jax.tools.faults.array_checks import _check_array, _check_index, _is_jax, _set

__all__ = ["remap_block_table", "remap_req_to_token", "shift_position", "swap_token", "swap_tokens"]


def remap_req_to_token(req_to_token: Any, *, row: Any, position: Any, slot: Any) -> Any:
    """``req_to_token[row, position] = slot``: a request's position now points at another slot (SGLang's
    ``req_to_token`` perturbation: another active request's slot).

    Args:
      req_to_token: ``int32[max_reqs, max_seq_len]`` (numpy or JAX).
      row: the request's ``req_pool_index``; position: the position; slot: the new slot.

    Returns:
      A new table.

    Raises:
      TypeError / ValueError: not a 2-D integer array, or a concrete row / position out of range.
    """
    _check_array(req_to_token, "req_to_token", 2)
    _check_index(row, "row", int(req_to_token.shape[0]))
    _check_index(position, "position", int(req_to_token.shape[1]))
    return _set(req_to_token, (row, position), slot)


def remap_block_table(block_table: Any, *, row: Any, block: Any, page: Any) -> Any:
    """``block_table[row, block] = page``: every slot of a request's block now reads another page (the paged
    form of :func:`remap_req_to_token`).

    Args:
      block_table: ``int32[max_reqs, max_blocks]`` page indices (numpy or JAX).
      row, block: the entry; page: the new page.

    Returns:
      A new table.

    Raises:
      TypeError / ValueError: as :func:`remap_req_to_token`.
    """
    _check_array(block_table, "block_table", 2)
    _check_index(row, "row", int(block_table.shape[0]))
    _check_index(block, "block", int(block_table.shape[1]))
    return _set(block_table, (row, block), page)


def swap_token(input_ids: Any, *, index: Any, token: Any) -> Any:
    """``input_ids[index] = token``: the model is fed a token the request never had.

    Raises:
      TypeError / ValueError: not a 1-D integer array, or a concrete index out of range.
    """
    _check_array(input_ids, "input_ids", 1)
    _check_index(index, "index", int(input_ids.shape[0]))
    return _set(input_ids, (index,), token)


def swap_tokens(input_ids: Any, i: Any, j: Any) -> Any:
    """Exchanges ``input_ids[i]`` and ``input_ids[j]`` (SGLang's ``next_token_swap``: two requests' sampled
    tokens trade places).

    Raises:
      TypeError / ValueError: as :func:`swap_token`.
    """
    _check_array(input_ids, "input_ids", 1)
    _check_index(i, "i", int(input_ids.shape[0]))
    _check_index(j, "j", int(input_ids.shape[0]))
    if _is_jax(input_ids):
        a, b = input_ids[i], input_ids[j]
        return input_ids.at[i].set(b).at[j].set(a)
    out = np.array(input_ids, copy=True)
    out[[int(i), int(j)]] = out[[int(j), int(i)]]
    return out


def shift_position(positions: Any, *, index: Any, delta: Any = 1) -> Any:
    """``positions[index] += delta``: a token fed at the wrong position (EAGLE's draft-position bug class).

    Raises:
      TypeError / ValueError: as :func:`swap_token`.
    """
    _check_array(positions, "positions", 1)
    _check_index(index, "index", int(positions.shape[0]))
    return _set(positions, (index,), positions[index] + delta)
