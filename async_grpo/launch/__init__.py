"""Ray names, namespaces and runtime env of every actor; joining a running cluster (token auth,
loopback mode, one-line errors).
"""
