"""Which warm start a config needs and where it is cached: no torch here, so that
a launcher can find the cached file without importing the trainer.
`areal_metrics.areal_train.warmstart` builds and loads it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from areal_metrics.areal_train.task import VOCAB

FORMAT_VERSION = 5  # bump when the task, the vocabulary or the code of the recipe (warmstart.py) changes


@dataclass(frozen=True)
class WarmStartSpec:
    """The recipe: every number the warm start depends on, so that its key changes with any of them."""

    d_model: int = 64
    layers: int = 2
    heads: int = 4
    steps: int = 1200
    batch: int = 64
    lr: float = 3e-3
    seed: int = 12345
    scratch_share: float = 1.0  # of the examples written with the scratchpad (the rest: the bare answer)
    retry_share: float = 0.1  # of the examples that are a wrong attempt, the feedback and the worked solution
    second_guess_share: float = 0.0  # of the examples whose answer is followed by a second, wrong one (a habit RL can unlearn)
    label_smoothing: float = 0.1  # of the target's probability spread over the writable tokens: a flatter policy, which RL sharpens
    level_weights: tuple[float, float, float] = (0.35, 0.4, 0.25)  # the examples' share of levels 1, 2, 3
    threads: int = 1  # one: OpenMP threads spin and stall when the cores are shared

    def key(self) -> str:
        fields = asdict(self)
        for added_later in ("second_guess_share", "label_smoothing"):  # at 0: the key (and file) of before
            if not fields[added_later]:
                del fields[added_later]
        payload = json.dumps({**fields, "threads": None, "version": FORMAT_VERSION, "vocab": list(VOCAB)},
                             sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def spec_for(cfg: Any) -> WarmStartSpec:
    """The warm start a TrainConfig asks for (its model shape and step count)."""
    return WarmStartSpec(d_model=cfg.d_model, layers=cfg.layers, heads=cfg.heads, steps=cfg.warmstart_steps)


def path_for(spec: WarmStartSpec, cache: Path) -> Path:
    """The file of `spec`'s warm start in the folder `cache` (TrainerSettings.warmstart_dir())."""
    return cache / f"policy-{spec.key()}.pt"
