"""The operations (SPEC section 4): ``verify`` and ``write`` with their checks, padding and backends.

- :mod:`~canary_jax.ops.launch`: the public ``verify`` / ``write`` entry points (checks, bucket padding,
  backend dispatch), with their real-KV coverage check in :mod:`~canary_jax.ops.launch_coverage`;
- :mod:`~canary_jax.ops.phase_launch`: ``verify_then_write``, a HEAD / TAIL phase as the backend's one launch
  where it has one;
- :mod:`~canary_jax.ops.reference`: the pure-jnp references that pin the bytes;
- :mod:`~canary_jax.ops.backends`: the backend registry (kernels known by ``"module:function"`` names, so this
  package never imports ``pallas_kernels``);
- :mod:`~canary_jax.ops.padding` and :mod:`~canary_jax.ops.buckets`: launch shapes padded to a few sizes.

Builds on :mod:`canary_jax.contract` and :mod:`canary_jax.planning`.
"""
