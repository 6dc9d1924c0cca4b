"""The byte contract (SPEC sections 1 and 2): what every backend must produce, byte for byte.

- :mod:`~canary_jax.contract.constants`: field sizes, the chain anchor, enums (launch tags, fail reasons,
  real-KV hash modes);
- :mod:`~canary_jax.contract.pairs` and :mod:`~canary_jax.contract.ints`: int64 as uint32 pairs, so nothing
  needs ``jax_enable_x64``;
- :mod:`~canary_jax.contract.hashing`: splitmix64, the chain hash, the real-KV word fold;
- :mod:`~canary_jax.contract.layout`: the canary buffer (32 bytes per slot) and the violation ring;
- :mod:`~canary_jax.contract.sources`, :mod:`~canary_jax.contract.source_hash` and
  :mod:`~canary_jax.contract.coverage`: real-KV source descriptors, their hash in pure jnp, and which slots a
  source covers;
- :mod:`~canary_jax.contract.validation`: the argument checks every entry point shares, in one namespace (parts:
  :mod:`~canary_jax.contract.arrays`, :mod:`~canary_jax.contract.source_checks`,
  :mod:`~canary_jax.contract.plan_checks`);
- :mod:`~canary_jax.contract.decode`: violation-ring rows as records and as SGLang's report text.

Nothing here imports the rest of the package.
"""
