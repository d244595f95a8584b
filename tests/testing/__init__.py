"""Tests of the shipped test helpers (tiercheck.testing)."""
