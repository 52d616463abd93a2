"""async-grpo's package: every module except the system's spine, one folder per subsystem.

The spine (trainer_core, worker_dispatcher, vllm_worker, logprob_worker, vllm_registry,
vllm_experience_batcher, grpo_loss, sample_processing_utils, setup_model, local_cluster) lives
at the repository root and imports from here; nothing here imports the spine's services or
launchers. `LAYERS` below orders the folders: a folder imports only folders before it (and
the spine's shared files: grpo_loss, sample_processing_utils, setup_model). tests/project/test_layout.py
enforces these rules; the README's "How the code is laid out" says what each folder holds.
"""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("config",),
    ("demo_assets", "runtime"),
    ("launch", "algo", "routing", "model", "data"),
    ("rewards",),
    ("rollouts",),
    ("batching", "inference", "telemetry"),
    ("weights",),
    ("trainer",),
)
"""The package's folders, lowest first; a folder may import its own layer's folders only
through its own modules (no sideways import between folders of one layer). The ground floor,
config, holds the records every side shares (options, SamplingConfig and seeds, actor names);
runtime, above it, what every process uses to run in the cluster. demo_assets sits low because
data/dataset.py's write-arithmetic command imports it. weights sits above inference and below
trainer: it holds both ends of every weight transport (WORKER_SIDE, TRAINER_SIDE)."""

PURE: tuple[str, ...] = ("config", "demo_assets", "algo", "data", "model")
"""Folders that reach no Ray, vLLM or torch.distributed, at any depth: records, maths, config
loading, the demo's assets, prompt data, model helpers. They run and test in any process."""
WORKER_SIDE: tuple[str, ...] = ("inference", "weights.worker_*")
"""Folders, or modules of a folder that holds both sides ('folder.pattern'), that run inside the
inference workers and their engines: never reach the trainer side."""
GENERATION_SIDE: tuple[str, ...] = ("rollouts", "inference")
"""Folders that make rollouts (the generation workers' loop, environments, engines): the trainer
side never imports them; what both read (SamplingConfig, seeds, names) lives in config/."""
TRAINER_SIDE: tuple[str, ...] = ("trainer", "telemetry", "weights.trainer_*")
"""Likewise what runs in the trainer ranks: never reaches the worker side (the trainer talks to
workers only through the batcher and registries, by name, and sends weights through weights/).
A folder split between the sides keeps its other modules for both: they reach neither side."""
