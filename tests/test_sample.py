"""sample.py on CPU (and on a GPU where there is one): a tiny model trained on a short repeated text continues it;
checkpoints load from a file and from a directory of shards; bad input gets a named error. Also val/ppl beside
val/loss."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import train as train_mod
from model.checkpoint import CheckpointModelMismatch, check_model_matches, load_weights, model_differences, read_metadata
from model.gpt import GPT, ContextLengthError, GPTConfig
from sample import sample

REPO = Path(__file__).resolve().parents[1]
TEXT = "the quick brown fox jumps over the lazy dog. "
LLAMA_TINY = ("model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.pos_emb=rope",
              "model.norm=rmsnorm", "model.mlp=swiglu", "model.bias=false")


def _compose(config_name, *overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint, metrics) of a Llama-style tiny model trained on four documents of TEXT repeated."""
    root = tmp_path_factory.mktemp("sample")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(4):  # documents: at least one is held out for validation
        (corpus / f"doc{i}.txt").write_text(TEXT * 100)
    cfg = _compose("train", "experiment=cpu_tiny", "data=files", f"data.source=files:{corpus}", "data.vocab_size=300",
                   f"data.cache_dir={root / 'cache'}", "data.num_workers=0", "data.batch_size=8", "data.val_batches=1",
                   "seq_len=32", *LLAMA_TINY, "trainer.max_steps=60", "trainer.val_check_interval=60",
                   "trainer.enable_model_summary=false", "~callbacks.progress_bar", "logger=none",
                   f"output_dir={root / 'run'}")
    metrics = train_mod.train(cfg)
    return root / "run" / "checkpoints" / "last.ckpt", metrics


def _shards(ckpt, tmp_path):
    """ckpt rewritten as a directory of shards in the layout of Lightning's FSDPStrategy (state_dict_type=sharded):
    torch.distributed.checkpoint files of {"model": state_dict, "optimizer_0": ...} plus meta.pt with the rest."""
    from torch.distributed.checkpoint import save

    full = torch.load(ckpt, map_location="cpu", weights_only=False)
    sharded = tmp_path / "last.ckpt"
    save({"model": full.pop("state_dict"), "optimizer_0": full.pop("optimizer_states")[0]},
         checkpoint_id=sharded, no_dist=True)
    torch.save(full, sharded / "meta.pt")
    return sharded


def _sample(ckpt, *overrides):
    return sample(_compose("sample", f"ckpt_path={ckpt}", *overrides))


def test_validation_reports_perplexity(trained):
    _, metrics = trained
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-5)
    assert metrics["val/ppl"] < 2.0  # the text is learned


def test_sampling_continues_the_repeated_text(trained):
    ckpt, _ = trained
    (text,) = _sample(ckpt, "prompt=the quick brown", "max_new_tokens=20", "temperature=0")
    assert text.startswith("the quick brown fox jumps over the lazy dog. the quick brown fox"), text
    texts = _sample(ckpt, "prompt=the lazy", "max_new_tokens=12", "num_samples=3", "top_k=5", "temperature=0.5")
    assert len(texts) == 3 and all(t.startswith("the lazy dog. the quick") for t in texts), texts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="sampling on a GPU: needs CUDA")
@pytest.mark.parametrize("attention", ["sdpa", None])  # None: our kernel where it is built for this head dim
def test_on_a_gpu_sampling_continues_the_repeated_text_from_a_file_and_from_shards(trained, tmp_path, attention):
    """The model made on the GPU, the weights loaded there (a file; FSDP's shards), bf16: the greedy continuation is
    the text's, and the shards give the file's tokens."""
    ckpt, _ = trained
    sharded = _shards(ckpt, tmp_path)
    args = ("device=cuda", "prompt=the quick brown", "max_new_tokens=20", "temperature=0")
    args += (f"attention={attention}",) if attention else ()
    (text,) = _sample(ckpt, *args)
    assert text.startswith("the quick brown fox jumps over the lazy dog. the quick brown fox"), text
    assert _sample(sharded, *args) == [text]


def test_attention_is_chosen_as_train_py_chooses_it(trained):
    """attention=<name> is the config group train.py takes (conf/attention/); without it, sdpa on the CPU."""
    ckpt, _ = trained
    args = ("device=cpu", "prompt=the quick brown", "max_new_tokens=20", "temperature=0")
    assert _compose("sample", "ckpt_path=x", "attention=naive").attention.name == "naive"
    assert "attention" not in _compose("sample", "ckpt_path=x")
    (text,) = _sample(ckpt, *args, "attention=naive")
    assert _sample(ckpt, *args) == [text]
    assert text.startswith("the quick brown fox jumps over the lazy dog. the quick brown fox"), text


def test_sample_command_line(trained):
    """As `make sample` runs it: no max_new_tokens, so as many tokens as the 32-token context has room for."""
    ckpt, _ = trained
    proc = subprocess.run([sys.executable, "sample.py", f"ckpt_path={ckpt}", "prompt=the quick", "temperature=0"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("the quick brown fox jumps over")
    assert not (REPO / "sample.log").exists()


def test_sharded_checkpoint_samples_like_the_file(trained, tmp_path):
    """FSDP's directory of shards (_shards) samples the file's tokens and loads the file's weights."""
    ckpt, _ = trained
    sharded = _shards(ckpt, tmp_path)
    args = ("prompt=the quick", "max_new_tokens=10", "temperature=0")
    assert _sample(sharded, *args) == _sample(ckpt, *args)
    meta = read_metadata(sharded)
    a, b = GPT(GPTConfig(**meta["hyper_parameters"]["model"])), GPT(GPTConfig(**meta["hyper_parameters"]["model"]))
    load_weights(a, sharded, meta)
    load_weights(b, ckpt)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_prompt_longer_than_the_context_is_refused(trained):
    ckpt, _ = trained
    with pytest.raises(ContextLengthError, match=r"the prompt has \d+ tokens, more than the model's context of seq_len=32"):
        _sample(ckpt, f"prompt={TEXT * 8}")
    with pytest.raises(ContextLengthError, match="set max_new_tokens <= "):
        _sample(ckpt, "prompt=the quick", "max_new_tokens=40")


def test_checkpoint_of_another_model_is_refused(trained):
    ckpt, _ = trained
    with pytest.raises(CheckpointModelMismatch, match=r"model.n_layer: 2 in the checkpoint, 4 in the config.*model.pos_emb"):
        _sample(ckpt, "model=gpt-tiny")
    _sample(ckpt, "model=gpt-tiny", *LLAMA_TINY, "max_new_tokens=1")  # the same model spelled by keys: accepted
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _sample(ckpt.parent / "nope.ckpt")


def test_model_differences_ignore_runtime_keys_and_fill_defaults():
    old = {"vocab_size": 300, "seq_len": 64, "n_layer": 2, "n_head": 4, "d_model": 64, "attention": "sdpa"}
    same = {**old, "attention": "flash", "dropout": 0.1, "n_kv_head": 4, "norm": "layernorm", "d_ff": 256,
            "fused_add_norm": True, "fused_bias_gelu": True}
    assert model_differences(old, same) == []  # a checkpoint from before the options existed is that model
    assert model_differences(old, {**old, "seq_len": 128, "vocab_size": 512}) == [
        ("seq_len", 64, 128), ("data.vocab_size", 300, 512)]
    rope = {**old, "pos_emb": "rope"}
    assert model_differences(rope, {**rope, "seq_len": 128}) == []  # RoPE holds no per-position weights
    with pytest.raises(CheckpointModelMismatch, match="model.n_kv_head: 4 in the checkpoint, 2 in the config"):
        check_model_matches(old, {**old, "n_kv_head": 2}, "x.ckpt")
