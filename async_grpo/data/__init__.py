"""Prompt data: record formats, JSONL/Parquet files, reasoning-gym tasks (the demo's arithmetic
prompts are demo_assets').
"""
