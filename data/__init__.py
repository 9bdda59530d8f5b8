"""Data pipeline: corpus -> byte-level BPE (tokenizers) -> uint16 token shards (np.memmap) -> LightningDataModule.

Files, one job each:
  config.py      PrepareConfig: what defines a cache (source, vocab size, split) and its validation
  sources.py     stdlib / hub / local-file corpora -> datasets.Dataset of documents
  tokenizer.py   byte-level BPE training and loading, <|endoftext|>
  shards.py      datasets.map tokenization -> one flat uint16 file per split
  cache.py       cache key, validation against meta.json, atomic publication
  prepare.py     prepare(cfg) orchestration and the `python -m data.prepare` CLI
  windows.py     train/val windows and the per-rank, resumable batch order
  datamodule.py  TokenDataModule (Lightning); needs Trainer(use_distributed_sampler=False)
"""

from data.config import PrepareConfig

# `prepare()` lives in data.prepare and is not re-exported: the name would shadow that module (the CLI).
__all__ = ["PrepareConfig", "TokenDataModule"]


def __getattr__(name: str):
    # Lazy (PEP 562): `python -m data.prepare` must not pay for importing torch and Lightning.
    # hydra's `_target_: data.TokenDataModule` resolves through getattr, so it still works.
    if name == "TokenDataModule":
        from data.datamodule import TokenDataModule

        return TokenDataModule
    raise AttributeError(f"module 'data' has no attribute {name!r}")
