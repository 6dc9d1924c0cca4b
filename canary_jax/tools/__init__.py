"""Tools around the canary: fault injection (it builds on :mod:`canary_jax.runtime`).

- :mod:`~canary_jax.tools.faults`: inject the faults the canary exists to catch (into pools, tables, buffers).

Dumps (save and load a canary state with its real KV for offline checks) are the runtime's
(:mod:`canary_jax.runtime.dump`, which ``CanaryGuard.dump`` calls; ``canary_jax.tools.dump`` is its deprecated
alias); decoding the violation ring is the contract's (:mod:`canary_jax.contract.decode`).
"""
