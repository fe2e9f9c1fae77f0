"""The HTTP server on top of the inference API (`python serve.py`, docs/serving.md): its settings, the
per-model queues and workers of dynamic batching, metrics, and the FastAPI app (`create_app`). Imports
`transformer.inference` and the searches' settings, never Lightning, Hydra or the datamodules."""
