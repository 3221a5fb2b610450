"""This rank's stream of training problems: epochs of a seeded shuffle, dealt round-robin to the ranks.

Every rank builds the same training set (from the run's seed, without any
evaluation prompt) and takes its own share of each epoch's order. The
cursor (epoch, position) is the data state a checkpoint saves: a resumed
run continues with the next problem, not from the start of the epoch.
"""

from __future__ import annotations

import random
from typing import Any

from areal_metrics.areal_train.task import Problem


class TrainData:
    def __init__(self, problems: list[Problem], seed: int, rank: int, world_size: int) -> None:
        self.problems = problems
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shard_len = max(len(problems) // world_size, 1)
        self.epoch, self.position = 0, 0
        self._order = self._shard(0)

    def _shard(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order[self.rank::self.world_size][: self.shard_len]

    def next_batch(self, n: int) -> list[Problem]:
        batch: list[Problem] = []
        while len(batch) < n:
            take = self._order[self.position:self.position + n - len(batch)]
            batch += [self.problems[i] for i in take]
            self.position += len(take)
            if self.position == len(self._order):  # an epoch is complete
                self.epoch += 1
                self.position, self._order = 0, self._shard(self.epoch)
        return batch

    @property
    def epochs(self) -> float:
        """Completed epochs, fractional (as the step event reports it)."""
        return self.epoch + self.position / self.shard_len

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._shard(self.epoch)
