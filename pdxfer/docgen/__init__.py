"""Reference pages rendered from the code (the metrics reference, the architecture's parts list),
with tests that fail when a page and the code drift apart.
"""
