"""Parallelism applied from outside the model, one module per dimension."""
