"""dplaunch's benchmarks against its peers (accelerate launch, torchrun, HF Trainer, a hand loop).

Not tests: nothing here asserts a time. `make bench` runs them all; see benchmarks/run.py.
"""
