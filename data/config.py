"""What to prepare: the corpus, tokenizer and split settings that define one data cache.

`PrepareConfig` holds every knob that changes the prepared bytes (tokenizer, shards) plus where the cache
lives. Its defaults are the canonical defaults of the project: `python -m data.prepare` (so `make data`)
and conf/data/stdlib.yaml must agree with them, otherwise `make data` and `make train` would prepare two
different caches (tests/test_data.py checks the yaml against these values).

Knobs that only change how windows are drawn (seq_len, seed, batch size) are deliberately NOT here: they
must not invalidate a cache that took minutes to build.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Byte-level BPE starts from the 256 byte symbols plus <|endoftext|>; fewer ids cannot encode every text.
MIN_VOCAB_SIZE = 257
# Shards store token ids as uint16, so the largest id, vocab_size - 1, must be <= 65535.
MAX_VOCAB_SIZE = 1 << 16
TEXT_SAMPLE_BY = ("document", "line", "paragraph")


@dataclass(frozen=True)
class PrepareConfig:
    """Settings that identify one prepared cache (see data/cache.py for the key).

    source: "stdlib" | "hub:<dataset name>" | "files:<path, directory or glob>[,<more>...]"
    hub_config / split: second argument and split of `load_dataset` for hub sources.
    text_field: column holding the document text (hub, .jsonl/.json, .parquet); .txt and stdlib have "text".
    streaming: hub only; stream and keep the first `max_documents` documents (required then).
    max_documents: keep only the first N documents of the source (None: all).
    text_sample_by: how .txt files become documents: "document" (one per file, the default: code and
        books keep their structure), "line" or "paragraph" (for one big file of many short texts).
    vocab_size: BPE vocabulary size including <|endoftext|>; 50257 is GPT-2's.
    val_fraction: fraction of DOCUMENTS held out for validation (at least one document).
    split_seed: seed of the document permutation that picks the val documents. Separate from the training
        seed so that changing the training seed does not rebuild the cache.
    cache_dir: root of the caches; relative paths are resolved by `resolved()`.
    tokenize_procs: processes for `datasets.map` (None: min(4, cpu count)); not part of the cache key.
    """

    source: str = "stdlib"
    hub_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False
    max_documents: int | None = None
    text_sample_by: str = "document"
    vocab_size: int = 50257
    val_fraction: float = 0.05
    split_seed: int = 0
    cache_dir: str = ".cache/data"
    tokenize_procs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"data source must be a non-empty string, got {self.source!r}")
        if not MIN_VOCAB_SIZE <= int(self.vocab_size) <= MAX_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size={self.vocab_size} is out of range: byte-level BPE needs at least "
                f"{MIN_VOCAB_SIZE} (256 bytes + <|endoftext|>) and the uint16 shards hold at most "
                f"{MAX_VOCAB_SIZE} ids; set data.vocab_size in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]"
            )
        if not 0.0 < float(self.val_fraction) < 1.0:
            raise ValueError(
                f"val_fraction={self.val_fraction} must be in (0, 1): it is the share of documents held out"
            )
        if self.max_documents is not None and int(self.max_documents) < 2:
            raise ValueError(
                f"max_documents={self.max_documents} must be >= 2 (or null for all): the train/val split is by document"
            )
        if self.text_sample_by not in TEXT_SAMPLE_BY:
            raise ValueError(f"text_sample_by={self.text_sample_by!r}; expected one of {TEXT_SAMPLE_BY}")
        if self.tokenize_procs is not None and int(self.tokenize_procs) < 1:
            raise ValueError(f"tokenize_procs={self.tokenize_procs} must be >= 1 (or null for min(4, cpu count))")
        if int(self.split_seed) < 0:
            raise ValueError(f"split_seed={self.split_seed} must be >= 0")

    def replace(self, **changes) -> "PrepareConfig":
        return dataclasses.replace(self, **changes)

    def resolved(self) -> "PrepareConfig":
        """Copy with cache_dir and local file patterns made absolute.

        Relative paths mean "relative to where the user launched the command": Hydra's original working
        directory when Hydra runs (it may chdir into outputs/), else the current directory. Resolving once,
        early, makes the datamodule behave the same with or without Hydra.
        """
        changes = {"cache_dir": absolute_path(self.cache_dir)}
        kind, arg = parse_source(self.source)
        if kind == "files":
            patterns = [absolute_path(p) for p in split_patterns(arg)]
            changes["source"] = "files:" + ",".join(patterns)
        return self.replace(**changes)

    def key_fields(self) -> dict:
        """The fields that change the prepared bytes (everything except where and how fast)."""
        fields = dataclasses.asdict(self)
        for not_identity in ("cache_dir", "tokenize_procs"):
            fields.pop(not_identity)
        return fields


SOURCE_FORMS = (
    "'stdlib', 'hub:<dataset name>' (e.g. hub:Salesforce/wikitext with hub_config=wikitext-103-raw-v1) "
    "or 'files:<path, directory or glob>[,<more>]'"
)


def parse_source(source: str) -> tuple[str, str]:
    """'stdlib' -> ('stdlib', ''); 'hub:wikitext' -> ('hub', 'wikitext'); 'files:a/*.txt' -> ('files', 'a/*.txt')."""
    source = str(source).strip()
    if source == "stdlib":
        return "stdlib", ""
    for prefix, kind in (("hub:", "hub"), ("hf:", "hub"), ("files:", "files")):
        if source.startswith(prefix):
            arg = source[len(prefix):].strip()
            if not arg:
                raise ValueError(f"data source {source!r} names no {kind} target; use {SOURCE_FORMS}")
            return kind, arg
    raise ValueError(f"data source {source!r} is not understood; use {SOURCE_FORMS}")


def split_patterns(arg: str) -> list[str]:
    """'a/*.txt, b.jsonl' -> ['a/*.txt', 'b.jsonl'] (commas separate several paths or globs)."""
    return [p.strip() for p in arg.split(",") if p.strip()]


def absolute_path(path: str) -> str:
    """Make `path` absolute against the launch directory (see PrepareConfig.resolved)."""
    import os

    path = os.path.expanduser(str(path))
    if os.path.isabs(path):
        return os.path.normpath(path)
    try:
        from hydra.utils import to_absolute_path

        return os.path.normpath(to_absolute_path(path))
    except ImportError:  # hydra is a project dependency, but the data package does not need it
        return os.path.abspath(path)
