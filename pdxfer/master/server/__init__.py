"""The pdxfer-master service: the wire server around the in-memory chunk index, one client
connection's life, /metrics and /health, and what the master reports about itself.
"""
