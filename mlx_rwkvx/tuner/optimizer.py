"""The optimizer of a run: AdamW (``mlx.optimizers``) with a linear warm-up, then cosine decay
to the mode's final rate, and RWKV's weight-decay groups for full fine-tuning and pretraining.
Entry points: ``make_optimizer(total_steps, lr=...)``, ``optimizer_for(cfg, total_steps)`` (a
run's, from its settings)."""

from __future__ import annotations

import re

from mlx_rwkvx.tuner.config import FINAL_LR_RATIO, TrainConfig

import mlx.optimizers as optim

ADAM_BETAS, ADAM_EPS = (0.9, 0.99), 1e-8  # RWKV's trainers (RWKV-LM, RWKV-PEFT)
# RWKV-7's low-rank projections (LowRank's down and up: BlinkDL's w1/w2, a1/a2, v1/v2, g1/g2)
_LOW_RANK = re.compile(r"\.tmix\.(decay|iclr|value_mix|gate)\.(down|up)\.weight$")


def _no_decay(path: str, param) -> bool:
    # RWKV's trainers (RWKV-LM x070) decay only the matrices named ".weight": the projections,
    # the embedding and the head. Norms, biases, token-shift mixes, decays (w0 is the decay's
    # up.bias), the other per-channel vectors and the low-rank w1/w2-style matrices (their own
    # parameters there, no ".weight") are not decayed
    return param.ndim < 2 or not path.endswith(".weight") or bool(_LOW_RANK.search(path))


def make_optimizer(
    total_steps: int,
    *,
    lr: float,
    warmup: int = 0,
    weight_decay: float = 0.0,
    final_lr: float = 0.0,
    rwkv_groups: bool = False,
):
    """AdamW with ``warmup`` steps of linear warm-up, then cosine decay
    from ``lr`` to ``final_lr`` at ``total_steps``; ``rwkv_groups`` (full fine-tuning and
    pretraining): no weight decay on norms, biases and other vectors and low-rank matrices
    (RWKV's grouping: see _no_decay)."""
    warmup = min(warmup, max(total_steps - 1, 0))
    decay = optim.cosine_decay(lr, max(total_steps - warmup, 1), final_lr)
    # the warm-up's first step already moves (lr / (warmup + 1)); step `warmup` reaches lr
    warm = optim.linear_schedule(lr / (warmup + 1), lr, warmup) if warmup else None
    schedule = optim.join_schedules([warm, decay], [warmup]) if warmup else decay
    adamw = dict(learning_rate=schedule, betas=list(ADAM_BETAS), eps=ADAM_EPS)
    if rwkv_groups:
        no_decay = optim.AdamW(weight_decay=0.0, **adamw)
        decay = optim.AdamW(weight_decay=weight_decay, **adamw)
        return optim.MultiOptimizer([no_decay, decay], [_no_decay])
    return optim.AdamW(weight_decay=weight_decay, **adamw)


def optimizer_for(cfg: TrainConfig, total_steps: int):
    """``make_optimizer`` as a run's (resolved) settings ask: the mode's final rate, RWKV's
    weight-decay groups for full fine-tuning and pretraining."""
    return make_optimizer(
        total_steps,
        lr=cfg.lr,
        warmup=cfg.warmup,
        weight_decay=cfg.weight_decay,
        final_lr=cfg.lr * FINAL_LR_RATIO[cfg.mode],
        rwkv_groups=cfg.mode in ("full", "pretrain"),
    )
