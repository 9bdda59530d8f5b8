"""Tests of the data package on small temporary corpora (CPU, no network).

A 40-document text corpus with a 400-token BPE is prepared once per module; each document carries a unique
marker so that shards can be decoded back into the set of documents they hold.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import data.prepare as prepare_mod
from data.prepare import prepare
from data import PrepareConfig, TokenDataModule
from data.cache import META_FILE, TOKENIZER_FILE, TRAIN_FILE, VAL_FILE, check_cache, locate, sha256_file
from data.sources import stdlib_files, stdlib_root
from data.tokenizer import EOT, load_tokenizer
from data.windows import TrainBatchSampler, train_window_start, val_rank_starts

REPO = Path(__file__).resolve().parents[1]
N_DOCS, VOCAB, SEQ_LEN, BATCH = 40, 400, 32, 4
WORDS = "alpha beta gamma delta tensor window token shard merge byte cache train value ratio".split()


def make_docs(n: int = N_DOCS, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(rng.randint(8, 20))]
        docs.append(f"# doc{i:03d}\n" + "\n".join(lines) + "\n")
    return docs


def write_txt_corpus(folder: Path, docs: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"doc{i:03d}.txt").write_text(doc)
    return folder


def decode_docs(path: Path, tokenizer) -> list[str]:
    """Split a shard at <|endoftext|> and decode each piece back into a document."""
    ids = np.memmap(path, dtype=np.uint16, mode="r").astype(np.int64)
    eot = tokenizer.token_to_id(EOT)
    assert ids[-1] == eot, "every document, the last included, must end with <|endoftext|>"
    cuts = np.flatnonzero(ids == eot)
    pieces = np.split(ids, cuts + 1)[:-1]
    return [tokenizer.decode(piece[:-1].tolist()) for piece in pieces]


def dm_for(cfg: PrepareConfig, **kwargs) -> TokenDataModule:
    args = dict(
        source=cfg.source, vocab_size=cfg.vocab_size, val_fraction=cfg.val_fraction, cache_dir=cfg.cache_dir,
        text_field=cfg.text_field, max_documents=cfg.max_documents, seq_len=SEQ_LEN, batch_size=BATCH,
        num_workers=0, seed=7, val_batches=3,
    )
    args.update(kwargs)
    return TokenDataModule(**args)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs()
    folder = write_txt_corpus(root / "txt", docs)
    cfg = PrepareConfig(source=f"files:{folder}", vocab_size=VOCAB, val_fraction=0.1, cache_dir=str(root / "cache"))
    path = prepare(cfg)
    return {"docs": docs, "cfg": cfg, "path": path, "root": root}


@pytest.fixture(scope="module")
def dm(corpus):
    module = dm_for(corpus["cfg"])
    module.prepare_data()
    module.setup("fit")
    return module


# ------------------------------------------------------------------------------ tokenizer and shards
def test_tokenizer_and_shards(corpus):
    path = corpus["path"]
    meta = json.loads((path / META_FILE).read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == VOCAB
    assert 257 < meta["tokenizer_vocab_size"] <= VOCAB
    for split, file in (("train", TRAIN_FILE), ("val", VAL_FILE)):
        assert (path / file).stat().st_size == 2 * meta["tokens"][split] > 0
    tokenizer = load_tokenizer(path / TOKENIZER_FILE)
    assert tokenizer.token_to_id(EOT) == meta["eot_id"]
    for doc in corpus["docs"][:5]:  # byte-level BPE is lossless
        assert tokenizer.decode(tokenizer.encode(doc).ids) == doc
    ids = np.memmap(path / TRAIN_FILE, dtype=np.uint16, mode="r")
    assert int(ids.max()) < meta["tokenizer_vocab_size"]
    # Found again on disk, not rebuilt.
    assert prepare(corpus["cfg"]) == path


def test_split_is_by_document_and_disjoint(corpus):
    tokenizer = load_tokenizer(corpus["path"] / TOKENIZER_FILE)
    train = decode_docs(corpus["path"] / TRAIN_FILE, tokenizer)
    val = decode_docs(corpus["path"] / VAL_FILE, tokenizer)
    assert len(val) == round(N_DOCS * 0.1) and len(train) == N_DOCS - len(val)
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(corpus["docs"])  # whole documents, none lost or cut


def test_batches_shape_shift_and_decode(dm, corpus):
    x, y = next(iter(dm.train_dataloader()))
    assert dm.state_dict()["train_batches_consumed"] == 1
    # A second loader of the same datamodule continues where the first stopped (it is the consumed count).
    x2, _ = next(iter(dm.train_dataloader()))
    assert not torch.equal(x, x2) and dm.state_dict()["train_batches_consumed"] == 2
    assert x.shape == y.shape == (BATCH, SEQ_LEN) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert dm.vocab_size == VOCAB and int(x.max()) < VOCAB
    # A window decodes to consecutive text of the train documents (each followed by <|endoftext|>).
    train_text = "".join(doc + EOT for doc in decode_docs(corpus["path"] / TRAIN_FILE, dm.tokenizer))
    window = torch.cat([x[0], y[0, -1:]]).tolist()
    assert dm.tokenizer.decode(window, skip_special_tokens=False) in train_text
    val = list(dm.val_dataloader())
    assert len(val) == 3 and all(b[0].shape == (BATCH, SEQ_LEN) for b in val)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(val, dm.val_dataloader()))  # fixed val set


# ------------------------------------------------------------------------------------- determinism
def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_train_windows_are_a_pure_function_of_seed_and_index(corpus):
    dm, other = dm_for(corpus["cfg"]), dm_for(corpus["cfg"])
    dm.setup("fit")
    other.setup("fit")
    a, b = take(dm.train_dataloader(), 3), take(other.train_dataloader(), 3)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    reseeded = dm_for(corpus["cfg"], seed=8)
    reseeded.setup("fit")
    assert not torch.equal(take(reseeded.train_dataloader(), 1)[0][0], a[0][0])
    # Batch j of step s on rank r of W holds global windows (s*W + r)*B + j.
    n_tokens = dm.meta["tokens"]["train"]
    ids = np.memmap(dm.cache_path / TRAIN_FILE, dtype=np.uint16, mode="r")
    for step in range(3):
        for j in range(BATCH):
            start = train_window_start(7, step * BATCH + j, n_tokens, SEQ_LEN)
            assert a[step][0][j].tolist() == ids[start : start + SEQ_LEN].tolist()


def test_ranks_read_different_windows():
    rank0, rank1 = TrainBatchSampler(BATCH, 10, 2, 0), TrainBatchSampler(BATCH, 10, 2, 1)
    single = TrainBatchSampler(BATCH, 20, 1, 0)
    r0, r1, s = list(rank0), list(rank1), list(single)
    assert not set(sum(r0, [])) & set(sum(r1, []))
    assert [r0[k] for k in range(10)] == s[0::2] and [r1[k] for k in range(10)] == s[1::2]
    v0 = val_rank_starts(10_000, SEQ_LEN, 3, BATCH, 2, 0)
    v1 = val_rank_starts(10_000, SEQ_LEN, 3, BATCH, 2, 1)
    assert len(v0) == len(v1) == 2 * BATCH and not set(v0) & set(v1)  # 3 batches rounded up to 4
    assert sorted(np.concatenate([v0, v1]).tolist()) == val_rank_starts(10_000, SEQ_LEN, 4, BATCH).tolist()


def test_datamodule_under_a_two_rank_trainer(corpus):
    from types import SimpleNamespace

    def fake_trainer(rank, distributed_sampler):
        connector = SimpleNamespace(use_distributed_sampler=distributed_sampler)
        return SimpleNamespace(world_size=2, global_rank=rank, global_step=0, accumulate_grad_batches=2,
                               max_steps=5, _accelerator_connector=connector)

    single = dm_for(corpus["cfg"])
    single.setup("fit")
    stream = take(single.train_dataloader(), 4)
    for rank in (0, 1):
        module = dm_for(corpus["cfg"])
        module.setup("fit")
        module.trainer = fake_trainer(rank, distributed_sampler=True)
        with pytest.raises(RuntimeError, match="use_distributed_sampler=False"):
            module.train_dataloader()
        module.trainer = fake_trainer(rank, distributed_sampler=False)
        loader = module.train_dataloader()
        assert len(loader) == 5 * 2  # max_steps x accumulate_grad_batches
        mine = take(loader, 2)
        # Rank r's step s is the single-process stream's step s*2 + r.
        assert all(torch.equal(mine[s][0], stream[s * 2 + rank][0]) for s in range(2))
        assert len(module.val_dataloader()) == 2  # 3 val batches rounded up to 4, 2 per rank


def test_resume_from_state_dict_sees_the_uninterrupted_batches(corpus):
    full = dm_for(corpus["cfg"], num_workers=2)
    full.setup("fit")
    uninterrupted = take(full.train_dataloader(), 6)

    first = dm_for(corpus["cfg"], num_workers=2)
    first.setup("fit")
    take(first.train_dataloader(), 4)
    state = first.state_dict()
    assert state["train_batches_consumed"] == 4

    resumed = dm_for(corpus["cfg"])
    resumed.setup("fit")
    resumed.load_state_dict(state)
    after = take(resumed.train_dataloader(), 2)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(after, uninterrupted[4:]))
    assert resumed.state_dict()["train_batches_consumed"] == 6


def test_resume_with_a_changed_batch_size_continues_at_the_same_window(corpus):
    """4 batches of 4 windows consumed, resumed with batch_size 8 (or 3): the next batch is windows 16..23 (or
    16..18) of the stream, i.e. the uninterrupted batch-4 run's batches 4 and 5 (or part of 4)."""
    first = dm_for(corpus["cfg"])
    first.setup("fit")
    uninterrupted = take(first.train_dataloader(), 8)
    state = {**first.state_dict(), "train_batches_consumed": 4}
    for batch_size in (8, 3):
        resumed = dm_for(corpus["cfg"], batch_size=batch_size)
        resumed.setup("fit")
        resumed.load_state_dict(state)
        (x, _), = take(resumed.train_dataloader(), 1)
        expected = torch.cat([b[0] for b in uninterrupted])[16 : 16 + batch_size]
        assert torch.equal(x, expected), batch_size
        assert resumed.state_dict()["window_offset"] == 16 - 4 * batch_size


@pytest.mark.filterwarnings(
    "ignore:You passed in a `val_dataloader`", "ignore:Be aware that when using `ckpt_path`", "ignore:.*LeafSpec"
)
def test_resume_through_lightning_checkpoint(corpus, tmp_path):
    """A run killed after step 2 and resumed with ckpt_path sees exactly the uninterrupted run's batches."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Embedding(VOCAB, 4)
            self.seen = []

        def training_step(self, batch, batch_idx):
            x, _ = batch
            self.seen.append(x[:, :4].clone())
            return self.head(x).float().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(max_steps, ckpt_path=None, callbacks=()):
        model = Recorder()
        trainer = L.Trainer(
            max_steps=max_steps, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            use_distributed_sampler=False, default_root_dir=tmp_path, callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
        )
        trainer.fit(model, datamodule=dm_for(corpus["cfg"]), ckpt_path=ckpt_path)
        return model.seen

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    uninterrupted = fit(4, callbacks=[saver])
    assert len(uninterrupted) == 8  # 4 optimizer steps x 2 accumulated batches
    ckpt = tmp_path / "ckpt" / "step=2.ckpt"
    assert torch.load(ckpt, weights_only=False)["TokenDataModule"]["train_batches_consumed"] == 4
    resumed = fit(4, ckpt_path=str(ckpt))
    assert len(resumed) == 4
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[4:]))


# ------------------------------------------------------------------------------------------ caching
def test_shards_do_not_depend_on_the_number_of_processes(tmp_path):
    folder = write_txt_corpus(tmp_path / "txt", make_docs(140, seed=6))
    cfg = PrepareConfig(source=f"files:{folder}", vocab_size=300, val_fraction=0.1)
    one = prepare(cfg.replace(cache_dir=str(tmp_path / "one"), tokenize_procs=1))
    two = prepare(cfg.replace(cache_dir=str(tmp_path / "two"), tokenize_procs=2))  # 126 train docs: 2 processes
    for file in (TRAIN_FILE, VAL_FILE, TOKENIZER_FILE):
        assert (one / file).read_bytes() == (two / file).read_bytes(), file


def test_stale_and_corrupt_caches_are_rebuilt(tmp_path):
    folder = write_txt_corpus(tmp_path / "txt", make_docs(12, seed=1))
    cfg = PrepareConfig(source=f"files:{folder}", vocab_size=300, val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    path = prepare(cfg)
    good = {f: (path / f).read_bytes() for f in (TRAIN_FILE, VAL_FILE, TOKENIZER_FILE)}
    damages = {
        "truncated shard": lambda: os.truncate(path / TRAIN_FILE, 10),
        "missing tokenizer": lambda: (path / TOKENIZER_FILE).unlink(),
        "unreadable meta": lambda: (path / META_FILE).write_text("{not json"),
        "missing meta": lambda: (path / META_FILE).unlink(),
    }
    for what, damage in damages.items():
        damage()
        assert check_cache(path, locate(cfg.resolved())[1])[0] is None, what
        stale = dm_for(cfg, seq_len=8)
        with pytest.raises(RuntimeError, match="prepare_data"):
            stale.setup("fit")
        assert prepare(cfg) == path, what
        assert {f: (path / f).read_bytes() for f in good} == good, what  # rebuilt deterministically
    # A changed config (vocab) or a changed corpus file is a different cache.
    assert prepare(cfg.replace(vocab_size=320)) != path
    (folder / "doc000.txt").write_text("changed\n" * 50)
    assert locate(cfg.resolved())[0] != path


def test_same_size_corruption_is_refused_by_training_and_replaced_by_verify(tmp_path, capsys):
    """A shard overwritten with 0xFF bytes at its own size passes the size check: training refuses its first
    window naming the file, and `--verify` (sha256) or `--force` really replace it with the good bytes."""
    folder = write_txt_corpus(tmp_path / "txt", make_docs(12, seed=1))
    cfg = PrepareConfig(source=f"files:{folder}", vocab_size=300, val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    path = prepare(cfg)
    good = (path / TRAIN_FILE).read_bytes()
    cli = [cfg.source, "--vocab-size", "300", "--val-fraction", "0.2", "--cache-dir", cfg.cache_dir]
    for repair in ("--verify", "--force"):
        (path / TRAIN_FILE).write_bytes(b"\xff" * len(good))
        module = dm_for(cfg, seq_len=8)
        module.prepare_data()  # sizes match: reused
        module.setup("fit")
        with pytest.raises(ValueError, match=rf"{TRAIN_FILE} holds token id 65535 .*not below the vocabulary"):
            next(iter(module.train_dataloader()))
        assert prepare_mod.main(cli + [repair]) == 0, repair
        assert (path / TRAIN_FILE).read_bytes() == good, repair
        assert check_cache(path, locate(cfg.resolved())[1], verify=True)[0] is not None
    # --verify checks the token ids on their own too (a shard whose recorded sha256 was rewritten with it).
    (path / TRAIN_FILE).write_bytes(b"\xff" * len(good))
    meta = json.loads((path / META_FILE).read_text())
    meta["files"][TRAIN_FILE]["sha256"] = sha256_file(path / TRAIN_FILE)
    (path / META_FILE).write_text(json.dumps(meta))
    assert "token id 65535" in check_cache(path, meta["key"], verify=True)[1]


def test_binary_files_are_skipped_with_a_count_and_a_mostly_binary_corpus_is_refused(tmp_path, caplog):
    docs = make_docs(12, seed=8)
    folder = write_txt_corpus(tmp_path / "txt", docs)
    rng = np.random.default_rng(0)
    for name in ("model.bin", "image.png"):
        (folder / name).write_bytes(b"\x89PNG\0" + rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())
    cfg = PrepareConfig(source=f"files:{folder}", vocab_size=300, val_fraction=0.2, cache_dir=str(tmp_path / "c"))
    with caplog.at_level("WARNING"):
        path = prepare(cfg)
    assert "skipped 2 of 14 files" in caplog.text
    tokenizer = load_tokenizer(path / TOKENIZER_FILE)
    assert sorted(decode_docs(path / TRAIN_FILE, tokenizer) + decode_docs(path / VAL_FILE, tokenizer)) == sorted(docs)
    for i in range(13):
        (folder / f"blob{i}.dat").write_bytes(bytes([0xC3, 0x28]) * 100)  # invalid UTF-8, no NUL
    with pytest.raises(ValueError, match=r"15 of the 27 files .* are not UTF-8 text"):
        prepare(cfg)


def test_killed_preparation_leaves_no_valid_cache(tmp_path, monkeypatch):
    folder = write_txt_corpus(tmp_path / "txt", make_docs(8, seed=2))
    cfg = PrepareConfig(source=f"files:{folder}", vocab_size=300, val_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    final = locate(cfg.resolved())[0]
    real_write = prepare_mod.write_shard

    def dies_midway(tokenized, path, name):
        real_write(tokenized, path, name)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(prepare_mod, "write_shard", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    assert not final.exists() and list(final.parent.iterdir()) == []
    # A build directory left by a process that died (a pid no longer alive) is cleaned up too.
    leftover = final.parent / f".tmp-{final.name}-4194000-deadbeef"
    leftover.mkdir()
    (leftover / TRAIN_FILE).write_bytes(b"\0" * 10)
    monkeypatch.setattr(prepare_mod, "write_shard", real_write)
    assert prepare(cfg) == final and not leftover.exists()


# --------------------------------------------------------------------------------------- bad input
def test_clear_errors(tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare(PrepareConfig(source=f"files:{tmp_path / 'nope.txt'}", vocab_size=300, cache_dir=cache))
    with pytest.raises(FileNotFoundError, match="no file matches"):
        prepare(PrepareConfig(source=f"files:{tmp_path / 'nope' / '*.txt'}", vocab_size=300, cache_dir=cache))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        prepare(PrepareConfig(source=f"files:{tmp_path / 'empty'}", vocab_size=300, cache_dir=cache))
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    with pytest.raises(ValueError, match="empty"):
        prepare(PrepareConfig(source=f"files:{tmp_path / 'blank.jsonl'}", vocab_size=300, cache_dir=cache))
    (tmp_path / "fields.jsonl").write_text('{"content": "a b", "id": 1}\n{"content": "c d", "id": 2}\n')
    with pytest.raises(ValueError, match=r"'text'.*\['content', 'id'\]"):
        prepare(PrepareConfig(source=f"files:{tmp_path / 'fields.jsonl'}", vocab_size=300, cache_dir=cache))
    (tmp_path / "one.txt").write_text("a single document\n")
    with pytest.raises(ValueError, match="at least 2"):
        prepare(PrepareConfig(source=f"files:{tmp_path / 'one.txt'}", vocab_size=300, cache_dir=cache))
    with pytest.raises(ValueError, match="not understood"):
        PrepareConfig(source="wikitext").resolved()
    with pytest.raises(ValueError, match="vocab_size"):
        PrepareConfig(vocab_size=70_000)
    with pytest.raises(ValueError, match="max_documents"):
        prepare(PrepareConfig(source="hub:anything", streaming=True, cache_dir=cache))


def test_too_short_corpus_says_how_many_tokens(tmp_path):
    folder = write_txt_corpus(tmp_path / "txt", ["tiny one\n", "tiny two\n", "tiny three\n"])
    cfg = PrepareConfig(source=f"files:{folder}", vocab_size=300, val_fraction=0.3, cache_dir=str(tmp_path / "c"))
    module = dm_for(cfg, seq_len=512)
    module.prepare_data()
    with pytest.raises(ValueError, match=r"train split has \d+ tokens.*seq_len \+ 1 = 513.*lower seq_len"):
        module.setup("fit")


# ------------------------------------------------------------------------------------ other sources
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_jsonl_and_parquet_sources(tmp_path, fmt):
    docs = make_docs(20, seed=3)
    rows = [{"id": i, "body": d} for i, d in enumerate(docs)]
    file = tmp_path / f"corpus.{fmt}"
    if fmt == "jsonl":
        file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), file)
    cfg = PrepareConfig(source=f"files:{file}", text_field="body", vocab_size=300, val_fraction=0.1,
                        cache_dir=str(tmp_path / "cache"))
    path = prepare(cfg)
    tokenizer = load_tokenizer(path / TOKENIZER_FILE)
    got = decode_docs(path / TRAIN_FILE, tokenizer) + decode_docs(path / VAL_FILE, tokenizer)
    assert sorted(got) == sorted(docs)


def test_hub_source_streaming_takes_first_documents(tmp_path):
    # load_dataset(<local directory>) goes through the same hub code path without a network.
    hub = tmp_path / "hubdata"
    hub.mkdir()
    docs = make_docs(30, seed=4)
    (hub / "train.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in docs))
    cfg = PrepareConfig(source=f"hub:{hub}", streaming=True, max_documents=10, text_field="content",
                        vocab_size=300, val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    path = prepare(cfg)
    meta = json.loads((path / META_FILE).read_text())
    assert meta["documents"] == {"train": 8, "val": 2} and meta["source"]["kind"] == "hub"
    tokenizer = load_tokenizer(path / TOKENIZER_FILE)
    got = decode_docs(path / TRAIN_FILE, tokenizer) + decode_docs(path / VAL_FILE, tokenizer)
    assert sorted(got) == sorted(docs[:10])
    with pytest.raises(ValueError, match=r"'text'.*\['content'\]"):
        prepare(cfg.replace(text_field="text", cache_dir=str(tmp_path / "other")))


def test_stdlib_source_listing_and_small_prepare(tmp_path):
    root = stdlib_root()
    files = stdlib_files()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert len(files) > 300 and "os.py" in rel and "json/__init__.py" in rel
    assert rel == sorted(rel)
    assert not any(part in ("site-packages", "dist-packages") for p in rel for part in p.split("/"))
    cfg = PrepareConfig(source="stdlib", max_documents=30, vocab_size=320, cache_dir=str(tmp_path / "cache"))
    path = prepare(cfg)
    meta = json.loads((path / META_FILE).read_text())
    assert meta["source"]["files"] == len(files) and sum(meta["documents"].values()) <= 30
    assert meta["tokens"]["train"] > 10_000


# ------------------------------------------------------------------------------------ config and CLI
def _data_conf(name: str):
    """conf/data/<name>.yaml composed the way train.py sees it (its defaults list included)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf" / "data"), version_base="1.3"):
        return compose(config_name=name)


def test_conf_files_instantiate_and_default_matches_cli():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    top = OmegaConf.create({"seq_len": 64, "seed": 3})
    for name in ("stdlib", "hub", "files"):
        cfg = OmegaConf.merge(top, {"data": _data_conf(name)})
        module = instantiate(cfg.data)
        assert isinstance(module, TokenDataModule) and module.seq_len == 64 and module.seed == 3
    assert _data_conf("hub").val_fraction == 0.005 and _data_conf("files").val_fraction == 0.05
    # `make data` (python -m data.prepare, PrepareConfig defaults) must prepare the cache training uses.
    stdlib = _data_conf("stdlib")
    defaults = PrepareConfig()
    for field in ("source", "vocab_size", "val_fraction", "split_seed", "max_documents", "cache_dir"):
        assert stdlib[field] == getattr(defaults, field), field


def test_cli(tmp_path, capsys):
    folder = write_txt_corpus(tmp_path / "txt", make_docs(10, seed=5))
    args = [f"files:{folder}", "--vocab-size", "300", "--val-fraction", "0.2", "--cache-dir", str(tmp_path / "c")]
    assert prepare_mod.main(args) == 0
    assert "tokens train/val" in capsys.readouterr().out
    assert prepare_mod.main(args + ["--verify"]) == 0
    assert prepare_mod.main([f"files:{tmp_path / 'missing'}", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "does not exist" in capsys.readouterr().err
