"""A worker's parts beside its engine: the generation worker's rooms (the weights it serves and the
requests running on them, the endpoint host, its stats, requests and start-up diagnostics), the
logprob worker's token-budgeted queue, the loopback OpenAI-compatible endpoint. What moves
weights into the engines (receivers, reload buckets, our vLLM transfer backend) is weights/'s.
"""
