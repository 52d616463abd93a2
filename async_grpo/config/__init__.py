"""The ground floor: typed config loading (YAML/TOML + flags) and the records every side reads,
the trainer, the workers and the launcher alike: the shared option sections (worker_options),
SamplingConfig with its seeds, rewards and rollout sources, the actors' names, the model-folder
check every loader makes first, and the pinned versions every entry point checks. Pure: no Ray,
vLLM or torch.distributed; the launchers import it without torch.
"""
