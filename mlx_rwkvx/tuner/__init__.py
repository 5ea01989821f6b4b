"""Training: ``trainer.train`` (the loop, a library on built objects; its duties in
``callbacks``), ``from_config.train_from_config`` (a run as its settings say), the model and
what it trains, a run's data, checkpoints, data parallelism, ``--parallel``, preference runs,
merging, pre-tokenizing."""
