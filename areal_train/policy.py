"""A tiny autoregressive policy: embedding -> GRU -> action logits and a value.

Prompts are left-padded so that every row's last prompt token ("=") sits in
the same column; the answer is generated from there, one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from areal_train.task import EOS_ACTION, N_ACTIONS, PAD, VOCAB_SIZE, Problem, action_to_token


@dataclass
class Rollout:
    """Responses to a batch of prompts, with what PPO needs from the sampling policy."""

    prompts: torch.Tensor  # [B, P] token ids, left-padded
    actions: torch.Tensor  # [B, T] action ids (EOS_ACTION ends an answer; later columns are masked)
    mask: torch.Tensor  # [B, T] 1.0 for tokens that belong to the answer (up to and including EOS)
    logprobs: torch.Tensor  # [B, T] log-prob of each action under the sampling policy
    values: torch.Tensor  # [B, T] value estimates at each answer position


class Policy(nn.Module):
    def __init__(self, hidden: int = 64, embed: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, embed)
        self.rnn = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, N_ACTIONS)
        self.value = nn.Linear(hidden, 1)

    # -- generation ---------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, max_len: int, greedy: bool = False,
                 generator: torch.Generator | None = None) -> Rollout:
        out, h = self.rnn(self.embed(prompts))
        state = out[:, -1]
        actions, logprobs, values = [], [], []
        for _ in range(max_len):
            logits = self.head(state)
            dist = torch.distributions.Categorical(logits=logits)
            if greedy:
                action = logits.argmax(dim=-1)
            else:
                action = torch.multinomial(dist.probs, 1, generator=generator).squeeze(1)
            actions.append(action)
            logprobs.append(dist.log_prob(action))
            values.append(self.value(state).squeeze(-1))
            token = torch.where(action == EOS_ACTION, torch.full_like(action, action_to_token(EOS_ACTION)), action)
            out, h = self.rnn(self.embed(token).unsqueeze(1), h)
            state = out[:, 0]
        actions_t = torch.stack(actions, dim=1)
        return Rollout(prompts, actions_t, answer_mask(actions_t), torch.stack(logprobs, 1), torch.stack(values, 1))

    # -- scoring (teacher forcing) -------------------------------------------

    def score(self, prompts: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-probs of `actions`, entropies, values), each [B, T], in one pass."""
        tokens = actions[:, :-1].clone()
        tokens[tokens == EOS_ACTION] = action_to_token(EOS_ACTION)
        seq = torch.cat([prompts, tokens], dim=1)
        out, _ = self.rnn(self.embed(seq))
        states = out[:, prompts.shape[1] - 1:]
        logits = self.head(states)
        logp_all = torch.log_softmax(logits, dim=-1)
        logprobs = logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logprobs, entropy, self.value(states).squeeze(-1)


def answer_mask(actions: torch.Tensor) -> torch.Tensor:
    """1.0 up to and including the first EOS of each row (all ones if none)."""
    is_eos = (actions == EOS_ACTION).float()
    ended_before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS strictly before this column
    return (ended_before == 0).float()


def encode_prompts(problems: list[Problem], device: torch.device | str = "cpu") -> torch.Tensor:
    rows = [p.prompt_tokens() for p in problems]
    width = max(len(r) for r in rows)
    padded = [[PAD] * (width - len(r)) + r for r in rows]
    return torch.tensor(padded, dtype=torch.long, device=device)
