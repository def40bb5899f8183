"""The master's wire: length-prefixed binary frames, one request and one reply codec per op, the
records calls carry, and TLS settings of both ends. Shared by the client and the server.
"""
