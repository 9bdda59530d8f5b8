"""Training and validation windows over a token shard, and the per-rank order in which they are read.

A window is seq_len + 1 consecutive tokens; x = window[:-1], y = window[1:] (next-token targets).

Train windows are a pure function of (seed, global window index g): the start offset of window g is drawn
from np.random.default_rng([seed, g]), uniform over every valid start. Nothing depends on which process,
worker or epoch computes it, so any (rank, step) can be recomputed anywhere:

    global window index of batch slot j, at step s, on rank r of W:   g = o + (s * W + r) * B + j

(o = 0 unless a resume changed B or W: then o keeps the stream going at the window where it stopped),
i.e. the global stream is cut into consecutive blocks of B windows, dealt round-robin to the ranks. Every
rank reads different windows, the union over ranks at step s is the single-process stream's steps
s*W ... s*W + W - 1, and a run resumed at step s reads exactly what the uninterrupted run would have.

Val windows are fixed: evenly spaced start offsets across the val shard, the same every evaluation.

Documents (data.document_mask): the shard is every document's tokens followed by <|endoftext|>, and a window
cuts through that stream anywhere. Each <|endoftext|> of x opens a document (the separator is the document's
first token, as GPT-2 prompts an unconditional sample with it), and so does x's position 0 (a window that
starts mid-document holds that document's tail). With documents on, an item is (x, y, doc_start): doc_start
is a bool (seq_len,) tensor, True where a document starts. It is a pure function of the window's tokens, so it
adds no state: resume and the per-rank order stay as above. collate_documents packs a batch's documents into
the cu_seqlens of FlashAttention's varlen layout, which is what the model reads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, default_collate

from data.shards import open_shard


def check_enough_tokens(n_tokens: int, seq_len: int, split: str) -> None:
    if n_tokens < seq_len + 1:
        raise ValueError(
            f"the {split} split has {n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1} needed for one "
            f"window: lower seq_len, or use a bigger corpus (more documents / max_documents"
            + (", a larger val_fraction" if split == "val" else "")
            + ")"
        )


def train_window_start(seed: int, index: int, n_tokens: int, seq_len: int) -> int:
    """Start offset of global train window `index`, uniform over [0, n_tokens - seq_len - 1]."""
    high = n_tokens - seq_len  # exclusive bound: the last valid start is n_tokens - (seq_len + 1)
    return int(np.random.default_rng([seed, index]).integers(0, high))


def val_window_starts(n_tokens: int, seq_len: int, n_windows: int) -> np.ndarray:
    """`n_windows` evenly spaced start offsets covering the val shard (windows may overlap if it is short)."""
    last = n_tokens - (seq_len + 1)
    return np.linspace(0, last, num=n_windows).round().astype(np.int64)


def document_starts(x: torch.Tensor, eot_id: int) -> torch.Tensor:
    """x (T,) token ids -> bool (T,): True at position 0 and at every <|endoftext|> (each opens a document)."""
    starts = x == eot_id
    starts[0] = True
    return starts


def packed_cu_seqlens(doc_start: torch.Tensor) -> torch.Tensor:
    """doc_start (B, T) bool -> cu_seqlens int32 (n_pad + 1,): the documents of the batch's B windows packed
    one after another (B·T tokens), FlashAttention's varlen layout. Every window starts a document, so no
    document crosses a window. n_pad is the number of documents n rounded up to a power of two, the extra
    sequences empty (cu_seqlens repeats B·T): the tensor's length is then one of log2(B·T) + 1 sizes, so
    torch.compile sees few shapes (and marks the length dynamic after the first change), the host knows the
    count from the length without reading the tensor, and the kernel's grid and workspaces (which grow with the
    number of sequences) stay within 2x of the documents' own."""
    batch, seq_len = doc_start.shape
    starts = doc_start.reshape(-1).nonzero().squeeze(1)  # (n,) offsets in the packed batch
    n_pad = 1 << (len(starts) - 1).bit_length()
    cu_seqlens = torch.full((n_pad + 1,), batch * seq_len, dtype=torch.int32)
    cu_seqlens[: len(starts)] = starts
    return cu_seqlens


def collate_documents(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """DataLoader collate for items (x, y, doc_start): (x (B, T), y (B, T), cu_seqlens (n_pad + 1,) int32)."""
    x, y, doc_start = default_collate(items)
    return x, y, packed_cu_seqlens(doc_start)


class _ShardWindows(Dataset):
    """Opens the shard lazily, so that DataLoader workers each map the file instead of receiving a pickled
    copy of it. With vocab_size, every window is checked to hold ids below it (a corrupt shard is named)."""

    split = "train"  # names the split in error messages

    def __init__(self, path: str | Path, n_tokens: int, seq_len: int, vocab_size: int | None = None,
                 eot_id: int | None = None):
        check_enough_tokens(n_tokens, seq_len, self.split)
        self.path, self.n_tokens, self.seq_len = str(path), int(n_tokens), int(seq_len)
        self.vocab_size = vocab_size
        self.eot_id = eot_id  # set: items carry doc_start (see the module docstring)
        self._tokens: np.memmap | None = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state

    def window(self, start: int) -> tuple[torch.Tensor, ...]:
        if self._tokens is None:
            self._tokens = open_shard(Path(self.path), self.n_tokens)
        chunk = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        if self.vocab_size is not None and int(chunk.max()) >= self.vocab_size:
            # A corrupt shard: the embedding lookup would fail with a bare IndexError (or read garbage on GPU).
            offset = start + int(chunk.argmax())
            raise ValueError(
                f"{self.path} holds token id {int(chunk.max())} at token {offset}, not below the vocabulary size "
                f"{self.vocab_size}: the data cache is corrupt; rebuild it with `python -m data.prepare <source> "
                f"--vocab-size <data.vocab_size> --verify` (or delete {Path(self.path).parent})"
            )
        x, y = chunk[:-1], chunk[1:]  # (seq_len,), (seq_len,)
        if self.eot_id is None:
            return x, y
        return x, y, document_starts(x, self.eot_id)


class TrainWindows(_ShardWindows):
    """Map-style dataset: item g is global train window g (see the module docstring). Unbounded: the
    sampler decides which indices are read."""

    split = "train"

    def __init__(self, path: str | Path, n_tokens: int, seq_len: int, seed: int, vocab_size: int | None = None,
                 eot_id: int | None = None):
        super().__init__(path, n_tokens, seq_len, vocab_size, eot_id)
        if int(seed) < 0:
            raise ValueError(f"seed={seed} must be >= 0 (it seeds numpy's SeedSequence)")
        self.seed = int(seed)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.window(train_window_start(self.seed, int(index), self.n_tokens, self.seq_len))


class ValWindows(_ShardWindows):
    """Map-style dataset over a fixed list of val window starts."""

    split = "val"

    def __init__(self, path: str | Path, n_tokens: int, seq_len: int, starts: np.ndarray, vocab_size: int | None = None,
                 eot_id: int | None = None):
        super().__init__(path, n_tokens, seq_len, vocab_size, eot_id)
        self.starts = np.asarray(starts, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.window(int(self.starts[index]))


class TrainBatchSampler(Sampler[list[int]]):
    """Yields, for steps start_step .. num_steps - 1, the B global window indices of this rank's batch.

    __len__ is num_steps, the whole epoch, even when resuming at start_step > 0: Lightning restores its
    in-epoch batch counter from the checkpoint and ends the epoch when that counter reaches
    len(dataloader), so the length must count the batches already consumed.
    """

    def __init__(self, batch_size: int, num_steps: int, world_size: int = 1, rank: int = 0, start_step: int = 0,
                 window_offset: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.batch_size, self.num_steps = int(batch_size), int(num_steps)
        self.world_size, self.rank, self.start_step = int(world_size), int(rank), int(start_step)
        self.window_offset = int(window_offset)

    def indices(self, step: int) -> list[int]:
        first = self.window_offset + (step * self.world_size + self.rank) * self.batch_size
        return list(range(first, first + self.batch_size))

    def __iter__(self):
        for step in range(self.start_step, self.num_steps):
            yield self.indices(step)

    def __len__(self) -> int:
        return self.num_steps


def val_rank_starts(
    n_tokens: int, seq_len: int, val_batches: int, batch_size: int, world_size: int = 1, rank: int = 0
) -> np.ndarray:
    """This rank's share of the fixed val windows, whole batches dealt round-robin (batch b -> rank b % W).

    The batch count is rounded up to a multiple of W so every rank runs the same number of val steps (a rank
    that ran fewer would hang the others in a synced metric). When W divides val_batches the set of windows
    is the same for every W, so val loss is comparable across world sizes.
    """
    batches_per_rank = -(-int(val_batches) // world_size)
    total_batches = batches_per_rank * world_size
    starts = val_window_starts(n_tokens, seq_len, total_batches * batch_size).reshape(total_batches, batch_size)
    return starts[rank::world_size].reshape(-1)
