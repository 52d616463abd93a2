"""Weight updates as records and tensors, shared by the trainer that publishes them and the workers
that load them: what a push carries, gathered or per-rank shards, HF export.
"""
