"""Document-length distributions for the variable-length attention benchmark, and their packing into one call.

A packed call holds `total` tokens (16k in bench/kernel.py --varlen): documents laid end to end, the last one
cut to fit, as a training window of the token stream holds them. Its boundaries are cu_seqlens (int32,
(n + 1,), from 0), what flash_attn_varlen_func takes.

Distributions (DISTRIBUTIONS):
  corpus     the default corpus's train documents (data=stdlib, the Python standard library's .py files, as
             `make data` tokenizes them: one document = its tokens + <|endoftext|>), drawn at random. Read from
             the prepared cache (<repo>/.cache/data) when it is there; else from bench/doc_lengths_stdlib.json,
             the same lengths committed with the Python version and cache that produced them, so an offline GPU
             machine without the prepared data measures the same distribution. Regenerate that file after a
             tokenizer or corpus change with `python bench/doc_lengths.py --write` (needs `make data` first).
  lognormal  synthetic lengths, lognormal with median 1024 tokens and sigma 1 (a quarter of the documents
             below 520 tokens, a tenth above 3.7k): web-text-like, many short documents
  fixedN     every document N tokens (fixed1k, fixed2k, fixed4k): the same work as dense causal attention on
             (total / N, N), the like-for-like comparison of the varlen kernel with the dense one

    python bench/doc_lengths.py                # summary of every distribution, packed into 16k tokens
    python bench/doc_lengths.py --write        # corpus lengths from the prepared cache -> the committed JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python bench/doc_lengths.py` from anywhere imports the repo's data package

COMMITTED = REPO / "bench" / "doc_lengths_stdlib.json"
CACHE_DIR = REPO / ".cache" / "data"  # `make data` prepares here (the Makefile runs from the repo root)
FIXED = {"fixed1k": 1024, "fixed2k": 2048, "fixed4k": 4096}
DISTRIBUTIONS = ["corpus", "lognormal", *FIXED]
LOGNORMAL_MEDIAN = 1024
LOGNORMAL_SIGMA = 1.0
SEED = 0  # which documents a packed call draws: fixed, so every method and every run sees the same call


# ------------------------------------------------------------------------------------------ corpus lengths
def lengths_from_shard(tokens: np.ndarray, eot: int) -> np.ndarray:
    """Document lengths of a shard (uint16 ids, each document followed by <|endoftext|>): tokens up to and
    including each separator. Tokens after the last separator (none in a shard data.prepare wrote) are dropped."""
    ends = np.flatnonzero(tokens == eot) + 1  # one past each separator
    return np.diff(ends, prepend=0).astype(np.int64)


def corpus_lengths_from_cache(cache_dir: Path = CACHE_DIR, cfg=None) -> tuple[np.ndarray, dict] | None:
    """(train document lengths, description) from the prepared cache of cfg (default: the default corpus under
    cache_dir), or None when that cache is not prepared."""
    from data.cache import TRAIN_FILE, check_cache, locate
    from data.config import PrepareConfig

    try:
        path, key, identity = locate((cfg or PrepareConfig(cache_dir=str(cache_dir))).resolved())
    except (OSError, ValueError):  # e.g. a Python without its standard library's sources: nothing was prepared
        return None
    meta, _ = check_cache(path, key)
    if meta is None:
        return None
    tokens = np.memmap(path / TRAIN_FILE, dtype=meta["dtype"], mode="r")
    lengths = lengths_from_shard(np.asarray(tokens), meta["eot_id"])
    info = {"from": f"prepared cache {path}", "cache": path.name, "python": identity.get("python"),
            "vocab_size": meta["vocab_size"], "documents": int(lengths.size), "tokens": int(lengths.sum())}  # fmt: skip
    return lengths, info


def load_committed(path: Path = COMMITTED) -> tuple[np.ndarray, dict]:
    """(lengths, description) from the committed JSON; a named error when it is missing or damaged."""
    try:
        data = json.loads(Path(path).read_text())
        lengths = np.asarray(data["lengths"], dtype=np.int64)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FileNotFoundError(
            f"{path}: no usable corpus document lengths ({err}); run `make data` then `python bench/doc_lengths.py --write`"
        ) from None
    if lengths.ndim != 1 or lengths.size == 0 or lengths.min() < 1:
        raise ValueError(f"{path}: 'lengths' must be a non-empty list of positive token counts")
    info = {k: v for k, v in data.items() if k != "lengths"}
    return lengths, dict(info, **{"from": f"committed {Path(path).name}"})


def corpus_lengths(cache_dir: Path = CACHE_DIR, committed: Path = COMMITTED, say=print) -> tuple[np.ndarray, dict]:
    """The default corpus's document lengths: from the prepared cache when present, else the committed JSON
    (saying so, with how to use the cache instead)."""
    found = corpus_lengths_from_cache(cache_dir)
    if found is not None:
        return found
    lengths, info = load_committed(committed)
    say(f"note: no prepared default corpus under {cache_dir} (`make data` prepares it); corpus document lengths "
        f"from {committed.name} (python {info.get('python')}, {info.get('documents')} documents)")
    return lengths, info


def write_committed(cache_dir: Path = CACHE_DIR, path: Path = COMMITTED) -> dict:
    """Write the prepared cache's train document lengths (sorted) to the committed JSON."""
    found = corpus_lengths_from_cache(cache_dir)
    if found is None:
        sys.exit(f"bench/doc_lengths.py --write: no prepared default corpus under {cache_dir}; run `make data` first")
    lengths, info = found
    info = {k: v for k, v in info.items() if k != "from"}
    path.write_text(json.dumps(dict(info, lengths=sorted(int(n) for n in lengths))) + "\n")
    return info


# ------------------------------------------------------------------------------------------------ packing
def sample_lengths(name: str, total: int, corpus: np.ndarray | None = None, seed: int = SEED) -> list[int]:
    """Document lengths of one packed call of `total` tokens from distribution `name`: drawn with `seed`,
    laid end to end, the last one cut so that they sum to exactly `total`."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown document-length distribution {name!r}; choose from {DISTRIBUTIONS}")
    if total < 1:
        raise ValueError(f"total tokens must be >= 1, got {total}")
    if name == "corpus":
        if corpus is None or len(corpus) == 0:
            raise ValueError("distribution 'corpus' needs the corpus lengths (corpus_lengths())")
        pool = np.sort(corpus)  # sorted: the same draw from the cache (shard order) and the committed (sorted) list
    rng = np.random.default_rng(seed)
    out, filled = [], 0
    while filled < total:
        if name in FIXED:
            n = FIXED[name]
        elif name == "lognormal":
            n = max(1, round(float(rng.lognormal(np.log(LOGNORMAL_MEDIAN), LOGNORMAL_SIGMA))))
        else:
            n = int(pool[rng.integers(len(pool))])
        n = min(n, total - filled)
        out.append(n)
        filled += n
    return out


def cu_seqlens(lengths) -> np.ndarray:
    """(n + 1,) int32 prefix sums from 0: where each document starts in the packed tensor, then the total."""
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def document_ids(lengths) -> np.ndarray:
    """(total,) int32: the index of the document each packed token belongs to (FlexAttention's mask reads it)."""
    return np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)


def summary(lengths) -> dict:
    """What the tables print about a packed call: documents, the longest, and the token-weighted mean length
    (sum n^2 / sum n: the document length an average token sits in, which sets the attention work)."""
    a = np.asarray(lengths, dtype=np.float64)
    return {"docs": int(a.size), "max_doc": int(a.max()), "token_mean_doc": float((a * a).sum() / a.sum())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help=f"write the prepared corpus's lengths to {COMMITTED.name}")
    p.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="where `make data` prepared the default corpus")
    p.add_argument("--total", type=int, default=16 * 1024, help="tokens per packed call")
    args = p.parse_args(argv)
    if args.write:
        info = write_committed(args.cache_dir)
        print(f"{COMMITTED}: {info['documents']} documents, {info['tokens']} tokens (python {info['python']})")
        return 0
    corpus, info = corpus_lengths(args.cache_dir)
    print(f"corpus: {info['from']}, {len(corpus)} documents, median {int(np.median(corpus))} tokens, "
          f"mean {corpus.mean():.0f}, max {corpus.max()}")
    for name in DISTRIBUTIONS:
        s = summary(sample_lengths(name, args.total, corpus))
        print(f"{name:<10} {args.total} tokens: {s['docs']} documents, longest {s['max_doc']}, "
              f"token-weighted mean length {s['token_mean_doc']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
