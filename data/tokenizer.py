"""Byte-level BPE (GPT-2 style, Radford et al. 2019) trained with Hugging Face `tokenizers`.

Byte-level means the base alphabet is the 256 bytes, so every string encodes losslessly and
decode(encode(text)) == text. The one special token, <|endoftext|>, is appended after every document in
the shards, so a training window that spans two documents sees where one ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"


def new_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: documents are code and prose whose first word must round-trip unchanged.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(
    batches: Iterable[list[str]], vocab_size: int, length: int | None = None, show_progress: bool = True
) -> Tokenizer:
    """Train on an iterator of document batches; `length` (documents) only feeds the progress bar."""
    tokenizer = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        special_tokens=[EOT],  # id 0
        # Seed the alphabet with all 256 bytes so that bytes absent from the training text still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(batches, trainer=trainer, length=length)
    return tokenizer


def eot_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.token_to_id(EOT)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOT} token; it was not built by data.tokenizer")
    return token_id


def load_tokenizer(path) -> Tokenizer:
    return Tokenizer.from_file(str(path))


def text_batches(dataset, column: str = "text", batch_size: int = 1000) -> Iterator[list[str]]:
    """Document batches from a `datasets.Dataset`, the input `train_tokenizer` wants."""
    for batch in dataset.iter(batch_size=batch_size):
        yield batch[column]
