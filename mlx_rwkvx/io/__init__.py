"""Checkpoints (every format we read, the native one we write) and tokenizers."""
