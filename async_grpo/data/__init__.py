"""Prompt data: record formats, JSONL/Parquet files, the demo's arithmetic prompts, reasoning-gym
tasks.
"""
