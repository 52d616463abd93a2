"""The trainer's parts around its loop: process group and FSDP2, optimizer, checkpoints, evaluation,
the prompt sampler, the data path to the batcher, and the weight pushers.
"""
