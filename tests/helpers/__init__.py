"""Test helpers (not collected by pytest): independent Python-int oracles and shared scenarios."""
