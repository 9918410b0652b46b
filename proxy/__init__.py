"""Sluice: a sidecar proxy that puts backpressure on AI agents' LLM and tool calls.

The server lives here (CLI, config, routing, forwarding, admin); each backpressure policy
lives in the sibling package ``policies``.
"""

__version__ = "0.1.0"
