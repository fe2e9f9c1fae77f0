"""Everything between files on disk and padded tensors: sources, tokenizers, batching, DataModules."""
