"""Cluster integration: SLURM allocations and multi-node rendezvous."""
