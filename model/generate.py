"""Autoregressive sampling with a key/value cache (model/gpt.py KVCache).

The prompt runs through the model once, as a training forward does (on a GPU through attention=flash, the
kernel), filling the cache; then each new token costs one forward of one position, whose query attends to
every cached key. Next tokens are drawn from softmax(logits / temperature) restricted to the top_k most likely
(temperature 0: the most likely, greedily); the padding rows of the vocabulary are never drawn.
"""

from __future__ import annotations

import torch

from model.gpt import GPT, ContextLengthError, KVCache


def check_room(prompt_len: int, max_new_tokens: int, seq_len: int) -> None:
    """Raise ContextLengthError when the prompt, or the prompt and the tokens to generate, exceed the context."""
    if prompt_len > seq_len:
        raise ContextLengthError(
            f"the prompt has {prompt_len} tokens, more than the model's context of seq_len={seq_len}; shorten the prompt"
        )
    if prompt_len + max_new_tokens > seq_len:
        raise ContextLengthError(
            f"the prompt's {prompt_len} tokens and max_new_tokens={max_new_tokens} exceed the model's context of "
            f"seq_len={seq_len}; set max_new_tokens <= {seq_len - prompt_len}"
        )


def next_token(
    logits: torch.Tensor, vocab_size: int, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """logits (B, V_padded) -> token ids (B, 1) below vocab_size."""
    logits = logits[:, :vocab_size].float()  # (B, V)
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < vocab_size:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """prompt (B, T0) token ids -> (B, T0 + max_new_tokens): the prompt and its continuation."""
    cfg = model.cfg
    B, T0 = prompt.shape
    check_room(T0, max_new_tokens, cfg.seq_len)
    dtype = next(model.parameters()).dtype
    cache = KVCache(cfg, B, T0 + max_new_tokens, prompt.device, dtype)
    model.eval()
    logits = model(prompt, cache=cache)[:, -1]  # (B, V): the whole prompt in one forward
    tokens = [prompt]
    for i in range(max_new_tokens):
        tokens.append(next_token(logits, cfg.vocab_size, temperature, top_k, generator))
        if i + 1 < max_new_tokens:
            logits = model(tokens[-1], cache=cache)[:, -1]  # one position, attending to the cache
    return torch.cat(tokens, dim=1)
