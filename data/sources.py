"""Corpus sources: each turns a `PrepareConfig.source` into a `datasets.Dataset` of documents.

The result always has exactly one string column, "text", one row per document, empty documents dropped,
in a deterministic order (the train/val split and the shards depend on that order).

Sources:
  stdlib        The Python standard library's own .py files, found through sysconfig (site-packages and
                dist-packages excluded), sorted by relative path, one document per file. Needs no network:
                it is the embedded default corpus.
  hub:<name>    Any Hugging Face hub dataset: load_dataset(name, hub_config, split=..., streaming=...);
                streaming keeps the first max_documents documents. A local dataset directory works too.
  files:<p>     Local files: a path, a directory (all files under it) or a glob; several joined by commas.
                .txt (and any other extension): one document per FILE by default (text_sample_by).
                .jsonl/.json: one document per record; .parquet: one per row (text_field picks the column).
                Compressed variants (.gz, .bz2, .xz, .zst) are read through datasets.

`source_identity()` describes the exact input (file list with sizes for local sources) so that the cache key
changes when the corpus does.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import io
import logging
import os
import platform
import socket
import sysconfig
import tokenize
from pathlib import Path

from data.config import PrepareConfig, parse_source, split_patterns

log = logging.getLogger(__name__)

TEXT_COLUMN = "text"
# Directories under the stdlib path that hold third-party packages, not the standard library.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
# A text file's first bytes decide whether it is text: binaries show a NUL or an invalid UTF-8 sequence early.
TEXT_SNIFF_BYTES = 1 << 16
BUILDER_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # anything else: "text"
# ----------------------------------------------------------------------------------------------- stdlib
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """All .py files of the standard library, sorted by path relative to `root` (stable across machines)."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"the Python standard library directory {root} (from sysconfig) does not exist")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into third-party package trees.
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def read_python_source(path: Path) -> str:
    """Decode a .py file the way Python would (PEP 263 coding line), never failing: a few stdlib test files
    are deliberately mis-encoded, and a corpus must not crash on them."""
    raw = Path(path).read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding, errors="replace")
    except (SyntaxError, LookupError):
        return raw.decode("utf-8", errors="replace")


def _fingerprint(rows) -> str:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(("\0".join(str(x) for x in row) + "\n").encode())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ files
def _builder_for(path: str) -> str:
    name = path.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return BUILDER_BY_SUFFIX.get(os.path.splitext(name)[1], "text")


def resolve_files(arg: str) -> tuple[list[str], str]:
    """Expand paths/directories/globs into a sorted file list and the one `datasets` builder that reads them."""
    files: list[str] = []
    for pattern in split_patterns(arg):
        if any(ch in pattern for ch in "*?["):
            matches = [m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise FileNotFoundError(f"no file matches the data pattern {pattern!r}")
            files.extend(matches)
        elif os.path.isdir(pattern):
            inside = [
                os.path.join(d, f)
                for d, dirnames, filenames in os.walk(pattern)
                for f in filenames
                if not f.startswith(".")
            ]
            if not inside:
                raise ValueError(f"the data directory {pattern!r} is empty: the corpus has no documents")
            files.extend(inside)
        elif os.path.isfile(pattern):
            files.append(pattern)
        else:
            raise FileNotFoundError(f"data path {pattern!r} does not exist (check data.source=files:...)")
    files = sorted(set(os.path.abspath(f) for f in files))
    builders = {_builder_for(f) for f in files}
    if len(builders) > 1:
        raise ValueError(
            f"data files mix formats {sorted(builders)} ({len(files)} files); point data.source at one kind "
            f"(.txt, .jsonl/.json or .parquet)"
        )
    return files, builders.pop()


def is_text_file(path: str) -> bool:
    """Whether a file's first TEXT_SNIFF_BYTES hold UTF-8 text: no NUL byte and no invalid sequence (an
    incomplete character cut at the end is fine). Compressed files are not sniffed (datasets decodes them)."""
    if path.lower().endswith(COMPRESSION_SUFFIXES):
        return True
    with open(path, "rb") as f:
        head = f.read(TEXT_SNIFF_BYTES)
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def text_files_only(files: list[str], source: str) -> list[str]:
    """Drop the files that are not text (binaries, other encodings), saying how many; refuse a corpus that is
    mostly such files (a wrong path, e.g. a build directory)."""
    text = [f for f in files if is_text_file(f)]
    skipped = sorted(set(files) - set(text))
    if len(skipped) * 2 > len(files):
        raise ValueError(
            f"{len(skipped)} of the {len(files)} files of {source!r} are not UTF-8 text (e.g. {skipped[0]}): "
            f"point data.source at text files (.txt, .jsonl/.json, .parquet or source code)"
        )
    if skipped:
        log.warning("skipped %d of %d files of %r that are not UTF-8 text, e.g. %s", len(skipped), len(files),
                    source, ", ".join(skipped[:3]))
    return text


# --------------------------------------------------------------------------------------------- identity
def source_identity(cfg: PrepareConfig) -> dict:
    """What exactly is read: part of the cache key, and recorded in meta.json."""
    kind, arg = parse_source(cfg.source)
    if kind == "stdlib":
        root = stdlib_root()
        files = stdlib_files(root)
        rows = [(p.relative_to(root).as_posix(), p.stat().st_size) for p in files]
        return {
            "kind": "stdlib",
            "python": platform.python_version(),
            "root": str(root),
            "files": len(files),
            "fingerprint": _fingerprint(rows),
        }
    if kind == "files":
        files, builder = resolve_files(arg)
        rows = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
        return {"kind": "files", "builder": builder, "files": len(files), "fingerprint": _fingerprint(rows)}
    # Hub datasets are identified by name/config/split; a silently updated upstream revision is not noticed.
    return {"kind": "hub", "name": arg, "config": cfg.hub_config, "split": cfg.split, "streaming": cfg.streaming}


# ------------------------------------------------------------------------------------------------ load
def load_documents(cfg: PrepareConfig, scratch_dir: str | os.PathLike | None = None):
    """Load the corpus as a `datasets.Dataset` with one "text" column, one non-empty document per row.

    scratch_dir: where `datasets` may write its Arrow cache for local files (deleted with the build);
    hub downloads keep the default Hugging Face cache so a rebuild does not download again.
    """
    import datasets

    kind, arg = parse_source(cfg.source)
    cache_dir = str(scratch_dir) if scratch_dir is not None else None
    if kind == "stdlib":
        files = stdlib_files()
        if cfg.max_documents is not None:
            files = files[: int(cfg.max_documents)]
        root = stdlib_root()
        log.info("stdlib corpus: %d .py files under %s", len(files), root)
        ds = datasets.Dataset.from_dict({TEXT_COLUMN: [read_python_source(p) for p in files]})
        return _check_not_empty(_drop_empty(ds), cfg.source)

    if kind == "files":
        files, builder = resolve_files(arg)
        kwargs = {}
        if builder == "text":
            files = text_files_only(files, cfg.source)
            kwargs = {"sample_by": cfg.text_sample_by, "keep_linebreaks": True, "encoding_errors": "replace"}
        ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir, **kwargs)
        field = TEXT_COLUMN if builder == "text" else cfg.text_field
        ds = _text_column(ds, field, cfg.source)
        if cfg.max_documents is not None:
            ds = ds.select(range(min(int(cfg.max_documents), len(ds))))
        return _check_not_empty(ds, cfg.source)

    # hub
    with _hub_offline_without_network(cfg.source):
        return _load_hub(cfg, arg)


def _load_hub(cfg: PrepareConfig, arg: str):
    import datasets

    if cfg.streaming:
        if cfg.max_documents is None:
            raise ValueError(
                f"streaming {cfg.source!r} needs data.max_documents (how many documents to take from the stream)"
            )
        stream = datasets.load_dataset(arg, cfg.hub_config, split=cfg.split, streaming=True)
        texts = _take_stream(stream, cfg.text_field, int(cfg.max_documents), cfg.source)
        ds = datasets.Dataset.from_dict({TEXT_COLUMN: texts})
        return _check_not_empty(ds, cfg.source)
    ds = datasets.load_dataset(arg, cfg.hub_config, split=cfg.split)
    ds = _text_column(ds, cfg.text_field, cfg.source)
    if cfg.max_documents is not None:
        ds = ds.select(range(min(int(cfg.max_documents), len(ds))))
    return _check_not_empty(ds, cfg.source)


HUB_PROBE_TIMEOUT_S = 3


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hugging Face hub endpoint answers a TCP connection (HF_ENDPOINT honoured)."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _hub_offline_without_network(source: str):
    """Without network, read the hub dataset from the local Hugging Face cache only: huggingface_hub would
    otherwise retry every request 5 times (about 35 s, each retry logged) before failing. A dataset absent
    from the cache then fails at once, with a message that says what to do."""
    import datasets
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or hub_reachable():
        yield
        return
    log.warning("no network to %s: reading %s from the local Hugging Face cache only", constants.ENDPOINT, source)
    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    except (ConnectionError, FileNotFoundError) as err:  # datasets raises these for an uncached dataset
        raise ConnectionError(
            f"data source {source!r} is not in the local Hugging Face cache and {constants.ENDPOINT} cannot be "
            f"reached: connect this machine once (or copy ~/.cache/huggingface from one that has it), or train "
            f"on data=stdlib / data=files"
        ) from err
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _missing_field(field: str, present, source: str) -> ValueError:
    return ValueError(
        f"text field {field!r} is not in {source!r}; its fields are {sorted(present)}: "
        f"set data.text_field to one of them"
    )


def _text_column(ds, field: str, source: str):
    """Keep only `field`, renamed to "text", checked to hold strings, without empty documents."""
    import datasets

    if field not in ds.column_names:
        raise _missing_field(field, ds.column_names, source)
    feature = ds.features[field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ValueError(f"text field {field!r} of {source!r} holds {feature}, not text: set data.text_field")
    ds = ds.select_columns([field])
    if field != TEXT_COLUMN:
        ds = ds.rename_column(field, TEXT_COLUMN)
    return _drop_empty(ds)


def _drop_empty(ds):
    # Empty documents would only add bare <|endoftext|> tokens; hub text sets (wikitext) have many.
    return ds.filter(lambda batch: [bool(t) for t in batch[TEXT_COLUMN]], batched=True, desc="drop empty documents")


def _take_stream(stream, field: str, limit: int, source: str) -> list[str]:
    from tqdm.auto import tqdm

    texts: list[str] = []
    with tqdm(total=limit, desc=f"stream {source}", unit="doc") as bar:
        for example in stream:
            if field not in example:
                raise _missing_field(field, example.keys(), source)
            text = example[field]
            if not isinstance(text, str):
                raise ValueError(f"text field {field!r} of {source!r} holds {type(text).__name__}, not text")
            if text:
                texts.append(text)
                bar.update(1)
                if len(texts) >= limit:
                    break
    return texts


def _check_not_empty(ds, source: str):
    if len(ds) == 0:
        raise ValueError(f"the corpus {source!r} is empty: it has no non-empty documents")
    return ds
