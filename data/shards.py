"""Documents -> one flat uint16 token file, through `datasets.map` (batched, several processes).

Each document becomes its BPE ids followed by <|endoftext|>; the shard is the concatenation in document
order, raw little-endian uint16 with no header (np.memmap(path, dtype=np.uint16, mode="r") reads it back),
the nanoGPT layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import numpy as np

from data.sources import TEXT_COLUMN
from data.tokenizer import eot_id

IDS_COLUMN = "ids"
# Below this many documents per process, starting processes costs more than it saves.
MIN_DOCS_PER_PROC = 32


def default_num_proc() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _encode_batch(batch: dict, tokenizer, eot: int):
    """Encode a batch of documents into an Arrow table with one list<uint16> row per document."""
    import pyarrow as pa

    # encode_batch_fast skips the character offsets we never use (tokenizers >= 0.20.2).
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    docs = [np.asarray(e.ids + [eot], dtype=np.uint16) for e in encode(batch[TEXT_COLUMN], add_special_tokens=False)]
    offsets = np.zeros(len(docs) + 1, dtype=np.int32)
    np.cumsum([d.size for d in docs], out=offsets[1:])
    # One list array from flat values + offsets: far cheaper than datasets converting a list of arrays.
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(docs)))
    return pa.table({IDS_COLUMN: ids})


@contextlib.contextmanager
def _tokenizers_single_threaded(active: bool):
    """Forked map workers cannot reuse the Rust thread pool that tokenizer training started in the parent:
    `tokenizers` disables it in the child and prints a warning per worker unless the variable is set.
    Parallelism comes from the processes here; the variable is restored for the parent afterwards."""
    if not active:
        yield
        return
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def tokenize_documents(docs, tokenizer, num_proc: int, scratch_dir: Path, name: str, fingerprint: str):
    """`datasets.map` the tokenizer over `docs`; returns a Dataset with one list<uint16> column "ids"."""
    import datasets

    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids; uint16 shards hold at most 65536")
    num_proc = max(1, min(int(num_proc), len(docs) // MIN_DOCS_PER_PROC))
    scratch_dir.mkdir(parents=True, exist_ok=True)
    with _tokenizers_single_threaded(num_proc > 1):
        return docs.map(
            _encode_batch,
            batched=True,
            batch_size=256,
            num_proc=num_proc if num_proc > 1 else None,
            fn_kwargs={"tokenizer": tokenizer, "eot": eot_id(tokenizer)},
            remove_columns=docs.column_names,
            features=datasets.Features({IDS_COLUMN: datasets.List(datasets.Value("uint16"))}),
            # Explicit file and fingerprint: keeps the Arrow output inside the build directory, and spares
            # `datasets` from hashing the tokenizer to invent a fingerprint.
            cache_file_name=str(scratch_dir / f"tokenized-{name}.arrow"),
            new_fingerprint=f"{fingerprint}-{name}",
            desc=f"tokenize {name}",
        )


def write_shard(tokenized, path: Path, name: str) -> tuple[int, str]:
    """Concatenate the "ids" column into `path`; returns (number of tokens, sha256 of the file)."""
    from tqdm.auto import tqdm

    column = tokenized.data.column(IDS_COLUMN)  # pyarrow ChunkedArray of list<uint16>
    digest = hashlib.sha256()
    n_tokens = 0
    with open(path, "wb") as f, tqdm(total=len(tokenized), desc=f"write {name} shard", unit="doc") as bar:
        for chunk in column.chunks:
            # flatten() honours the chunk's offsets, so sliced chunks give exactly their own values.
            ids = chunk.flatten().to_numpy(zero_copy_only=False).astype("<u2", copy=False)
            data = ids.tobytes()
            f.write(data)
            digest.update(data)
            n_tokens += ids.size
            bar.update(len(chunk))
    return n_tokens, digest.hexdigest()


def open_shard(path: Path, n_tokens: int | None = None) -> np.memmap:
    """Read-only memmap of a shard, checked against the token count recorded in meta.json."""
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if n_tokens is not None and tokens.size != n_tokens:
        raise ValueError(f"{path} holds {tokens.size} tokens, meta.json says {n_tokens}: delete it and prepare again")
    return tokens
