"""pdxfer: move vLLM KV cache between prefill and decode instances."""

__version__ = "0.1.0"
