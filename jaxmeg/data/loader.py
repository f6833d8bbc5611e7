"""Deterministic, shuffled, resumable batches of fixed-length windows of a token file.

Sample i is the window tokens[i s : i s + s + 1] (inputs = the first s, targets = the last s).
With a held-out fraction f, the last floor(f n) of the n samples never enter training: they are
the held-out split (`HeldOutBatches`, read in order). Epoch e visits the training samples in the
order of a permutation drawn from `default_rng([seed, e])`; step k's global batch is the next
`global_batch` sample ids of that endless stream. Each data-parallel shard takes a contiguous
block of the global batch's rows, and a process reads only the rows it needs (`rows`). The
state is the step number, so resuming is exact.
"""

from __future__ import annotations

import numpy as np

from jaxmeg.data.token_file import TokenFile


def _windows(tokens: np.ndarray, sample_ids: np.ndarray, seq_len: int) -> np.ndarray:
    """int32 [len(sample_ids), seq_len + 1]: the token windows of the samples."""
    return np.stack(
        [np.asarray(tokens[i * seq_len : i * seq_len + seq_len + 1]) for i in sample_ids]
    ).astype(np.int32)


class HeldOutBatches:
    """Fixed batches of `count` consecutive samples from sample `first`: batch k is samples
    first + k G .. first + (k + 1) G - 1 (G = global_batch), the same at every evaluation.
    `rows` reads a block of a batch's rows, like `BatchLoader.rows` does of a step's."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, first: int, count: int):
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.first, self.count = first, count
        self.num_batches = count // global_batch

    @classmethod
    def whole(cls, token_file: TokenFile, seq_len: int, global_batch: int) -> HeldOutBatches:
        """Every sample of a token file (data that a run did not train on)."""
        return cls(token_file.tokens, seq_len, global_batch, 0, _num_samples(token_file, seq_len))

    def rows(self, batch: int, row_start: int, row_stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int32 [row_stop - row_start, seq_len], of batch `batch`."""
        if not 0 <= batch < self.num_batches:
            raise IndexError(f"held-out batch {batch} of {self.num_batches}")
        start = self.first + batch * self.global_batch
        windows = _windows(
            self.tokens, np.arange(start + row_start, start + row_stop), self.seq_len
        )
        return windows[:, :-1], windows[:, 1:]


def _num_samples(token_file: TokenFile, seq_len: int) -> int:
    return max(token_file.num_tokens - 1, 0) // seq_len


def held_out_samples(num_samples: int, eval_fraction: float) -> int:
    """How many of `num_samples` samples `data.eval_fraction` holds out: floor(f n)."""
    return int(num_samples * eval_fraction + 1e-9)


def shard_rows(global_batch: int, num_shards: int, shard_index: int) -> tuple[int, int]:
    """Rows [start, stop) of the global batch that data-parallel shard `shard_index` owns."""
    if global_batch % num_shards:
        raise ValueError(f"global batch {global_batch} is not divisible by {num_shards} shards")
    per_shard = global_batch // num_shards
    return shard_index * per_shard, (shard_index + 1) * per_shard


class BatchLoader:
    def __init__(
        self,
        token_file: TokenFile,
        seq_len: int,
        global_batch: int,
        seed: int,
        eval_fraction: float = 0.0,
    ):
        """`eval_fraction` (data.eval_fraction): the share of samples, the last ones, held out
        of training (`held_out`)."""
        self.tokens = token_file.tokens
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.num_samples = _num_samples(token_file, seq_len)
        self.eval_samples = held_out_samples(self.num_samples, eval_fraction)
        self.train_samples = self.num_samples - self.eval_samples
        if token_file.num_tokens == 0:
            raise ValueError(f"the dataset {token_file.prefix!r} holds no tokens")
        if self.train_samples < global_batch:
            held = (
                f", of which data.eval_fraction = {eval_fraction} holds out {self.eval_samples}"
                f" (leaving {self.train_samples} for training)"
                if self.eval_samples
                else ""
            )
            raise ValueError(
                f"the dataset {token_file.prefix!r} has {token_file.num_tokens} tokens = "
                f"{self.num_samples} samples of {seq_len} + 1 tokens{held}, fewer than "
                f"train.global_batch ({global_batch})"
            )
        self.step = 0
        self._epoch_cache: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_cache:
            self._epoch_cache = {
                epoch: np.random.default_rng([self.seed, epoch]).permutation(self.train_samples)
            }
        return self._epoch_cache[epoch]

    def global_sample_ids(self, step: int) -> np.ndarray:
        positions = step * self.global_batch + np.arange(self.global_batch)
        epochs, offsets = np.divmod(positions, self.train_samples)
        return np.array(
            [self._permutation(int(e))[o] for e, o in zip(epochs, offsets, strict=True)]
        )

    def rows(self, step: int, row_start: int, row_stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int32 [row_stop - row_start, seq_len], of step `step`."""
        ids = self.global_sample_ids(step)[row_start:row_stop]
        windows = _windows(self.tokens, ids, self.seq_len)
        return windows[:, :-1], windows[:, 1:]

    def held_out(self) -> HeldOutBatches:
        """The held-out split: the last `eval_samples` samples, in batches of global_batch."""
        return HeldOutBatches(
            self.tokens, self.seq_len, self.global_batch, self.train_samples, self.eval_samples
        )

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
            "eval_samples": self.eval_samples,
        }

    def restore(self, state: dict) -> None:
        for key in ("seed", "seq_len", "global_batch", "num_samples"):
            if state.get(key) != getattr(self, key):
                now = getattr(self, key)
                was = state.get(key)
                raise ValueError(f"loader state does not match: {key} was {was}, now {now}")
        # Another held-out split reorders the training samples, except before any was drawn
        # (e.g. a checkpoint that scripts/convert_hf.py imported).
        held = int(state.get("eval_samples", 0))
        if held != self.eval_samples and int(state["step"]) > 0:
            raise ValueError(
                f"loader state does not match: the run held out {held} samples, "
                f"data.eval_fraction holds out {self.eval_samples} here; resume with the run's "
                f"data.eval_fraction"
            )
        self.step = int(state["step"])
