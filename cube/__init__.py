"""Cube: the sharded key-value service holding the sparse embeddings for serving."""
