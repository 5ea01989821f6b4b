"""Training: adapters (LoRA, DoRA, state tuning), data, the trainer."""
