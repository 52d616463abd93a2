"""Weight updates as records and tensors, shared by the trainer that publishes them and the workers
that load them: what a push carries, gathered or per-rank shards, HF export (weight_sync.py); the
pieces assembled again and loaded into a worker's model (weight_loading.py).
"""
