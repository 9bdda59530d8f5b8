"""`TokenDataModule`: the LightningDataModule that serves (x, y) next-token batches from the prepared shards.

    dm = TokenDataModule(source="stdlib", seq_len=256, batch_size=8)   # or hydra: conf/data/*.yaml
    dm.prepare_data(); dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))                            # int64 (B, seq_len) each
    # document_mask=True: (x, y, cu_seqlens), the batch's documents packed (data/windows.py)

REQUIRED with Lightning: build the Trainer with `use_distributed_sampler=False`. The train and val
dataloaders already hand each rank its own share (data/windows.py); Lightning's DistributedSampler would
replace that order and break both the per-rank split and resume. train_dataloader() raises if it sees a
multi-process trainer without that flag.

Resume (the exact-order guarantee): the only state is the number of train batches this rank has consumed,
N. Train batch i of a rank is a pure function of (seed, world size, rank, batch size, i), so a loader that
starts at i = N reproduces the uninterrupted run from there on.
  * Under a Trainer, N is measured, not counted: state_dict() returns
        N = N0 + (trainer.global_step - step0) * trainer.accumulate_grad_batches
    where (N0, step0) are the batch and optimizer-step counts when the current train loader was built.
    Lightning writes that into every checkpoint and, on `fit(ckpt_path=...)`, calls load_state_dict()
    before train_dataloader(), so the new loader starts at N. Counting batches as the loader yields them
    would overcount whenever Lightning fetches ahead (it does for loaders without a length and for
    `dataloader_iter` training steps); global_step is exact at optimizer-step boundaries, which is where
    Lightning's checkpoints are taken (a checkpoint taken mid-accumulation, e.g. validation at an interval
    that is not a multiple of accumulate_grad_batches, resumes at the last step boundary).
  * Without a Trainer (plain loops, tests), nothing prefetches on the consumer side, so N counts the
    batches the train loader has yielded; state_dict()/load_state_dict() carry it the same way.
  * A checkpoint without datamodule state but with global_step > 0 starts at global_step * accumulation.
The epoch length is trainer.max_steps * accumulate_grad_batches (a very large number without max_steps).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from data.cache import TOKENIZER_FILE, TRAIN_FILE, VAL_FILE, check_cache, locate
from data.config import PrepareConfig
from data.prepare import prepare
from data.windows import (TrainBatchSampler, TrainWindows, ValWindows, check_enough_tokens, collate_documents,
                          val_rank_starts)

log = logging.getLogger(__name__)

# Epoch length when the trainer has no max_steps: effectively endless; max_epochs/time limits stop it.
UNBOUNDED_TRAIN_BATCHES = 10**12


class _CountingDataLoader(DataLoader):
    """DataLoader that reports each batch when it is handed to the consumer (main process, after the
    workers' prefetching), which is what "consumed" means for a plain training loop."""

    on_batch = None

    def __iter__(self):
        for batch in super().__iter__():
            if self.on_batch is not None:
                self.on_batch()
            yield batch

    # Having state_dict/load_state_dict marks the loader as resumable to Lightning, which is true: it is
    # built after the datamodule's own state (the consumed-batch count) has been restored and starts there.
    # Without them Lightning warns, wrongly here, that a mid-epoch resume replays the epoch's data.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class TokenDataModule(L.LightningDataModule):
    """Next-token batches (x, y), int64 (batch_size, seq_len), y = x shifted by one token.

    Corpus / cache (see data/config.py PrepareConfig for details): source, hub_config, split, text_field,
    streaming, max_documents, text_sample_by, vocab_size, val_fraction, split_seed, cache_dir,
    tokenize_procs. Windows: seq_len, batch_size, seed (train window order), val_batches (fixed val
    batches per evaluation, in total over all ranks). Loading: num_workers, pin_memory (None: if CUDA).
    Documents: document_mask (batches also carry where each window's documents start, packed as cu_seqlens,
    for document-masked attention; data/windows.py).
    """

    def __init__(
        self,
        source: str = "stdlib",
        seq_len: int = 1024,
        batch_size: int = 8,
        num_workers: int = 2,
        vocab_size: int = 50257,
        val_fraction: float = 0.05,
        seed: int = 1337,
        cache_dir: str = ".cache/data",
        val_batches: int = 16,
        text_field: str = "text",
        streaming: bool = False,
        max_documents: int | None = None,
        hub_config: str | None = None,
        split: str = "train",
        text_sample_by: str = "document",
        split_seed: int = 0,
        tokenize_procs: int | None = None,
        pin_memory: bool | None = None,
        document_mask: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        checks = [("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("val_batches", val_batches, 1),
                  ("num_workers", num_workers, 0), ("seed", seed, 0)]
        for name, value, low in checks:
            if int(value) < low:
                raise ValueError(f"data.{name}={value} must be >= {low}")
        # Resolve relative paths now, while Hydra's original working directory is known.
        self.prepare_config = PrepareConfig(
            source=source, hub_config=hub_config, split=split, text_field=text_field, streaming=streaming,
            max_documents=max_documents, text_sample_by=text_sample_by, vocab_size=vocab_size,
            val_fraction=val_fraction, split_seed=split_seed, cache_dir=cache_dir, tokenize_procs=tokenize_procs,
        ).resolved()
        self.vocab_size = int(vocab_size)  # the model's embedding size; the tokenizer never emits more ids
        self.seq_len, self.batch_size, self.seed = int(seq_len), int(batch_size), int(seed)
        self.val_batches, self.num_workers = int(val_batches), int(num_workers)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.document_mask = bool(document_mask)
        self.cache_path: Path | None = None
        self.meta: dict | None = None
        self._consumed = 0  # train batches consumed by this rank (see module docstring)
        self._window_offset = 0  # set by a resume that changed batch_size or world size (data/windows.py)
        self._state_loaded = False
        self._fit_base: tuple | None = None  # (trainer, batches, global_step) when the loader was built
        self._tokenizer = None

    # ------------------------------------------------------------------------------------- preparation
    def prepare_data(self) -> None:
        """Build the cache if missing, stale or corrupt (Lightning calls this on local rank 0 only)."""
        self.cache_path = prepare(self.prepare_config)

    def setup(self, stage: str | None = None) -> None:
        path, key, _ = locate(self.prepare_config)
        meta, why = check_cache(path, key)
        if meta is None:
            raise RuntimeError(
                f"no valid data cache at {path} ({why}): call prepare_data() before setup(), or run "
                f"`python -m data.prepare {self.prepare_config.source} --vocab-size {self.vocab_size}` first"
            )
        self.cache_path, self.meta = path, meta
        check_enough_tokens(meta["tokens"]["train"], self.seq_len, "train")
        check_enough_tokens(meta["tokens"]["val"], self.seq_len, "val")
        if meta["tokenizer_vocab_size"] > self.vocab_size:
            raise ValueError(
                f"{path} has a {meta['tokenizer_vocab_size']}-token tokenizer, more than vocab_size={self.vocab_size}"
            )
        if self.document_mask and meta.get("eot_id") is None:
            raise ValueError(
                f"data.document_mask=true needs the <|endoftext|> id in {path}/meta.json, which this cache lacks: "
                f"delete {path} and prepare again"
            )

    def _eot_id(self) -> int | None:
        """The document separator's id when batches carry documents, else None (plain (x, y) batches)."""
        return int(self.meta["eot_id"]) if self.document_mask else None

    def _require_setup(self) -> dict:
        if self.meta is None:
            raise RuntimeError("TokenDataModule: call prepare_data() and setup() before asking for dataloaders")
        return self.meta

    @property
    def tokenizer(self):
        """The trained `tokenizers.Tokenizer` (for decoding samples)."""
        if self._tokenizer is None:
            from data.tokenizer import load_tokenizer

            self._require_setup()
            self._tokenizer = load_tokenizer(self.cache_path / TOKENIZER_FILE)
        return self._tokenizer

    # ---------------------------------------------------------------------------------- distribution
    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is not None:
            return int(trainer.world_size), int(trainer.global_rank)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def _check_no_distributed_sampler(self, world_size: int) -> None:
        connector = getattr(self.trainer, "_accelerator_connector", None)
        if world_size > 1 and getattr(connector, "use_distributed_sampler", False):
            raise RuntimeError(
                "TokenDataModule splits data across ranks itself: build the Trainer with "
                "use_distributed_sampler=False (otherwise Lightning's DistributedSampler reorders the windows "
                "and breaks resume)"
            )

    # ----------------------------------------------------------------------------------- dataloaders
    def _loader(self, dataset, loader_class=DataLoader, **kwargs) -> DataLoader:
        workers = self.num_workers
        return loader_class(
            dataset,
            num_workers=workers,
            pin_memory=self.pin_memory,
            persistent_workers=workers > 0,
            collate_fn=collate_documents if self.document_mask else None,
            **kwargs,
        )

    def _train_start(self) -> int:
        """Where a new train loader starts (see the module docstring)."""
        trainer = self.trainer
        if trainer is None:
            return self._consumed  # plain loop: batches yielded so far, or the loaded state
        if self._fit_base is not None and self._fit_base[0] is trainer:
            return self.train_batches_consumed()  # loader rebuilt during the same fit
        if self._state_loaded:
            return self._consumed  # restored from the checkpoint by Lightning
        # A fresh run (0), or a checkpoint that carried no datamodule state: the best available estimate.
        return int(trainer.global_step) * int(trainer.accumulate_grad_batches)

    def _train_num_steps(self) -> int:
        trainer = self.trainer
        if trainer is not None and trainer.max_steps is not None and trainer.max_steps > 0:
            return int(trainer.max_steps) * int(trainer.accumulate_grad_batches)
        return UNBOUNDED_TRAIN_BATCHES

    def train_dataloader(self) -> DataLoader:
        meta = self._require_setup()
        world_size, rank = self._world()
        self._check_no_distributed_sampler(world_size)
        start = self._train_start()
        self._consumed = start
        trainer = self.trainer
        self._fit_base = (trainer, start, int(trainer.global_step)) if trainer is not None else None
        dataset = TrainWindows(self.cache_path / TRAIN_FILE, meta["tokens"]["train"], self.seq_len, self.seed,
                               vocab_size=meta["tokenizer_vocab_size"], eot_id=self._eot_id())
        sampler = TrainBatchSampler(self.batch_size, self._train_num_steps(), world_size, rank, start_step=start,
                                    window_offset=self._window_offset)
        if start:
            log.info("train data resumes at batch %d (rank %d of %d)", start, rank, world_size)
        loader = self._loader(dataset, _CountingDataLoader, batch_sampler=sampler)
        loader.on_batch = self._count_batch
        return loader

    def _count_batch(self) -> None:
        self._consumed += 1

    def val_dataloader(self) -> DataLoader:
        meta = self._require_setup()
        world_size, rank = self._world()
        self._check_no_distributed_sampler(world_size)
        n_tokens = meta["tokens"]["val"]
        starts = val_rank_starts(n_tokens, self.seq_len, self.val_batches, self.batch_size, world_size, rank)
        dataset = ValWindows(self.cache_path / VAL_FILE, n_tokens, self.seq_len, starts,
                             vocab_size=meta["tokenizer_vocab_size"], eot_id=self._eot_id())
        return self._loader(dataset, batch_size=self.batch_size, shuffle=False, drop_last=False)

    # ------------------------------------------------------------------------------------ resume state
    def train_batches_consumed(self) -> int:
        """Train batches this rank has consumed so far (what a resumed run skips)."""
        trainer = self.trainer
        if trainer is not None and self._fit_base is not None and self._fit_base[0] is trainer:
            _, base, base_step = self._fit_base
            return base + (int(trainer.global_step) - base_step) * int(trainer.accumulate_grad_batches)
        return self._consumed

    def state_dict(self) -> dict:
        world_size, rank = self._world()
        return {
            "train_batches_consumed": self.train_batches_consumed(),
            "window_offset": self._window_offset,
            # Recorded so that a resume with a different data order can be flagged, not silently accepted.
            "seed": self.seed,
            "batch_size": self.batch_size,
            "world_size": world_size,
            "seq_len": self.seq_len,
            "cache_key": self.meta["key"] if self.meta else None,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the data position. A changed data.batch_size or world size is applied: the stream of windows
        continues at the window where it stopped (Lightning's batch counter, N, is kept, and the window
        offset absorbs the change: N × B × W windows were read before, N × B' × W' are counted now)."""
        consumed = int(state_dict["train_batches_consumed"])
        world_size, _ = self._world()
        batch_before = int(state_dict.get("batch_size", self.batch_size))
        world_before = int(state_dict.get("world_size", world_size))
        windows = int(state_dict.get("window_offset", 0)) + consumed * batch_before * world_before
        self._window_offset = windows - consumed * self.batch_size * world_size
        if (batch_before, world_before) != (self.batch_size, world_size):
            log.info("data.batch_size %d -> %d, world size %d -> %d: the train stream continues at window %d",
                     batch_before, self.batch_size, world_before, world_size, windows)
        self._consumed = consumed
        self._state_loaded = True
        now = {"seed": self.seed, "seq_len": self.seq_len, "cache_key": self.meta["key"] if self.meta else None}
        changed = {k: (state_dict.get(k), v) for k, v in now.items() if state_dict.get(k) not in (None, v)}
        if changed:
            warnings.warn(
                f"resuming data with changed settings {changed} (checkpoint, now): batches after the resume "
                f"point differ from the uninterrupted run's",
                stacklevel=2,
            )

    # --------------------------------------------------------------------------------------- helpers
    def describe(self) -> str:
        meta = self._require_setup()
        return (
            f"{self.prepare_config.source}: {meta['tokens']['train']:,} train / {meta['tokens']['val']:,} val "
            f"tokens, vocab {self.vocab_size}, cache {self.cache_path}"
        )
