"""The connector's scheduler half, in vLLM's engine-core process: the reader path (look up and
lock a prompt's chunks, load or recompute), the holder path (publish finished requests' chunks,
keep them alive, give them back under pressure), the host tier's slots and offload jobs.
"""
