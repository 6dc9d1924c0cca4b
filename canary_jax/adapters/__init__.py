"""Adapters from real JAX serving stacks' batch formats and KV layouts to the canary's plan inputs and sources."""
