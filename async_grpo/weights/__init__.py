"""What moves the trainer's weights into the inference workers: both ends of every transport.

Each transport has a publisher in the trainer ranks and a receiver beside each generation engine
(transport.py: `WeightPublisher`, `WeightReceiver`, and which class is which end); the logprob
workers load with the same object-store loader (worker_loader.py). The folder holds both sides,
kept apart by module name (WORKER_SIDE and TRAINER_SIDE in async_grpo/__init__.py, enforced by
tests/project/test_layout.py): `trainer_*` modules run in the trainer ranks and never reach a
`worker_*` module; `worker_*` modules run in the workers (and vLLM's engine core) and never reach
a `trainer_*` one; the other modules are the records both ends share (update.py, adapter_files.py,
hf_checkpoint.py, transport.py) and reach neither.
"""
