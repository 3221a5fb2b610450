"""The few collectives the trainer uses, each a no-op for a single rank (gloo, through CPU memory).

Every rank must call the same collectives in the same order; the trainer
keeps them at fixed points of a step (gradients, the control payload, the
evaluation checks, checkpoints).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class Collective:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.active = world_size > 1

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (pickled: every rank passes one of the same type)."""
        if not self.active:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any."""
        if not self.active:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def mean_(self, tensors: list[torch.Tensor]) -> None:
        """Average in place over the ranks, one all-reduce for all of them (flattened)."""
        if not self.active or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world_size
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n

    def broadcast_module_(self, module: torch.nn.Module) -> None:
        """Rank 0's weights everywhere."""
        if not self.active:
            return
        for p in module.state_dict().values():
            cpu = p.data.cpu()
            dist.broadcast(cpu, src=0)
            p.data.copy_(cpu)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()
