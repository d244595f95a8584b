"""Tests of the tiers: the conformance suite on every backend, and tier-specific behaviour."""
