"""distmk: a multi-GPU distributed megakernel runtime for low-latency LLM decoding."""
__version__ = "0.1.0"
