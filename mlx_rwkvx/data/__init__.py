"""Data, below both training and evaluation: ``records`` (files, formats and splits, record by
record), ``chat`` (conversations into tokens and their mask), ``examples`` (records into checked
examples), ``batches`` (length-bucketed batches, parts of a data set) and ``loss`` (a model's
loss on a batch, a segment and a whole data set: one definition, which the trainer and
``evaluation/`` share)."""
