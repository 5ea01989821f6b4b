"""Evaluation: the loss of a model on a data set (mean loss, perplexity, bits per byte;
``perplexity.py``, on the one definition the trainer's validation uses too,
``data.loss.dataset_loss``). Entry point of the command: ``mlx_rwkvx.evaluate``."""

from mlx_rwkvx.evaluation.perplexity import (
    PLAIN_TEXT,
    Row,
    default_seq_len,
    eval_examples,
    evaluate_loss,
)

__all__ = ["PLAIN_TEXT", "Row", "default_seq_len", "eval_examples", "evaluate_loss"]
