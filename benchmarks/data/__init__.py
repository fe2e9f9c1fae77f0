"""Data preparation at scale through train.py, and the padding of token-budget batches."""
