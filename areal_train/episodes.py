"""Rollouts: the policy answers a batch of problems, in up to `max_turns` attempts each.

An episode is one token sequence: ``<bos> prompt <ans> attempt <eos>``, and
after a wrong attempt the feedback token ``<wrong>`` and the next attempt, as
in AReaL's multi-turn math workflow (feedback between attempts, reward
discounted per extra turn). The feedback is not the policy's action: only the
sampled tokens are trained on (`action`). An attempt that reaches
`attempt_len` tokens without `<eos>` is cut there (graded `truncated`).

Sampling is the Gumbel-max trick on explicit uniform noise: given the same
weights, prompts and noise, a row's tokens do not depend on the rest of the
batch's content. Evaluation derives each sample's noise from its own seed, so
every replica of a sample writes the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from areal_metrics.areal_train.grader import Grade, grade
from areal_metrics.areal_train.policy import Policy, positions_of
from areal_metrics.areal_train.task import EOS_ID, PAD_ID, VOCAB, WRONG_ID, Problem


@dataclass
class Episodes:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_valid: torch.Tensor  # [B, P]
    ids: torch.Tensor  # [B, S] the response region: attempts and feedback, right-padded
    valid: torch.Tensor  # [B, S] real tokens
    action: torch.Tensor  # [B, S] 1.0 where the policy sampled the token
    logprobs: torch.Tensor  # [B, S] sampling log-prob of each action (0 elsewhere)
    grades: list[list[Grade]] = field(default_factory=list)  # per row, one per attempt
    attempts: list[list[list[str]]] = field(default_factory=list)  # per row, the tokens of each attempt

    @property
    def solved_turn(self) -> list[int | None]:
        """Per row: the 1-based attempt that was right, or None."""
        return [next((i + 1 for i, g in enumerate(gs) if g.correct), None) for gs in self.grades]

    def rewards(self, turn_discount: float) -> list[float]:
        """1 for a right first attempt, times `turn_discount` per extra attempt; 0 when never right."""
        return [0.0 if t is None else turn_discount ** (t - 1) for t in self.solved_turn]

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, valid) of the whole sequences, prompt and response: [B, P + S]."""
        return torch.cat([self.prompt_ids, self.ids], dim=1), torch.cat([self.prompt_valid, self.valid], dim=1)

    def generated_tokens(self) -> int:
        """Tokens the policy wrote (not prompts, feedback or padding): the throughput's numerator."""
        return int(self.action.sum())


def encode_prompts(problems: list[Problem], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    rows = [p.prompt_ids() for p in problems]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD_ID] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
    return ids, ids != PAD_ID


def sample(logits: torch.Tensor, noise: torch.Tensor | None, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its log-prob) per row: greedy when noise is None, else Gumbel-max on `noise` (uniform)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if noise is None:
        token = logp.argmax(dim=-1)
    else:
        gumbel = -torch.log(-torch.log(noise.clamp(1e-10, 1 - 1e-7)))
        token = (logp + gumbel).argmax(dim=-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


@torch.no_grad()
def rollout(policy: Policy, problems: list[Problem], *, max_turns: int = 1, attempt_len: int = 28,
            temperature: float = 1.0, noise: torch.Tensor | None = None, device: torch.device | str = "cpu"
            ) -> Episodes:
    """Answer every problem; `noise` [B, max_turns * (attempt_len + 1), vocab] uniform, or None for greedy."""
    prompt_ids, prompt_valid = encode_prompts(problems, device)
    batch = len(problems)
    budget = max_turns * (attempt_len + 1)
    hidden, cache = policy.prefill(prompt_ids, prompt_valid)
    keys_valid = prompt_valid.clone()
    position = positions_of(prompt_valid)[:, -1] + 1
    ids = torch.full((batch, budget), PAD_ID, dtype=torch.long, device=device)
    valid = torch.zeros(batch, budget, dtype=torch.bool, device=device)
    action = torch.zeros(batch, budget, device=device)
    logprobs = torch.zeros(batch, budget, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    forced = torch.zeros(batch, dtype=torch.bool, device=device)  # <wrong> comes next
    attempt_start = [0] * batch
    grades: list[list[Grade]] = [[] for _ in range(batch)]
    attempts: list[list[list[str]]] = [[] for _ in range(batch)]
    used = 0
    for s in range(budget):
        token, logp = sample(policy.logits(hidden), None if noise is None else noise[:, s], temperature)
        sampled = ~done & ~forced
        token = torch.where(forced, torch.full_like(token, WRONG_ID), token)
        token = torch.where(done, torch.full_like(token, PAD_ID), token)
        ids[:, s], valid[:, s] = token, ~done
        action[:, s], logprobs[:, s] = sampled.float(), torch.where(sampled, logp, torch.zeros_like(logp))
        used = s + 1
        started_now = forced.clone()
        forced[:] = False
        lengths = s + 1 - torch.tensor(attempt_start, device=device)
        ended = sampled & ((token == EOS_ID) | (lengths >= attempt_len))
        for b in started_now.nonzero().flatten().tolist():
            attempt_start[b] = s + 1
        for b in ended.nonzero().flatten().tolist():
            tokens = [VOCAB[i] for i in ids[b, attempt_start[b]:s + 1].tolist()]
            result = grade(problems[b], tokens)
            grades[b].append(result)
            attempts[b].append(tokens)
            if result.correct or len(grades[b]) == max_turns:
                done[b] = True
            else:
                forced[b] = True
        if bool(done.all()):
            break
        keys_valid = torch.cat([keys_valid, valid[:, s:s + 1]], dim=1)
        hidden, cache = policy.decode(token, position, keys_valid, cache)
        position = position + valid[:, s].long()
    return Episodes(prompt_ids, prompt_valid, ids[:, :used], valid[:, :used], action[:, :used], logprobs[:, :used],
                    grades, attempts)
