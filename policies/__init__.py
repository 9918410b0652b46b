"""Backpressure policies, one module each; every refusal is a ``policies.reasons.Rejected``."""
