"""Everything between files on disk and padded tensors: sources, tokenizers, batching, DataModules.

Imports run one way: `datamodules` ties together `sources`, `tokenization`, `prepare`, `cache` and
`batching`, none of which imports it; nothing in `data/` imports `transformer/`.
"""
