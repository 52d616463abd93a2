"""Model-side helpers shared by trainer and workers: packed (padding-free) attention and the offline
tiny/preset checkpoints.
"""
