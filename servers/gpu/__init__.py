"""Scripts for running blackbox on a lent GPU machine (see docs/gpu.md)."""
