"""A worker's parts beside its engine: the engine side of a weight push (our backend of vLLM's
weight-transfer API, reload buckets in anonymous memory files, adapter folders), the LoRA adapters
it serves, the logprob worker's token-budgeted queue, the loopback OpenAI-compatible endpoint.
"""
