"""Replay recorded runs through a model, reusing the KV cache."""
