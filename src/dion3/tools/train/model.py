"""A small modern GPT for the training demo: RMSNorm, rotary position embeddings, QK-norm,
ReLU² MLP and an untied LM head named `lm_head`.

Every weight matrix is a separate 2-D `nn.Linear` weight (no fused QKV), so that each one is
orthogonalized as its own matrix by Muon-style optimizers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    rope_base: float = 10000.0

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"GPTConfig: head size d_model/n_head = {self.d_model // self.n_head} must be even for rotary embeddings")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Rotates pairs of channels (first half, second half) by position-dependent angles."""

    def __init__(self, head_dim: int, seq_len: int, base: float):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # [T, head_dim/2]
        # Buffers are not parameters, so the optimizers never see them.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # x: [B, heads, T, head_dim]
        length = x.shape[-2]
        cos, sin = self.cos[:length].to(x.dtype), self.sin[:length].to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        # QK-norm keeps attention logits bounded whatever the optimizer does to q and k.
        self.q_norm = RMSNorm(head_dim)
        self.k_norm = RMSNorm(head_dim)
        self.rotary = Rotary(head_dim, cfg.seq_len, cfg.rope_base)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, length, self.n_head, -1).transpose(1, 2)

        q = self.rotary(self.q_norm(heads(self.q(x))))
        k = self.rotary(self.k_norm(heads(self.k(x))))
        y = F.scaled_dot_product_attention(q, k, heads(self.v(x)), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.final_norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=module.in_features ** -0.5)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0)
        # Residual-branch outputs start at zero so every block begins as the identity.
        for block in self.blocks:
            nn.init.zeros_(block.attn.proj.weight)
            nn.init.zeros_(block.mlp.proj.weight)
        nn.init.zeros_(self.lm_head.weight)

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits [B, T, vocab], or the mean cross-entropy when `targets` is given."""
        if tokens.shape[-1] > self.config.seq_len:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds the model's seq_len {self.config.seq_len}")
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def padded_vocab(vocab_size: int, multiple: int = 128) -> int:
    """Round the vocabulary up (50257 → 50304) so the embedding and head shapes tile well."""
    return -(-vocab_size // multiple) * multiple
