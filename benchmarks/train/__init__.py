"""Training: a step of ours against the references, its loss, attention and activation checkpointing."""
