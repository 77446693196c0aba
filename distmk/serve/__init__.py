"""The OpenAI-compatible server: python -m distmk.serve (see __main__.py)."""
