"""The experience batcher's parts: fetching a prompt's rollouts and logprobs, turning finished groups
into samples with advantages, packing minibatches, messages to ranks, step counters.
"""
