"""The bad-input catalogue run by benchmarks/reliability.py: one module per kind of input."""
