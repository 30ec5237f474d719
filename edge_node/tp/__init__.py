"""Uneven Megatron-style tensor parallelism applied from outside to Hugging Face models."""
