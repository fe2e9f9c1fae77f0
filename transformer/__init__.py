"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), from scratch on PyTorch."""
