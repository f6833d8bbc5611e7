"""Self-adapting pipeline partition (Holmes, Yang et al., 2024): layers per stage that minimise
the slowest stage's time, when stages differ in speed (GPU, network of their node group).

Pure Python. A stage's time is `fixed_s + n_s * per_layer_s` for n_s layers; where the costs
come from (the performance model, `jaxmeg.perf.cluster_model.stage_costs`, or a probe on the
devices) is the caller's business.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class StageCost:
    per_layer_s: float
    """Seconds one more layer adds to the stage's step (all its microbatches, and its share of
    the data-parallel reduction)."""
    fixed_s: float = 0.0
    """Seconds the stage spends whatever its layers (embedding, LM head and loss)."""

    def seconds(self, layers: int) -> float:
        return self.fixed_s + layers * self.per_layer_s


def _check(costs: Sequence[StageCost], layers: int, min_layers: int) -> None:
    if not costs:
        raise ValueError("partition: no stages to split the layers over")
    if min_layers < 1:
        raise ValueError(f"partition: min_layers must be >= 1, got {min_layers}")
    for s, cost in enumerate(costs):
        if not (cost.per_layer_s >= 0 and cost.fixed_s >= 0):
            raise ValueError(
                f"partition: stage {s} has a negative or undefined cost: per_layer_s "
                f"{cost.per_layer_s}, fixed_s {cost.fixed_s}"
            )
    if layers < min_layers * len(costs):
        raise ValueError(
            f"partition: {layers} layers cannot give each of {len(costs)} stages at least "
            f"{min_layers} (needs >= {min_layers * len(costs)} layers)"
        )


def balance(costs: Sequence[StageCost], layers: int, min_layers: int = 1) -> tuple[int, ...]:
    """Layers per stage (sum = `layers`, each >= `min_layers`) with the least slowest-stage
    time max_s (fixed_s + n_s per_layer_s).

    Every stage starts at `min_layers`; each remaining layer goes to the stage whose time after
    taking it is least, the earliest such stage on ties. Exact: stage s's times after its
    k-th extra layer form an increasing sequence, so the greedy takes the R smallest of all
    stages' candidate times (R = the layers left to place), always whole prefixes of each
    stage's sequence; any other split also takes R of these candidates, as prefixes, so its
    largest is at least the R-th smallest, which is the greedy's. Ties go to the earlier
    stage, so with equal stages the first ones get the extra layers. O(layers log stages)."""
    _check(costs, layers, min_layers)
    counts = [min_layers] * len(costs)
    heap = [(c.seconds(min_layers + 1), s) for s, c in enumerate(costs)]
    heapq.heapify(heap)
    for _ in range(layers - min_layers * len(costs)):
        _, s = heapq.heappop(heap)
        counts[s] += 1
        heapq.heappush(heap, (costs[s].seconds(counts[s] + 1), s))
    return tuple(counts)


def slowest(costs: Sequence[StageCost], stage_layers: Sequence[int]) -> float:
    """The slowest stage's time, max_s (fixed_s + n_s per_layer_s)."""
    if len(costs) != len(stage_layers):
        raise ValueError(
            f"partition: {len(stage_layers)} stage layer counts for {len(costs)} stage costs"
        )
    return max(c.seconds(n) for c, n in zip(costs, stage_layers, strict=True))
