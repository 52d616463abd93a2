"""A worker's parts beside its engine: the generation worker's rooms (the weights it serves, the
object-store reload, LoRA adapter loading, the CUDA transfer pass-through, the endpoint host, its
stats, requests and start-up diagnostics), the engine side of a weight push (our backend of vLLM's
weight-transfer API, reload buckets in anonymous memory files, adapter folders), the logprob
worker's token-budgeted queue, the loopback OpenAI-compatible endpoint.
"""
