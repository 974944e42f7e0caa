"""A small Llama-style decoder: RoPE, grouped-query attention, RMSNorm, SwiGLU, tied
embeddings. Trained here (kvcache_eval.train) on the synthetic tasks; no external weights.

Two ways to run it:

* ``forward(tokens)``: a whole batch of sequences at once, causal (training, prefill);
  ``prefill(tokens)`` also returns each layer's keys and values (RoPE applied) for a cache.
* ``decode(token, position, cache, capture)``: one new token of one sequence at its TRUE
  position (evictions shrink the cache below the token count), attending over
  ``cache.extend(layer, k, v)`` (a kvcache_client.torch DenseKvCache or PooledKvCache).
  With a capture (kvcache_client.torch.StepScores) each layer's scores are added: by
  default recomputed from the query and the keys, as a worker with a fused attention
  kernel must (``capture_from="weights"`` pools the weights this code computed anyway).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab: int = 64
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 384
    rope_base: float = 10000.0
    max_len: int = 2048
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(cfg: Config) -> Tuple[torch.Tensor, torch.Tensor]:
    half = cfg.head_dim // 2
    freq = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = torch.arange(cfg.max_len, dtype=torch.float64)[:, None] * freq[None, :]
    return angle.cos().float(), angle.sin().float()  # [max_len, half]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, head_dim] (rotate-half convention), cos/sin [T, half]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


_MASKS: Dict[Tuple[int, str], torch.Tensor] = {}


def causal_mask(t: int, device: torch.device) -> torch.Tensor:
    """[t, t] float: 0 on and below the diagonal, -inf above."""
    key = (t, str(device))
    if key not in _MASKS:
        _MASKS.clear()
        _MASKS[key] = torch.full((t, t), float("-inf"), device=device).triu(1)
    return _MASKS[key]


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.q = nn.Linear(cfg.d_model, cfg.heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> (out [B, T, d], queries [B, heads, T, head_dim], keys, values
        [B, kv_heads, T, head_dim]; RoPE applied to the queries and keys)."""
        cfg = self.cfg
        b, t, _ = x.shape

        q = self.q(x).view(b, t, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = cfg.heads // cfg.kv_heads
        # [b * kv, group * t, d] @ [b * kv, d, t], the scale and the causal mask fused in.
        qg = q.reshape(b * cfg.kv_heads, group * t, cfg.head_dim)
        kt = k.reshape(b * cfg.kv_heads, t, cfg.head_dim).transpose(1, 2)
        mask = causal_mask(t, x.device).repeat(group, 1)  # [group * t, t]
        logits = torch.baddbmm(mask, qg, kt, alpha=1.0 / math.sqrt(cfg.head_dim))
        weights = torch.softmax(logits, dim=-1)
        out = torch.bmm(weights, v.reshape(b * cfg.kv_heads, t, cfg.head_dim))
        out = out.view(b, cfg.heads, t, cfg.head_dim).transpose(1, 2).reshape(b, t, -1)
        return self.o(out), q, k, v


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Decoder(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        for block in self.blocks:
            for linear in (block.attn.q, block.attn.k, block.attn.v, block.gate, block.up):
                nn.init.normal_(linear.weight, std=0.02)
            for linear in (block.attn.o, block.down):
                nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    # -- whole sequences -----------------------------------------------------------------

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]."""
        return self.prefill(tokens)[0]

    def prefill(self, tokens: torch.Tensor, windows: Sequence[Any] = ()
                ) -> Tuple[torch.Tensor, List[torch.Tensor], List[torch.Tensor]]:
        """tokens [B, T] -> (logits [B, T, vocab], per-layer keys and values [B, kv_heads,
        T, head_dim], RoPE applied to the keys). ``windows``: observation windows
        (kvcache_client.torch.ObservationWindow) of a one-sequence batch, each filled
        layer by layer from the prompt's queries and keys as the prefill runs."""
        if windows and tokens.shape[0] != 1:
            raise ValueError("observation windows are per sequence: prefill one at a time")
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(tokens)
        keys, values = [], []
        for block in self.blocks:
            out, q, k, v = block.attn(block.attn_norm(x), cos, sin)
            for window in windows:
                window.add(q[0], k[0])
            x = x + out
            x = x + block.mlp(block.ffn_norm(x))
            keys.append(k)
            values.append(v)
        return self.norm(x) @ self.embed.weight.t(), keys, values

    # -- one decode step -----------------------------------------------------------------

    @torch.no_grad()
    def decode(self, token: int, position: int, cache: Any, capture: Any = None, *,
               capture_from: str = "query") -> torch.Tensor:
        """Logits [vocab] after feeding ``token`` at ``position``; each layer appends its
        K/V through ``cache.extend`` and, with a ``capture``, adds its scores."""
        cfg = self.cfg
        group = cfg.heads // cfg.kv_heads
        scale = 1.0 / math.sqrt(cfg.head_dim)
        cos, sin = self.cos[position:position + 1], self.sin[position:position + 1]
        x = self.embed.weight[token].view(1, -1)
        for layer, block in enumerate(self.blocks):
            a = block.attn
            h = block.attn_norm(x)
            q = apply_rope(a.q(h).view(cfg.heads, 1, cfg.head_dim), cos, sin)
            k = apply_rope(a.k(h).view(cfg.kv_heads, 1, cfg.head_dim), cos, sin)
            v = a.v(h).view(cfg.kv_heads, cfg.head_dim)
            keys, values = cache.extend(layer, k.view(cfg.kv_heads, cfg.head_dim), v)
            qg = q.view(cfg.kv_heads, group, cfg.head_dim)
            weights = torch.softmax((qg @ keys.transpose(-1, -2)) * scale, dim=-1)
            out = (weights @ values).reshape(1, -1)
            if capture is not None:
                if capture_from == "weights":
                    capture.add_weights(weights.reshape(cfg.heads, -1), values)
                else:
                    capture.add(q.view(cfg.heads, cfg.head_dim), keys, values)
            x = x + a.o(out)
            x = x + block.mlp(block.ffn_norm(x))
        return (self.norm(x) @ self.embed.weight.t()).view(-1)


def save(model: Decoder, path: str, meta: Dict[str, Any]) -> None:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"config": asdict(model.cfg), "state_dict": state, "meta": meta}, path)


def load(path: str) -> Tuple[Decoder, Dict[str, Any]]:
    blob = torch.load(path, map_location="cpu")
    known = {f.name for f in fields(Config)}
    model = Decoder(Config(**{k: v for k, v in blob["config"].items() if k in known}))
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, blob.get("meta", {})
