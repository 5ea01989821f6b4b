"""Float64 oracle of the preference losses, each on the log-probabilities its paper uses.

Layouts: a batch of ``B`` pairs; each answer's per-token log-probabilities of its trained
tokens are a 1-D array of its own length (``list`` of ``B`` arrays per side and per model),
so the answers' lengths differ freely. Losses are returned per pair, ``[B]``.
"""

from __future__ import annotations

import numpy as np


def ipo_loss_np(policy_c, policy_r, ref_c, ref_r, beta: float) -> np.ndarray:
    """IPO's empirical loss (Azar et al. 2023, "A General Theoretical Paradigm to Understand
    Learning from Human Preferences", eq. 17), ``τ`` = ``beta``:
    ``(log(π(y_w) ρ(y_l) / (π(y_l) ρ(y_w))) - 1/(2τ))²``, where ``log π(y)`` is the mean of
    the answer's per-token log-probabilities (as TRL reads the paper, with its authors), for
    the policy ``π`` and the reference ``ρ`` alike."""

    def mean(side):
        return np.array([np.mean(np.asarray(t, dtype=np.float64)) for t in side])

    h = (mean(policy_c) - mean(ref_c)) - (mean(policy_r) - mean(ref_r))
    return (h - 1.0 / (2.0 * beta)) ** 2
