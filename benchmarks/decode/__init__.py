"""Decoding: our searches against the references and earlier revisions, exports as deployed, constraints."""
