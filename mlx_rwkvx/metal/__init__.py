"""Kernel bodies (``*.h``) and their assembly (``sources``); importing this never imports MLX."""
