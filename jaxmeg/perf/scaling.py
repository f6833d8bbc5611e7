"""Critical batch size, and the steps and tokens that reach a target loss (Kaplan et al.,
2020, "Scaling laws for neural language models"; losses in nats per token).

Words: L the target loss, N the non-embedding parameters, B the batch in tokens, S the steps,
E = B S the tokens processed; S_min and E_min the steps with an unbounded batch and the tokens
with a tiny one.

  B_crit(L) = B* / L^(1/alpha_B),  B* = 2e8 tokens, alpha_B = 0.21          (eq. 1.4)
  S = S_min (1 + B_crit / B),  E = E_min (1 + B / B_crit)                    (eq. 5.4, 5.5)
  E_min = B_crit S_min  (both equations hold at once only so)                (eq. 5.3)
  L(N, S_min) = (N_c / N)^alpha_N + (S_c / S_min)^alpha_S                    (eq. 1.6)
    N_c = 8.8e13, alpha_N = 0.076, S_c = 2.1e3, alpha_S = 0.76
  so  S_min(L) = S_c / (L - (N_c / N)^alpha_N)^(1 / alpha_S), defined for L above the loss the
  size reaches with unlimited steps, (N_c / N)^alpha_N.

A token budget T is read as the tokens a run at the critical batch processes, T = 2 E_min(L)
(B = B_crit gives S = 2 S_min and E = 2 E_min); E_min falls as L rises, so L follows by
bisection.
"""

from __future__ import annotations

import dataclasses

CRITICAL_BATCH_TOKENS = 2e8
"""B*, tokens."""
CRITICAL_BATCH_EXPONENT = 0.21
"""alpha_B."""
SIZE_SCALE = 8.8e13
"""N_c, non-embedding parameters."""
SIZE_EXPONENT = 0.076
"""alpha_N."""
STEPS_SCALE = 2.1e3
"""S_c, steps."""
STEPS_EXPONENT = 0.76
"""alpha_S."""


def non_embedding_parameters(hidden: int, layers: int, mlp_ratio: int = 4) -> float:
    """Kaplan's N = 2 h l (2 h + f) (section 2.1), f = mlp_ratio h: 12 l h^2 for f = 4 h."""
    return 2 * hidden * layers * (2 * hidden + mlp_ratio * hidden)


def critical_batch_tokens(loss: float) -> float:
    """B_crit(L) = B* / L^(1 / alpha_B)."""
    if loss <= 0:
        raise ValueError(f"target loss must be > 0, got {loss}")
    return CRITICAL_BATCH_TOKENS / loss ** (1 / CRITICAL_BATCH_EXPONENT)


def size_limited_loss(params: float) -> float:
    """(N_c / N)^alpha_N: the loss N parameters reach with unlimited steps."""
    return (SIZE_SCALE / params) ** SIZE_EXPONENT


def min_steps(loss: float, params: float) -> float:
    """S_min(L) = S_c / (L - (N_c / N)^alpha_N)^(1 / alpha_S)."""
    floor = size_limited_loss(params)
    if loss <= floor:
        raise ValueError(
            f"target loss {loss} is not above {floor:.4f}, the loss {params:.3g} non-embedding "
            f"parameters reach with unlimited steps"
        )
    return STEPS_SCALE / (loss - floor) ** (1 / STEPS_EXPONENT)


def steps(min_steps_: float, batch_tokens: float, critical_tokens: float) -> float:
    """S = S_min (1 + B_crit / B)."""
    return min_steps_ * (1 + critical_tokens / batch_tokens)


def tokens(min_tokens: float, batch_tokens: float, critical_tokens: float) -> float:
    """E = E_min (1 + B / B_crit)."""
    return min_tokens * (1 + batch_tokens / critical_tokens)


@dataclasses.dataclass(frozen=True)
class Target:
    loss: float
    """L, nats per token."""
    params: float
    """N, non-embedding parameters."""
    critical_batch_tokens: float
    """B_crit(L)."""
    min_steps: float
    """S_min(L)."""

    @property
    def min_tokens(self) -> float:
        """E_min = B_crit S_min."""
        return self.critical_batch_tokens * self.min_steps

    def steps(self, batch_tokens: float) -> float:
        return steps(self.min_steps, batch_tokens, self.critical_batch_tokens)

    def tokens(self, batch_tokens: float) -> float:
        return tokens(self.min_tokens, batch_tokens, self.critical_batch_tokens)


def target_from_loss(loss: float, params: float) -> Target:
    """B_crit and S_min of a target loss L for N non-embedding parameters."""
    return Target(loss, params, critical_batch_tokens(loss), min_steps(loss, params))


def target_from_tokens(budget: float, params: float) -> Target:
    """The target whose run at the critical batch processes `budget` tokens: 2 E_min(L) = T,
    solved for L by bisection (E_min falls monotonically in L)."""
    if budget <= 0:
        raise ValueError(f"token budget must be > 0, got {budget}")
    low = size_limited_loss(params)
    high = low + 1.0
    while 2 * target_from_loss(high, params).min_tokens > budget:
        high = low + 2 * (high - low)
    for _ in range(200):
        mid = (low + high) / 2
        if 2 * target_from_loss(mid, params).min_tokens > budget:
            low = mid
        else:
            high = mid
    return target_from_loss(high, params)
