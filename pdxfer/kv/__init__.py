"""KV geometry: what vLLM's KV tensors look like as registered memory (layouts), the interior
of a block (block geometry), which heads each TP rank holds, content-addressed chunk keys, chunk
-> block arithmetic and the block-id convention of a holder's tiers. Imports nothing of pdxfer
outside this room.
"""
