"""Decoding: the searches (greedy, sampling, beam), the one step they all take, ensembles, static caches.

- `decoding`: `DecodingSettings`, `decode()` / `search()`
- `rows`: one hypothesis per row: greedy search and sampling
- `step`: the one step every search takes (cached decoder, log-softmax, step rules), the sampler
- `beam`: beam search with its bookkeeping on the device
- `constraints`: forced prefixes, required phrases (Dynamic Beam Allocation), avoided phrases
- `ensemble`: several models decoded as one
- `static_cache`: the preallocated, fixed-shape form of the KV cache (`transformer.kv_cache`)
- `buckets`, `compiled`: the compiled step's padded shape buckets, and the step compiled (logged fallback)
"""
