"""Serving: `python serve.py` under load from clients on 127.0.0.1 (dynamic batching, backends)."""
