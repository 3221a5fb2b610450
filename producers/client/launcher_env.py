"""Who this process is in a distributed job, from the launcher's environment (pure).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK, SLURM's srun SLURM_PROCID /
SLURM_NTASKS / SLURM_LOCALID, Open MPI OMPI_COMM_WORLD_RANK / _SIZE /
_LOCAL_RANK, MPICH and Intel MPI PMI_RANK / PMI_SIZE (and MPI_LOCALRANKID).
The first launcher whose rank and size parse wins, in that order: torchrun
started under srun sets both, and RANK is the one that names this process.

The node name is `host:local_rank` (the rank when no local rank is known), so
eight ranks on one host are eight voters of an evaluation round, and eight
journals that never share a directory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from areal_metrics.producers.contract.settings import read_setting

log = logging.getLogger(__name__)

# (rank, world size, local rank) variable names, in order of precedence
LAUNCHERS: tuple[tuple[str, str, str, str], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
NODE_MAX = 128  # the contract's node name length


@dataclass(frozen=True, slots=True)
class Identity:
    rank: int = 0
    world_size: int = 1
    local_rank: int | None = None
    host: str = "localhost"
    launcher: str | None = None  # which environment it came from; None: a single process

    @property
    def node(self) -> str:
        """`host:local_rank`: distinct for every process of a job (cut to the contract's 128 chars)."""
        suffix = f":{self.local_rank if self.local_rank is not None else self.rank}"
        return self.host[: NODE_MAX - len(suffix)] + suffix


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def identity_from_env(env: Mapping[str, str], host: str) -> Identity:
    """The process's rank, world size and local rank; a single process (0 of 1) when no launcher set them.

    A launcher whose values do not make sense (a rank outside 0..size-1, a
    size below 1) is skipped with a warning, never raised: a metrics client
    must not stop a training job over its environment.
    """
    host = host or "localhost"
    for launcher, rank_var, size_var, local_var in LAUNCHERS:
        rank, size = _int(env, rank_var), _int(env, size_var)
        if rank is None and size is None:
            continue
        if rank is None or size is None or size < 1 or not 0 <= rank < size:
            log.warning("ignoring %s=%r %s=%r: not a rank in 0..size-1", rank_var, env.get(rank_var),
                        size_var, env.get(size_var))
            continue
        local = _int(env, local_var)
        if local is not None and local < 0:
            local = None
        return Identity(rank=rank, world_size=size, local_rank=local, host=host, launcher=launcher)
    return Identity(host=host)


def job_run_id(env: Mapping[str, str]) -> str | None:
    """A run id every rank of one launch shares, where the launcher gives one.

    AREAL_RUN_ID first; then torchrun's rendezvous id (a fresh uuid under
    `--standalone`; "none" means unset), then SLURM's job (and step) id.
    """
    explicit = (read_setting("run_id", env) or "").strip()
    if explicit:
        return explicit
    rdzv = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if rdzv and rdzv.lower() != "none":
        return f"torchrun-{rdzv}"
    job = env.get("SLURM_JOB_ID", "").strip()
    if job:
        step = env.get("SLURM_STEP_ID", "").strip()
        return f"slurm-{job}" + (f".{step}" if step else "")
    return None
