"""Serving a fleet: the PD proxy (one OpenAI-compatible endpoint in front of prefill and decode
instances) and its router, which picks instances from what the master's index says they hold.
Imports no vLLM (the proxy runs where vLLM is not installed).
"""
