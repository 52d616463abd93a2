"""The trainer's parts around its loop: process group and FSDP2, optimizer, checkpoints, evaluation,
the prompt sampler and the data path to the batcher. What sends the weights out is weights/'s.
"""
