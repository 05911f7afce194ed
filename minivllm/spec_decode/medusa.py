"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state, head j guessing
the token j + 1 places past the one the target's own head predicts. No KV cache, no extra
forward pass of a model: one residual block and an LM head per position.

    h: the target's final (normed) hidden state of a request's last known token
    head j:  x = h; for each layer: x = x + silu(W x + b);  logits_j = lm_head_j(x)

Checkpoint directory (vLLM's Medusa layout): config.json {"hidden_size", "vocab_size",
"num_heads", "num_hidden_layers"} and safetensors with blocks.{j}.layers.{l}.weight/.bias and,
optionally, lm_heads.{j}.weight; heads without their own LM head share the target's (what
scripts/train_medusa.py trains: the blocks only).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int,
                 own_lm_heads: bool) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))})
            for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False)
                                      for _ in range(num_heads)) if own_lm_heads else None
        self.shared_lm_head: nn.Module | None = None  # the target's, when there are no own heads

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def head_states(self, hidden: torch.Tensor, head: int) -> torch.Tensor:
        """hidden [B, H] -> the residual block output of `head` [B, H]."""
        x = hidden
        for layer in self.blocks[head]["layers"]:
            x = x + nn.functional.silu(layer(x))
        return x

    def head_logits(self, hidden: torch.Tensor, head: int) -> torch.Tensor:
        x = self.head_states(hidden, head)
        lm_head = self.lm_heads[head] if self.lm_heads is not None else self.shared_lm_head
        return lm_head(x)

    def head_greedy(self, hidden: torch.Tensor, head: int) -> torch.Tensor:
        """[B] argmax of head_logits, through the shared head's fused argmax where it has one."""
        x = self.head_states(hidden, head)
        if self.lm_heads is None and hasattr(self.shared_lm_head, "argmax_rows"):
            return self.shared_lm_head.argmax_rows(x.contiguous())
        lm_head = self.lm_heads[head] if self.lm_heads is not None else self.shared_lm_head
        return lm_head(x).argmax(-1)


def load_medusa_heads(path: str, target_hidden: int, target_vocab: int, device, dtype) -> MedusaHeads:
    """The heads of a Medusa directory, checked against the target's shapes."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    hidden, vocab = cfg.get("hidden_size"), cfg.get("vocab_size")
    if hidden != target_hidden or vocab != target_vocab:
        raise ValueError(f"speculative_config.model: the Medusa heads at {path!r} are for hidden_size={hidden}, "
                         f"vocab_size={vocab}; the target has {target_hidden}, {target_vocab}")
    state = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
    own = any(k.startswith("lm_heads.") for k in state)
    heads = MedusaHeads(hidden, vocab, int(cfg["num_heads"]), int(cfg.get("num_hidden_layers", 1)), own)
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"speculative_config.model: Medusa weights at {path!r} do not match its config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return heads.to(device=device, dtype=dtype).eval()


def save_medusa_heads(heads: MedusaHeads, path: str) -> None:
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["MedusaModel"], "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size,
           "num_heads": heads.num_heads, "num_hidden_layers": len(heads.blocks[0]["layers"])}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
    save_file(state, os.path.join(path, "model.safetensors"))


class MedusaProposer:
    needs_hidden = True

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads

    def drop(self, req_ids) -> None:
        pass

    @torch.inference_mode()
    def propose(self, requests, k: int, hidden: torch.Tensor | None) -> list[list[int]]:
        if not requests:
            return []
        n = min(k, self.heads.num_heads)
        tokens = torch.stack([self.heads.head_greedy(hidden, j) for j in range(n)], dim=1)  # [B, n]
        return tokens.tolist()
