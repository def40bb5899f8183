"""What the master needs beyond its memory, behind one interface (coordinator): leadership
among replicas and a mirror of the index. The in-memory default and etcd (with its TLS/auth,
its key layout, and a throwaway etcd for tests and local HA).
"""
