"""The connector's worker half, in each vLLM worker process: register the KV cache once, post
reads, stage and scatter converted blocks, validate, re-pull from another holder, and the
host-memory tier's pool.
"""
