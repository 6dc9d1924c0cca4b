"""Plans and slot tables (SPEC section 3): what a launch checks and stamps.

- :mod:`~canary_jax.planning.plans`: ``VerifyPlan``, ``WritePlan``, ``VerifyOrWriteContext``;
- :mod:`~canary_jax.planning.plan_builder`: plans from a batch (``req_to_token``, ``prefix_lens``,
  ``extend_lens``), pure jnp;
- :mod:`~canary_jax.planning.slot_tables`, :mod:`~canary_jax.planning.slot_reads`,
  :mod:`~canary_jax.planning.expected_tokens`: dense, block (vLLM) and ragged slot tables, the slots a forward
  reads, the token ids it expects.

Builds on :mod:`canary_jax.contract` only.
"""
