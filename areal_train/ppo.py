"""The PPO update on a batch of episodes: advantages, clipped loss, minibatches, gradient all-reduce.

Only the policy's own tokens count (`Episodes.action`): the prompt, the
feedback between attempts and the padding are context, never trained on.
The loss is the mean over those tokens of the batch (long episodes weigh by
their length). With GRPO each episode's advantage is its reward against its
group's; with GAE the reward sits on the episode's last token and the value
head's estimates are discounted back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_metrics.areal_train import advantages as adv
from areal_metrics.areal_train.episodes import Episodes
from areal_metrics.areal_train.metrics import masked_mean
from areal_metrics.areal_train.policy import Policy


@dataclass(frozen=True)
class PPOSettings:
    clip_eps: float = 0.2
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    value_coef: float = 0.5
    max_grad_norm: float = 1.0
    epochs: int = 1
    minibatches: int = 2
    temperature: float = 1.0


@dataclass(frozen=True)
class UpdateStats:
    loss: float
    clip_ratio: float
    entropy: float
    kl: float  # to the reference when kl_coef > 0, else approximate KL of the updated policy to the sampling one
    grad_norm: float
    advantage_mean: float
    advantage_std: float


def response_scores(policy: Policy, episodes: Episodes, rows: slice, temperature: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob, entropy, value) of each response position [b, S] of some rows, by teacher forcing."""
    ids, valid = episodes.full()
    ids, valid = ids[rows], valid[rows]
    prompt_len = episodes.prompt_ids.shape[1]
    hidden = policy(ids, valid)[:, prompt_len - 1:-1]  # the states that predict each response token
    logp_all = torch.log_softmax(policy.logits(hidden).float() / temperature, dim=-1)
    logprobs = logp_all.gather(-1, ids[:, prompt_len:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy, policy.values(hidden)


def advantages(episodes: Episodes, rewards: torch.Tensor, group_size: int, method: str, policy: Policy,
               gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantage per response position [B, S], returns for the value loss or None)."""
    mask = episodes.action
    if method == "grpo":
        return adv.group_relative(rewards, group_size)[:, None] * mask, None
    with torch.no_grad():
        _, _, values = response_scores(policy, episodes, slice(None), 1.0)
    valid = episodes.valid.float()
    token_rewards = adv.terminal_rewards(rewards, valid)
    advantage, returns = adv.gae(token_rewards, values, valid, gamma, lam)
    advantage = (advantage - masked_mean(advantage, mask)) * mask
    return advantage, returns


def update(policy: Policy, optimizer: torch.optim.Optimizer, episodes: Episodes, advantage: torch.Tensor,
           returns: torch.Tensor | None, reference: Policy | None, s: PPOSettings,
           all_reduce: Callable[[list[torch.Tensor]], None] | None) -> UpdateStats:
    batch = episodes.ids.shape[0]
    size = batch // s.minibatches
    ref_logprobs = None
    if reference is not None and s.kl_coef > 0:
        with torch.no_grad():
            ref_logprobs, _, _ = response_scores(reference, episodes, slice(None), s.temperature)
    losses, clipped, entropies, kls, norms = [], [], [], [], []
    for _ in range(s.epochs):
        for first in range(0, batch, size):
            rows = slice(first, first + size)
            mask = episodes.action[rows]
            logprobs, entropy, values = response_scores(policy, episodes, rows, s.temperature)
            log_ratio = torch.where(mask > 0, logprobs - episodes.logprobs[rows], 0.0)  # context tokens: none
            ratio = torch.exp(log_ratio)
            a = advantage[rows]
            pg = -torch.min(ratio * a, ratio.clamp(1 - s.clip_eps, 1 + s.clip_eps) * a)
            loss = masked_mean(pg - s.entropy_coef * entropy, mask)
            if ref_logprobs is not None:
                to_ref = torch.where(mask > 0, ref_logprobs[rows] - logprobs, 0.0)
                kl = torch.exp(to_ref) - to_ref - 1  # k3: unbiased, >= 0
                loss = loss + s.kl_coef * masked_mean(kl, mask)
            else:
                kl = torch.exp(-log_ratio) + log_ratio - 1  # of the sampling policy to this one
            if returns is not None:
                loss = loss + s.value_coef * masked_mean((values - returns[rows]) ** 2, episodes.valid[rows].float())
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            if all_reduce is not None:
                all_reduce([p.grad for p in policy.parameters() if p.grad is not None])
            norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), s.max_grad_norm)))
            optimizer.step()
            losses.append(float(loss.detach()))
            clipped.append(float(masked_mean(((ratio - 1).abs() > s.clip_eps).float(), mask)))
            entropies.append(float(masked_mean(entropy.detach(), mask)))
            kls.append(float(masked_mean(kl.detach(), mask)))
    tokens = advantage[episodes.action > 0]
    return UpdateStats(loss=sum(losses) / len(losses), clip_ratio=min(max(sum(clipped) / len(clipped), 0.0), 1.0),
                       entropy=entropies[0], kl=max(sum(kls) / len(kls), 0.0), grad_norm=sum(norms) / len(norms),
                       advantage_mean=float(tokens.mean()) if tokens.numel() else 0.0,
                       advantage_std=float(tokens.std(unbiased=False)) if tokens.numel() else 0.0)
