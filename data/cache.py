"""The on-disk cache of one prepared corpus: naming, validation and atomic publication.

Layout: <cache_dir>/<source>-v<vocab>-<key>/ holding tokenizer.json, train.bin, val.bin (raw uint16 token ids,
read with np.memmap) and meta.json. The key hashes the format version, every PrepareConfig field that changes
the bytes, and the source identity (file list and sizes for local corpora), so a changed config or corpus
gets a new directory instead of silently reusing a stale one.

A cache is valid only if meta.json parses, names this key and format version, and every file it lists
exists with the recorded size (with verify=True also the recorded sha256 and token ids below the vocabulary
size). Builds happen in a temporary
sibling directory that is renamed into place only when complete, so a killed preparation never leaves a
directory that looks valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np

from data.config import PrepareConfig
from data.sources import parse_source, source_identity

# Bump when the shard layout or tokenization changes: every existing cache then becomes stale.
FORMAT_VERSION = 1
META_FILE = "meta.json"
TRAIN_FILE = "train.bin"
VAL_FILE = "val.bin"
TOKENIZER_FILE = "tokenizer.json"
TOKEN_DTYPE = "uint16"
_TMP_PREFIX = ".tmp-"


def cache_key(cfg: PrepareConfig, identity: dict) -> str:
    blob = json.dumps(
        {"format_version": FORMAT_VERSION, "config": cfg.key_fields(), "source": identity}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_name(cfg: PrepareConfig, key: str) -> str:
    """Readable directory name, e.g. 'stdlib-v50257-3f2a9c0d1b2e4f56'."""
    kind, arg = parse_source(cfg.source)
    label = kind if kind != "hub" else arg
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")[:40] or kind
    return f"{label}-v{cfg.vocab_size}-{key}"


def locate(cfg: PrepareConfig) -> tuple[Path, str, dict]:
    """(cache directory, key, source identity) for a resolved config; reads only file metadata."""
    identity = source_identity(cfg)
    key = cache_key(cfg, identity)
    return Path(cfg.cache_dir) / cache_name(cfg, key), key, identity


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_cache(path: Path, key: str, verify: bool = False) -> tuple[dict | None, str]:
    """(meta, "ok") for a valid cache, else (None, why not). verify=True also re-hashes every file and checks
    that every token id is below the tokenizer's vocabulary size."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        return None, f"{meta_path} is missing"
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
        version, meta_key = meta["format_version"], meta["key"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{meta_path} is unreadable ({err})"
    if version != FORMAT_VERSION or meta_key != key:
        return None, f"{meta_path} is for format {version} key {meta_key}, not format {FORMAT_VERSION} key {key}"
    for name in (TRAIN_FILE, VAL_FILE, TOKENIZER_FILE):
        if name not in files:
            return None, f"{meta_path} does not list {name}"
        file = Path(path) / name
        if not file.is_file():
            return None, f"{file} is missing"
        if file.stat().st_size != files[name]["bytes"]:
            return None, f"{file} has {file.stat().st_size} bytes, meta.json says {files[name]['bytes']}"
        if verify and sha256_file(file) != files[name]["sha256"]:
            return None, f"{file} does not match its sha256 in meta.json"
    if verify:
        for name in (TRAIN_FILE, VAL_FILE):
            top = max_token_id(Path(path) / name)
            if top >= meta["tokenizer_vocab_size"]:
                return None, f"{Path(path) / name} holds token id {top}, not below the vocabulary size {meta['tokenizer_vocab_size']}"
    return meta, "ok"


def max_token_id(path: Path, chunk: int = 1 << 26) -> int:
    """The largest token id in a shard (-1 when empty), read in chunks of `chunk` tokens."""
    tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r") if Path(path).stat().st_size else np.zeros(0, TOKEN_DTYPE)
    return max((int(tokens[i : i + chunk].max()) for i in range(0, tokens.size, chunk)), default=-1)


def new_build_dir(final: Path) -> Path:
    """A private temporary sibling of `final` (same filesystem, so the final rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{_TMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish(build: Path, final: Path, key: str, replace: bool = False) -> None:
    """Move a complete build into place. replace=True (a rebuild of a cache found corrupt, or forced): the
    directory there is replaced. Otherwise an invalid directory is replaced, and a valid one (built
    concurrently by another process, e.g. on a shared filesystem) wins and our build is dropped. The old
    directory is renamed away first, so a reader sees the old cache, none, or the new one: never a mix."""
    if final.exists():
        if not replace and check_cache(final, key)[0] is not None:
            shutil.rmtree(build, ignore_errors=True)
            return
        trash = final.parent / f"{_TMP_PREFIX}trash-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(build, final)
    except OSError:
        # Lost a race to a concurrent publisher between the check and the rename.
        if check_cache(final, key)[0] is None:
            raise
        shutil.rmtree(build, ignore_errors=True)


def remove_stale_builds(root: Path, name: str) -> None:
    """Delete temporary directories left by killed preparations of this cache (not other processes' live
    ones: those carry a live pid)."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if not entry.name.startswith(f"{_TMP_PREFIX}{name}-"):
            continue
        pid = entry.name[len(f"{_TMP_PREFIX}{name}-"):].split("-")[0]
        if pid.isdigit() and _pid_alive(int(pid)):
            continue
        shutil.rmtree(entry, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own earlier, failed attempt
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
