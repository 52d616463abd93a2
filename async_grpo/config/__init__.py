"""Typed config loading (YAML/TOML + flags), the worker option sections shared by workers, dispatcher
and launcher, and the pinned versions every entry point checks. Pure: no Ray, vLLM or
torch.distributed.
"""
