"""Serving: continuous batching over the engine (the OpenAI-compatible HTTP server builds on it)."""
