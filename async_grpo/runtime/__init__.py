"""What every process of a run uses to run inside the cluster, whichever side it is on: reaching
Ray (joining a cluster, loopback mode, token auth), its own environment and exit, the host's GPUs
and compilers. The trainer, the workers and the launcher import it; it imports no other folder.
"""
