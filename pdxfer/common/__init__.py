"""Helpers every part may use and that know no protocol: sockets, listen ports, child processes,
secret files, a cache emptied when full, the command lines' shared flags, metric definitions and
the metrics reference renderer.
"""
