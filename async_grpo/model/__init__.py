"""Model-side helpers shared by trainer and workers: packed (padding-free) attention and shared-prompt
batches.
"""
