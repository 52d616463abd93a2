"""The registries' plain parts: the capacity queue (least-loaded worker with room), leases, the
batched call path between callers and workers, and a worker's lifecycle states as workers report
them and registries read them.
"""
