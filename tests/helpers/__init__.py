"""Helpers that several test modules share, one module per subject (shared fixtures: tests/conftest.py)."""
