"""The demo's assets, not a subsystem: the offline tiny and Qwen2.5-shaped checkpoints (tiny_model),
the arithmetic prompt files (arithmetic_data) and the example verifiers taskset (verifiers_arith).
"""
