"""Deterministic, shuffled, resumable batches of fixed-length windows of a token file.

Sample i is the window tokens[i s : i s + s + 1] (inputs = the first s, targets = the last s).
Epoch e visits the samples in the order of a permutation drawn from `default_rng([seed, e])`;
step k's global batch is the next `global_batch` sample ids of that endless stream. Each
data-parallel shard takes a contiguous block of the global batch's rows, and a process reads
only the rows it needs (`rows`). The state is the step number, so resuming is exact.
"""

from __future__ import annotations

import numpy as np

from jaxmeg.data.token_file import TokenFile


def shard_rows(global_batch: int, num_shards: int, shard_index: int) -> tuple[int, int]:
    """Rows [start, stop) of the global batch that data-parallel shard `shard_index` owns."""
    if global_batch % num_shards:
        raise ValueError(f"global batch {global_batch} is not divisible by {num_shards} shards")
    per_shard = global_batch // num_shards
    return shard_index * per_shard, (shard_index + 1) * per_shard


class BatchLoader:
    def __init__(self, token_file: TokenFile, seq_len: int, global_batch: int, seed: int):
        self.tokens = token_file.tokens
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.num_samples = max(token_file.num_tokens - 1, 0) // seq_len
        if token_file.num_tokens == 0:
            raise ValueError(f"the dataset {token_file.prefix!r} holds no tokens")
        if self.num_samples < global_batch:
            raise ValueError(
                f"the dataset {token_file.prefix!r} has {token_file.num_tokens} tokens = "
                f"{self.num_samples} samples of {seq_len} + 1 tokens, fewer than "
                f"train.global_batch ({global_batch})"
            )
        self.step = 0
        self._epoch_cache: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_cache:
            self._epoch_cache = {
                epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            }
        return self._epoch_cache[epoch]

    def global_sample_ids(self, step: int) -> np.ndarray:
        positions = step * self.global_batch + np.arange(self.global_batch)
        epochs, offsets = np.divmod(positions, self.num_samples)
        return np.array(
            [self._permutation(int(e))[o] for e, o in zip(epochs, offsets, strict=True)]
        )

    def rows(self, step: int, row_start: int, row_stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int32 [row_stop - row_start, seq_len], of step `step`."""
        ids = self.global_sample_ids(step)[row_start:row_stop]
        windows = np.stack(
            [
                np.asarray(self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1])
                for i in ids
            ]
        ).astype(np.int32)
        return windows[:, :-1], windows[:, 1:]

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        batch = self.rows(self.step, 0, self.global_batch)
        self.step += 1
        return batch

    def state(self) -> dict:
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_samples": self.num_samples,
        }

    def restore(self, state: dict) -> None:
        for key in ("seed", "seq_len", "global_batch", "num_samples"):
            if state.get(key) != getattr(self, key):
                now = getattr(self, key)
                was = state.get(key)
                raise ValueError(f"loader state does not match: {key} was {was}, now {now}")
        self.step = int(state["step"])
