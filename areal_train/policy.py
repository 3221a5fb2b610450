"""A small decoder-only transformer policy (about 0.8 M parameters at the defaults).

Pre-norm blocks, rotary position embeddings (relative positions: copying a
number from the prompt works wherever the prompt puts it), tied input and
output embeddings, and a value head (used by GAE; GRPO ignores it). Rows are left-padded: `valid`
marks real tokens, positions count real tokens only, and a padded key is
never attended to. Every query also attends to itself, so a padded row
position stays finite (its output is ignored).

`prefill` + `decode` run the model incrementally with a key/value cache
(generation); `forward` runs whole sequences (teacher forcing, for scoring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from areal_metrics.areal_train.task import ANS, BOS, PAD, TOKEN_ID, VOCAB_SIZE, WRONG

NOT_WRITTEN = (PAD, BOS, ANS, WRONG)  # structure and feedback: the policy's context, never its action
NEVER = -1e9  # their logit (finite, so entropies stay finite)
Cache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, heads, T, head_dim]


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff_in = nn.Linear(d_model, 4 * d_model)
        self.ff_out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                cache: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, T, D]; mask [B, 1, T, T_keys] (True = may attend); returns (x, (keys, values))."""
        batch, length, d_model = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, length, 3, self.heads, d_model // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, *rotary), rotate(k, *rotary)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, d_model))
        x = x + self.ff_out(F.gelu(self.ff_in(self.ln2(x))))
        return x, (k, v)


class Policy(nn.Module):
    def __init__(self, d_model: int = 128, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} does not split into {heads} heads")
        self.tokens = nn.Embedding(VOCAB_SIZE, d_model)
        half = d_model // heads // 2
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(half) / half)), persistent=False)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.value_head = nn.Linear(d_model, 1)
        writable = torch.ones(VOCAB_SIZE, dtype=torch.bool)
        writable[[TOKEN_ID[t] for t in NOT_WRITTEN]] = False
        self.register_buffer("writable", writable, persistent=False)
        nn.init.normal_(self.tokens.weight, std=0.02)

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits, tied embeddings; tokens the policy never writes get a huge negative."""
        return (hidden @ self.tokens.weight.T).masked_fill(~self.writable, NEVER)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.value_head(hidden).squeeze(-1)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, head_dim / 2] of each token's position."""
        angles = positions[:, None, :, None].float() * self.inv_freq
        return angles.cos(), angles.sin()

    def forward(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Whole sequences: ids, valid [B, T] -> hidden states [B, T, D]."""
        length = ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        mask = (causal[None] & valid[:, None, :]) | torch.eye(length, dtype=torch.bool, device=ids.device)[None]
        x, rotary = self.tokens(ids), self._rotary(positions_of(valid))
        for block in self.blocks:
            x, _ = block(x, mask[:, None], rotary)
        return self.ln_final(x)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, Cache]:
        """Prompts: hidden state of the last position [B, D] and the cache."""
        length = ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        mask = ((causal[None] & valid[:, None, :]) | torch.eye(length, dtype=torch.bool, device=ids.device)[None])[:, None]
        x, rotary = self.tokens(ids), self._rotary(positions_of(valid))
        cache: Cache = []
        for block in self.blocks:
            x, kv = block(x, mask, rotary)
            cache.append(kv)
        return self.ln_final(x)[:, -1], cache

    @torch.no_grad()
    def decode(self, token: torch.Tensor, position: torch.Tensor, valid_keys: torch.Tensor, cache: Cache
               ) -> tuple[torch.Tensor, Cache]:
        """One new token per row: token, position [B]; valid_keys [B, T+1] (the new one last)."""
        x, rotary = self.tokens(token[:, None]), self._rotary(position[:, None])
        mask = valid_keys.clone()
        mask[:, -1] = True  # a query always sees itself
        mask = mask[:, None, None, :]
        new_cache: Cache = []
        for block, kv in zip(self.blocks, cache):
            x, kv = block(x, mask, rotary, kv)
            new_cache.append(kv)
        return self.ln_final(x)[:, 0], new_cache


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: each pair of channels of x [B, H, T, head_dim] turned by its position's angle."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def positions_of(valid: torch.Tensor) -> torch.Tensor:
    """Position of each token among its row's real tokens (0 for left padding)."""
    return (valid.long().cumsum(dim=1) - 1).clamp(min=0)
