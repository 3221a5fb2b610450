"""Evaluation sets, their fingerprints and how a round is shared out over the ranks. Pure.

An `EvalSet` is a dataset's problems plus the sampling protocol: `k`
samples per prompt at `temperature`, each sample with its own noise seed
(`sample_seed`), so a sample's answer depends only on the weights, never on
which rank writes it or what else is in the batch. Sample i*k + j is the
j-th sample of prompt i; verdict lists follow that order.

Sharding (`layout`): the prompts are cut into `world_size` contiguous blocks;
rank r evaluates blocks r, r+1, ..., r+redundancy-1 (mod world_size), so every
sample is evaluated by `redundancy` ranks and each rank does about
redundancy / world_size of the set. A rank's verdicts are one cyclic window
of the sample order: it starts at `offset` and wraps around `total`. When
redundancy >= world_size every rank evaluates everything from offset 0 (the
unsharded vote). Each rank publishes its verdicts' `sample_ids` (`covered`)
and `shard_nodes`, the contract's description of a sharded round.

`redundancy` defaults to 3 with 3 or more ranks (a strict majority on every
sample), else every rank. At redundancy 2 with a third rank, a sample the two
replicas dispute is adjudicated (`adjudicator`): rank r also evaluates the
disputed samples of block r + 2, the block next to its own two.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_metrics.areal_train.task import Problem, fingerprint


@dataclass(frozen=True)
class EvalSet:
    name: str
    problems: tuple[Problem, ...]
    k: int = 4  # samples per prompt
    temperature: float = 1.0
    attempt_len: int = 28
    seed: int = 0  # the noise of sample i is derived from (seed, i)
    # attempts per sample (the run's max_turns): the verdict is the first attempt's, so it and the
    # fingerprint are the same for every strategy; later attempts give `solved_within_<T>_turns`
    turns: int = 1

    @property
    def n_samples(self) -> int:
        return len(self.problems) * self.k

    def protocol(self) -> dict[str, object]:
        return {"dataset": self.name, "k": self.k, "temperature": self.temperature, "attempt_len": self.attempt_len,
                "seed": self.seed}

    def fingerprint(self) -> str:
        return fingerprint(self.problems, self.protocol())

    def head(self, n: int) -> EvalSet:
        """The first `n` prompts (the quick stage), with the same protocol and noise."""
        return EvalSet(self.name, self.problems[:n], self.k, self.temperature, self.attempt_len, self.seed, self.turns)

    def sample_seed(self, sample: int, turn: int = 0) -> int:
        """The noise seed of a sample's attempt `turn` (0: the first, the same whatever `turns` is)."""
        return (self.seed * 1_000_003 + sample * 7919 + 17 + turn * 104_729) % (2**63 - 1)


@dataclass(frozen=True)
class Block:
    first: int  # prompt index
    stop: int

    @property
    def prompts(self) -> range:
        return range(self.first, self.stop)


@dataclass(frozen=True)
class Shard:
    blocks: tuple[Block, ...]  # in evaluation (and verdict) order
    offset: int  # first sample of the window
    total: int  # samples in the whole set
    redundancy: int  # ranks per sample

    @property
    def n_prompts(self) -> int:
        return sum(len(b.prompts) for b in self.blocks)


def blocks(n_prompts: int, world_size: int) -> list[Block]:
    cuts = [i * n_prompts // world_size for i in range(world_size + 1)]
    return [Block(a, b) for a, b in zip(cuts, cuts[1:])]


def layout(n_prompts: int, k: int, world_size: int, redundancy: int, rank: int) -> Shard:
    """What `rank` evaluates of a set of `n_prompts` prompts with `k` samples each."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    if redundancy < 1:
        raise ValueError(f"redundancy must be >= 1 (got {redundancy})")
    parts = blocks(n_prompts, world_size)
    if redundancy >= world_size:
        return Shard(tuple(parts), 0, n_prompts * k, world_size)
    mine = tuple(parts[(rank + i) % world_size] for i in range(redundancy))
    return Shard(mine, mine[0].first * k, n_prompts * k, redundancy)


def default_redundancy(world_size: int, configured: int | None = None) -> int:
    """Ranks per sample: the configured value, else 3 with 3 or more ranks, else every rank."""
    if configured is not None:
        return configured
    return 3 if world_size >= 3 else max(world_size, 1)


def adjudicates(world_size: int, redundancy: int) -> bool:
    """Whether a round's disputed samples get a third replica: 2 replicas and a rank holding neither."""
    return redundancy == 2 and world_size >= 3


def adjudicator(rank: int, world_size: int) -> tuple[int, tuple[int, int]]:
    """(the block `rank` adjudicates, the two ranks holding it) at redundancy 2: rank r holds blocks
    r and r + 1, so block r + 2 is held by ranks r + 1 and r + 2, neither of them r (3+ ranks)."""
    block = (rank + 2) % world_size
    return block, ((rank + 1) % world_size, block)


def covered(shard: Shard, k: int) -> list[int]:
    """The sample indices of a shard, in verdict order."""
    return [i * k + j for b in shard.blocks for i in b.prompts for j in range(k)]
