"""Advantage estimators: group-relative (GRPO) and GAE (PPO). Pure tensor maths."""

from __future__ import annotations

import torch


def group_relative(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each response's reward minus its group's mean, over the group's std.

    `rewards` is flat, groups are consecutive blocks of `group_size` responses
    to the same prompt. A group where every answer scored the same carries no
    signal and gets advantage 0.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    return ((grouped - mean) / (std + eps)).view(-1)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over token positions.

    rewards, values, mask: [batch, T]; mask is 1 for real response tokens (a
    response is a prefix of its row). The value after the last real token is 0
    (the episode ends). Returns (advantages, returns), zero where mask is 0.
    """
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(length)):
        next_value = values[:, t + 1] * mask[:, t + 1] if t + 1 < length else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last * (mask[:, t + 1] if t + 1 < length else 0)) * mask[:, t]
        advantages[:, t] = last
    returns = (advantages + values) * mask
    return advantages, returns


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [batch, T] with each sequence's reward on its last real token."""
    lengths = mask.sum(dim=1).long().clamp(min=1)
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    out[torch.arange(mask.shape[0]), lengths - 1] = rewards
    return out * mask
