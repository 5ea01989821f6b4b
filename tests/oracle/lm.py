"""Float64 oracle of the language-model ends: embedding, head, cross-entropy, head + loss.

Layouts: tokens and targets ``[B, T]`` integers, hidden states ``[B, T, C]``, embedding
``[V, C]``, head weight ``W_head [V, C]`` (``logits = h @ W_head.T``), logits ``[B, T, V]``.
"""

from __future__ import annotations

import numpy as np


def embedding_fwd_np(emb: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Row lookup: ``emb [V, C]``, ``tokens [B, T]`` -> ``[B, T, C]``."""
    return emb[tokens]


def embedding_bwd_np(d_out: np.ndarray, tokens: np.ndarray, vocab: int) -> np.ndarray:
    """Scatter-add of ``d_out [B, T, C]`` into ``[V, C]``: repeated tokens accumulate."""
    d_emb = np.zeros((vocab, d_out.shape[-1]), dtype=d_out.dtype)
    np.add.at(d_emb, tokens.reshape(-1), d_out.reshape(-1, d_out.shape[-1]))
    return d_emb


def head_fwd_np(h: np.ndarray, W_head: np.ndarray) -> np.ndarray:
    """``logits [B, T, V] = h [B, T, C] @ W_head.T`` (``W_head [V, C]``, no bias)."""
    return h @ W_head.T


def head_bwd_np(h: np.ndarray, W_head: np.ndarray, d_logits: np.ndarray):
    """Backward of ``head_fwd_np``: ``(dh [B, T, C], dW_head [V, C])``."""
    return d_logits @ W_head, np.einsum("btv,btc->vc", d_logits, h)


def log_softmax_np(logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis, ``x - logsumexp(x)`` with max subtraction."""
    m = logits.max(axis=-1, keepdims=True)
    return logits - (m + np.log(np.sum(np.exp(logits - m), axis=-1, keepdims=True)))


def cross_entropy_fwd_np(logits: np.ndarray, targets: np.ndarray, ignore_index: int = -100):
    """Mean over counted tokens (``targets != ignore_index``) of ``-log softmax(logits)[target]``.

    logits ``[B, T, V]``, targets ``[B, T]``. If no token counts, the loss is 0.0 and the
    gradient is zero (no division by zero). Returns ``(loss, cache)``, loss a Python float.
    """
    counted = targets != ignore_index  # [B, T]
    n_counted = int(counted.sum())
    logp = log_softmax_np(logits)  # [B, T, V]
    safe_targets = np.where(counted, targets, 0)
    nll = -np.take_along_axis(logp, safe_targets[..., None], axis=-1)[..., 0]  # [B, T]
    loss = float(np.sum(nll[counted]) / n_counted) if n_counted else 0.0
    cache = dict(logp=logp, targets=safe_targets, counted=counted, n_counted=n_counted)
    return loss, cache


def cross_entropy_bwd_np(cache, d_loss: float = 1.0) -> np.ndarray:
    """``d_logits = d_loss * (softmax - onehot) / n_counted`` on counted rows, 0 on ignored ones."""
    logp, counted, n_counted = cache["logp"], cache["counted"], cache["n_counted"]
    if n_counted == 0:
        return np.zeros_like(logp)
    onehot = np.zeros_like(logp)
    np.put_along_axis(onehot, cache["targets"][..., None], 1.0, axis=-1)
    d_logits = np.exp(logp) - onehot
    return d_loss * d_logits * counted[..., None] / n_counted


def head_cross_entropy_fwd_np(h, W_head, targets, ignore_index: int = -100):
    """Head and loss together (what a fused head + cross-entropy kernel is checked against).

    h ``[B, T, C]``, W_head ``[V, C]``, targets ``[B, T]``. Returns ``(loss, cache)``.
    """
    logits = head_fwd_np(h, W_head)
    loss, ce_cache = cross_entropy_fwd_np(logits, targets, ignore_index)
    return loss, dict(h=h, W_head=W_head, ce=ce_cache)


def head_cross_entropy_bwd_np(cache, d_loss: float = 1.0):
    """Backward of ``head_cross_entropy_fwd_np``: ``(dh [B, T, C], dW_head [V, C])``."""
    d_logits = cross_entropy_bwd_np(cache["ce"], d_loss)
    return head_bwd_np(cache["h"], cache["W_head"], d_logits)
