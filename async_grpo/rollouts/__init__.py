"""How a generation worker makes and scores rollouts: the sampling config and seeds, per-token weight
versions, the multi-turn loop with environments and tools, verifiers environments.
"""
