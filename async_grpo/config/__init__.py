"""Typed config loading (YAML/TOML + flags), the worker option sections shared by workers, dispatcher
and launcher, the model-folder check every loader makes first, and the pinned versions every entry
point checks. Pure: no Ray, vLLM or torch.distributed; the launchers import it without torch.
"""
