"""Re-exporting modules kept at old import paths (``canary_jax.integration``, ``canary_jax.step_inputs``)."""
