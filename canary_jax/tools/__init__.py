"""Tools around the canary: fault injection and dumps (they build on :mod:`canary_jax.runtime`).

- :mod:`~canary_jax.tools.faults`: inject the faults the canary exists to catch (into pools, tables, buffers);
- :mod:`~canary_jax.tools.dump`: save and load a canary state with its real KV for offline checks.

Decoding the violation ring is the contract's (:mod:`canary_jax.contract.decode`).
"""
