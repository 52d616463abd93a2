"""Everything that moves the trainer's weights into the inference workers, both ends of every
transport in one folder.

The folder holds both sides, kept apart by module name (async_grpo.LAYERS' WORKER_SIDE and
TRAINER_SIDE, enforced by tests/project/test_layout.py): `trainer_*` modules run in the trainer
ranks and never import a `worker_*` module, `worker_*` modules run in the generation and logprob
workers (and vLLM's engine core) and never import a `trainer_*` one, and the other modules (the
records both ends exchange) import neither.
"""
