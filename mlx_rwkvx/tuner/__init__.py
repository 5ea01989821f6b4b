"""Training: ``trainer.train`` (the run), the model and what it trains, data and batches,
checkpoints, data parallelism, ``--parallel``, adapters, merging, pre-tokenizing."""
