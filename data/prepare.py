"""Build (or reuse) the data cache: corpus -> document split -> BPE tokenizer -> uint16 shards + meta.json.

    python -m data.prepare                      # the default: stdlib corpus, 50257-token BPE
    python -m data.prepare files:corpus/*.txt --vocab-size 8000
    python -m data.prepare hub:Salesforce/wikitext --hub-config wikitext-103-raw-v1

The split is by DOCUMENT: a permutation of document indices seeded by split_seed picks
max(1, round(n * val_fraction)) val documents; both shards keep the source order. The tokenizer is trained
on the train documents only, so nothing about val leaks into it.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from data.cache import (
    FORMAT_VERSION,
    META_FILE,
    TOKEN_DTYPE,
    TOKENIZER_FILE,
    TRAIN_FILE,
    VAL_FILE,
    check_cache,
    locate,
    new_build_dir,
    publish,
    remove_stale_builds,
    sha256_file,
)
from data.config import PrepareConfig
from data.shards import default_num_proc, tokenize_documents, write_shard
from data.sources import load_documents
from data.tokenizer import eot_id, text_batches, train_tokenizer

log = logging.getLogger(__name__)


def split_documents(n_docs: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, val indices), each sorted, disjoint, covering range(n_docs)."""
    if n_docs < 2:
        raise ValueError(
            f"the corpus has {n_docs} document(s); the train/val split is by document and needs at least 2: "
            f"add documents, or for one big .txt file set data.text_sample_by=line or paragraph"
        )
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    perm = np.random.default_rng(seed).permutation(n_docs)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def prepare(cfg: PrepareConfig | None = None, verify: bool = False, force: bool = False) -> Path:
    """Return the directory of a valid cache for `cfg`, building it first if missing, stale or corrupt."""
    cfg = (cfg or PrepareConfig()).resolved()
    final, key, identity = locate(cfg)
    meta, why = check_cache(final, key, verify=verify)
    if meta is not None and not force:
        log.info("data cache is up to date: %s", final)
        return final
    rebuild = final.exists()
    if rebuild:
        log.warning("rebuilding the data cache %s: %s", final, why if meta is None else "--force")
    remove_stale_builds(final.parent, final.name)
    build = new_build_dir(final)
    try:
        _build(cfg, key, identity, build)
        publish(build, final, key, replace=rebuild)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)  # never leave a half-built directory behind
        raise
    return final


def _build(cfg: PrepareConfig, key: str, identity: dict, build: Path) -> dict:
    import datasets
    import tokenizers

    timings = {}
    start = time.perf_counter()
    scratch = build / "scratch"
    docs = load_documents(cfg, scratch)
    train_idx, val_idx = split_documents(len(docs), cfg.val_fraction, cfg.split_seed)
    train_docs, val_docs = docs.select(train_idx), docs.select(val_idx)
    timings["load_s"] = time.perf_counter() - start
    log.info("corpus %s: %d documents (%d train, %d val)", cfg.source, len(docs), len(train_docs), len(val_docs))

    start = time.perf_counter()
    tokenizer = train_tokenizer(text_batches(train_docs), cfg.vocab_size, length=len(train_docs))
    tokenizer.save(str(build / TOKENIZER_FILE))
    timings["tokenizer_s"] = time.perf_counter() - start
    log.info("trained byte-level BPE: %d tokens (asked %d)", tokenizer.get_vocab_size(), cfg.vocab_size)

    start = time.perf_counter()
    num_proc = cfg.tokenize_procs or default_num_proc()
    tokens, files = {}, {}
    for name, split_docs, file in (("train", train_docs, TRAIN_FILE), ("val", val_docs, VAL_FILE)):
        tokenized = tokenize_documents(split_docs, tokenizer, num_proc, scratch, name, key)
        tokens[name], sha = write_shard(tokenized, build / file, name)
        files[file] = {"bytes": (build / file).stat().st_size, "sha256": sha}
        del tokenized
    timings["tokenize_s"] = time.perf_counter() - start
    files[TOKENIZER_FILE] = {
        "bytes": (build / TOKENIZER_FILE).stat().st_size,
        "sha256": sha256_file(build / TOKENIZER_FILE),
    }
    shutil.rmtree(scratch, ignore_errors=True)

    meta = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": identity,
        "config": cfg.key_fields(),
        "dtype": TOKEN_DTYPE,
        "vocab_size": cfg.vocab_size,
        "tokenizer_vocab_size": tokenizer.get_vocab_size(),
        "eot_id": eot_id(tokenizer),
        "documents": {"train": len(train_docs), "val": len(val_docs)},
        "tokens": tokens,
        "files": files,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "versions": {
            "python": platform.python_version(),
            "tokenizers": tokenizers.__version__,
            "datasets": datasets.__version__,
        },
    }
    # meta.json last: its presence (with matching sizes) is what marks the directory complete.
    (build / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = PrepareConfig()
    parser = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Prepare (or check) the tokenized data cache ahead of training.",
    )
    parser.add_argument("source", nargs="?", default=defaults.source,
                        help="stdlib (default) | hub:<dataset name> | files:<path, directory or glob>")
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--hub-config", default=defaults.hub_config, help="hub dataset config name")
    parser.add_argument("--split", default=defaults.split, help="hub dataset split")
    parser.add_argument("--text-field", default=defaults.text_field)
    parser.add_argument("--streaming", action="store_true", help="hub: stream, keep --max-documents")
    parser.add_argument("--max-documents", type=int, default=defaults.max_documents)
    parser.add_argument("--text-sample-by", default=defaults.text_sample_by, choices=["document", "line", "paragraph"])
    parser.add_argument("--val-fraction", type=float, default=defaults.val_fraction)
    parser.add_argument("--split-seed", type=int, default=defaults.split_seed)
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    parser.add_argument("--num-proc", type=int, default=defaults.tokenize_procs, help="tokenizing processes")
    parser.add_argument("--verify", action="store_true", help="also check an existing cache's sha256 sums and token ids; rebuild it if they are wrong")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache is valid")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = _parse_args(argv)
    start = time.perf_counter()
    try:
        cfg = PrepareConfig(
            source=args.source,
            hub_config=args.hub_config,
            split=args.split,
            text_field=args.text_field,
            streaming=args.streaming,
            max_documents=args.max_documents,
            text_sample_by=args.text_sample_by,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            split_seed=args.split_seed,
            cache_dir=args.cache_dir,
            tokenize_procs=args.num_proc,
        )
        path = prepare(cfg, verify=args.verify, force=args.force)
    except (ValueError, OSError) as err:  # OSError: missing files, no network (ConnectionError)
        print(f"data.prepare: error: {err}", file=sys.stderr)
        return 2
    meta = json.loads((path / META_FILE).read_text())
    print(
        f"data cache: {path}\n"
        f"  documents train/val: {meta['documents']['train']}/{meta['documents']['val']}, "
        f"tokens train/val: {meta['tokens']['train']}/{meta['tokens']['val']}, "
        f"tokenizer vocab: {meta['tokenizer_vocab_size']} (config {meta['vocab_size']})\n"
        f"  {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
