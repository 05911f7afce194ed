"""Train Medusa heads for a model on its own generated text (self-distillation), on the CPU.

    python scripts/train_medusa.py --out medusa-heads [--model PATH] [--num-heads 3] [--prompts 96]

1. The model answers a set of chat prompts greedily (minivllm's LLM): the text the heads will
   have to guess is the model's own.
2. One Hugging Face forward over each prompt + answer gives the final hidden states h_t (the
   model's last norm applied, as the runner hands them to the heads).
3. Head j learns to predict token t + j + 2 from h_t (the model's own head predicts t + 1): a
   residual block per head, trained with cross-entropy through the model's frozen LM head, which
   the heads share (the checkpoint has no lm_heads.*: minivllm then uses the target's).

Writes the Medusa directory layout that spec_decode/medusa.py loads.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

TOPICS = ["the ocean", "a city at night", "learning to cook", "the history of maps", "photosynthesis",
          "a rainy afternoon", "how bridges stand", "the first computers", "friendship", "mountains",
          "the moon", "a small garden", "trains", "music theory", "honey bees", "winter"]
TASKS = ["Write a short paragraph about {}.", "Explain {} to a child.", "List five facts about {}.",
         "Write a haiku about {}.", "Describe {} in three sentences.", "Why does {} matter?"]


def chat_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pairs = [(t, s) for t in TASKS for s in TOPICS]
    rng.shuffle(pairs)
    return [t.format(s) for t, s in pairs[:n]]


def generate(model_path: str | None, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Prompt + greedy answer token ids, through minivllm."""
    from minivllm import LLM, SamplingParams
    llm = LLM(model_path, dtype="float32", device="cpu")
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]


def hf_model(model_path: str | None):
    from transformers import AutoModelForCausalLM

    from minivllm.models.source import resolve_model_source
    src = resolve_model_source(model_path)
    if src.kind == "gguf":
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32).eval()


@torch.no_grad()
def hidden_states(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The final normed hidden states of each sequence: [len, H]."""
    return [model(torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0] for s in seqs]


def train(heads, lm_head: torch.nn.Module, hs: list[torch.Tensor], seqs: list[list[int]], epochs: int,
          lr: float, seed: int) -> list[float]:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(epochs):
        total, count = 0.0, 0
        for i in torch.randperm(len(seqs)).tolist():
            h, ids = hs[i], torch.tensor(seqs[i])
            loss = 0.0
            for j in range(heads.num_heads):
                shift = j + 2  # head j guesses token t + j + 2 from h_t
                if ids.shape[0] <= shift:
                    continue
                logits = lm_head(heads.head_states(h[:-shift], j))
                loss = loss + torch.nn.functional.cross_entropy(logits, ids[shift:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, count = total + float(loss), count + 1
        losses.append(total / max(count, 1))
    return losses


def main(argv: list[str] | None = None) -> int:
    from minivllm.spec_decode.medusa import MedusaHeads, save_medusa_heads
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--num-heads", type=int, default=3)
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.time()
    seqs = generate(args.model, chat_prompts(args.prompts, args.seed), args.max_tokens)
    model = hf_model(args.model)
    hs = hidden_states(model, seqs)
    lm_head = model.get_output_embeddings()
    lm_head.requires_grad_(False)
    cfg = model.config
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, args.num_heads, 1, own_lm_heads=False)
    for block in heads.blocks:  # start as the identity: silu(0 x + 0) = 0
        torch.nn.init.zeros_(block["layers"][0].weight)
        torch.nn.init.zeros_(block["layers"][0].bias)
    losses = train(heads, lm_head, hs, seqs, args.epochs, args.lr, args.seed)
    save_medusa_heads(heads, args.out)
    print(f"trained {args.num_heads} heads on {len(seqs)} sequences in {time.time() - t0:.0f} s; "
          f"loss by epoch {[round(x, 3) for x in losses]}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
