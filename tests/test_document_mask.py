"""Document masking and sliding windows (CPU): where the data says documents start, the same masked attention in
naive, sdpa and flex (flex has no backward on a CPU: its gradients are checked on a GPU in
tests/kernel/test_document_mask_flash.py, with flash's), positions that restart per document, and training runs
with data.document_mask=true that resume and run under DDP."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import train as train_mod
from data.windows import TrainWindows, ValWindows, collate_documents, document_starts, packed_cu_seqlens
from model.attention import ATTENTION, attention_mask, document_ids, document_positions, naive_attention
from model.gpt import GPT, GPTConfig, KVCache, ModelConfigError
from model.loss import next_token_loss
from recipe.checks import ConfigError
from recipe.schema import ConfigTypeError
from run_overrides import compose_train, tiny_run_overrides

REPO = Path(__file__).resolve().parents[1]
EOT = 0


def _starts(batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """(B, T) bool document starts: position 0, a run of one-token documents, and random others."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq_len, generator=g) < 0.15
    starts[:, 0] = True
    starts[0, 5:8] = True  # consecutive separators: documents of one token
    return starts


def _per_document_reference(q, k, v, starts, window):
    """Causal attention run on each document alone (a loop over documents, no packed mask): the semantics."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        bounds = starts[b].nonzero().squeeze(1).tolist() + [q.shape[1]]
        for s, e in zip(bounds[:-1], bounds[1:]):
            mask = None if window is None else attention_mask("naive", 1, e - s, e - s, q.device, window)
            out[b:b + 1, s:e] = naive_attention(q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e], mask=mask)
    return out


# ------------------------------------------------------------------------------------------------ the data
def _shard(tmp_path, tokens) -> Path:
    path = tmp_path / "train.bin"
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    return path


def test_windows_hand_document_starts_mid_document_and_at_consecutive_separators(tmp_path):
    # documents [5 6 7], [8 9], [] (an empty one: two separators in a row), [4 3 2 1], each followed by EOT
    tokens = [5, 6, 7, EOT, 8, 9, EOT, EOT, 4, 3, 2, 1, EOT]
    path = _shard(tmp_path, tokens)
    val = ValWindows(path, len(tokens), 8, np.array([1, 4]), eot_id=EOT)
    x, y, starts = val[0]  # starts mid-document: 6 7 EOT 8 9 EOT EOT 4
    assert x.tolist() == [6, 7, EOT, 8, 9, EOT, EOT, 4] and y.tolist() == tokens[2:10]
    assert starts.tolist() == [True, False, True, False, False, True, True, False]
    x, _, starts = val[1]  # 8 9 EOT EOT 4 3 2 1
    assert starts.tolist() == [True, False, True, True, False, False, False, False]
    assert len(ValWindows(path, len(tokens), 8, np.array([1]))[0]) == 2  # without eot_id: plain (x, y)
    train = TrainWindows(path, len(tokens), 8, seed=3, eot_id=EOT)
    for i in range(5):  # any window: starts are position 0 and the separators of x
        x, _, starts = train[i]
        assert torch.equal(starts, document_starts(x, EOT))
        assert starts[0] and starts[1:].tolist() == (x[1:] == EOT).tolist()


def test_collate_packs_the_batch_into_cu_seqlens_padded_to_a_power_of_two():
    starts = torch.tensor([[1, 0, 0, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    cu = packed_cu_seqlens(starts)
    # 5 documents -> 8 sequences; the 3 empty ones end at B·T = 16
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 8, 9, 13, 16, 16, 16, 16]
    assert document_ids(cu, 2, 8).tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [2, 3, 3, 3, 3, 4, 4, 4]]
    assert document_positions(cu, 2, 8).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 0, 1, 2]]
    assert packed_cu_seqlens(torch.ones(1, 4, dtype=torch.bool)).tolist() == [0, 1, 2, 3, 4]
    assert packed_cu_seqlens(torch.tensor([[True, False]])).tolist() == [0, 2]
    items = [(torch.arange(8), torch.arange(8) + 1, s) for s in starts]
    x, y, cu_batch = collate_documents(items)
    assert x.shape == y.shape == (2, 8) and torch.equal(cu_batch, cu)


# ------------------------------------------------------------------------------------------- the attention
@pytest.mark.parametrize("window, n_kv_head", [(None, 4), (3, 2), (0, 1)], ids=["mha", "gqa-w3", "mqa-w0"])
def test_implementations_agree_with_per_document_attention(window, n_kv_head):
    """naive, sdpa and flex with one packed mask give what attention on each document alone gives; naive and sdpa
    agree on the gradients too, and flex's block mask admits exactly the dense mask's pairs."""
    B, T, H, D = 2, 40, 4, 8
    g = torch.Generator().manual_seed(n_kv_head + 10 * (window or 0))
    q = torch.randn(B, T, H, D, generator=g)
    k, v = (torch.randn(B, T, n_kv_head, D, generator=g) for _ in range(2))
    starts = _starts(B, T, seed=1)
    cu = packed_cu_seqlens(starts)
    ref = _per_document_reference(q, k, v, starts, window)
    grads = {}
    for name in ("naive", "sdpa", "flex"):
        mask = attention_mask(name, B, T, T, q.device, window, cu)
        inputs = [t.clone().requires_grad_(name != "flex") for t in (q, k, v)]
        o = ATTENTION[name](*inputs, mask=mask)
        torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-4, msg=name)
        if name != "flex":
            grads[name] = torch.autograd.grad((o * ref).sum(), inputs)
        else:
            dense = attention_mask("naive", B, T, T, q.device, window, cu).dense
            assert torch.equal(create_mask(mask.block_mask.mask_mod, B, 1, T, T, device="cpu"), dense)
    for a, b in zip(grads["naive"], grads["sdpa"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_window_alone_and_plain_flex_are_causal_attention():
    B, T, H, D = 2, 24, 2, 8
    q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
    causal = naive_attention(q, k, v)
    torch.testing.assert_close(ATTENTION["flex"](q, k, v), causal, atol=1e-5, rtol=1e-4)  # plain causal block mask
    for name in ("naive", "sdpa", "flex"):
        wide = attention_mask(name, B, T, T, q.device, window=T)  # a window over the whole context
        torch.testing.assert_close(ATTENTION[name](q, k, v, mask=wide), causal, atol=1e-5, rtol=1e-4)
    one = attention_mask("sdpa", B, T, T, q.device, window=0)  # each query sees itself only: o = v
    torch.testing.assert_close(ATTENTION["sdpa"](q, k, v, mask=one), v, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------ the model
def _gpt(attention, seed=0, **options):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=300, seq_len=48, n_layer=2, n_head=4, d_model=64, attention=attention, **options))


MODEL_OPTIONS = {"gpt3": {}, "gqa_rope_window": {"n_kv_head": 2, "pos_emb": "rope", "window": 5},
                 "no_reset": {"reset_position_ids": False}}


@pytest.mark.parametrize("options", MODEL_OPTIONS.values(), ids=MODEL_OPTIONS.keys())
def test_model_loss_and_gradients_agree_across_implementations(options):
    idx = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(2))
    cu = packed_cu_seqlens(_starts(2, 48, seed=3))
    ref = _gpt("naive", **options)
    loss_ref = next_token_loss(ref(idx, cu_seqlens=cu), idx)
    loss_ref.backward()
    assert not torch.allclose(loss_ref, next_token_loss(ref(idx), idx))  # the documents change the loss
    for name in ("sdpa", "flex"):
        model = _gpt(name, **options)
        model.load_state_dict(ref.state_dict())
        if name == "flex":  # forward only on a CPU
            with torch.no_grad():
                torch.testing.assert_close(next_token_loss(model(idx, cu_seqlens=cu), idx), loss_ref.detach())
            continue
        loss = next_token_loss(model(idx, cu_seqlens=cu), idx)
        loss.backward()
        torch.testing.assert_close(loss, loss_ref)
        for (pname, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-3, msg=pname)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_a_packed_document_computes_what_it_computes_alone(pos_emb):
    """With documents and reset_position_ids, each document of a packed window gets the logits it gets as a
    window of its own: packing is then invisible to the model. Without the reset, learned positions differ
    (RoPE does not: its scores depend on relative positions only)."""
    model = _gpt("sdpa", pos_emb=pos_emb).eval()
    idx = torch.randint(1, 300, (1, 48), generator=torch.Generator().manual_seed(4))
    starts = torch.zeros(1, 48, dtype=torch.bool)
    starts[0, [0, 17, 30]] = True
    cu = packed_cu_seqlens(starts)
    with torch.no_grad():
        packed = model(idx, cu_seqlens=cu)
        alone = model(idx[:, 17:30])
        torch.testing.assert_close(packed[:, 17:30], alone, atol=1e-5, rtol=1e-4)
        model.cfg.reset_position_ids = False
        shifted = model(idx, cu_seqlens=cu)[:, 17:30]
    assert torch.allclose(shifted, alone, atol=1e-4) == (pos_emb == "rope")


def test_window_reaches_the_model_and_decoding_keeps_it():
    idx = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(5))
    full, windowed = _gpt("sdpa").eval(), _gpt("sdpa", window=4).eval()
    with torch.no_grad():
        assert not torch.allclose(full(idx), windowed(idx))
        logits = windowed(idx)
        cache = KVCache(windowed.cfg, 2, 30, idx.device, torch.float32)
        steps = [windowed(idx[:, :10], cache=cache)] + [windowed(idx[:, t:t + 1], cache=cache) for t in range(10, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), logits, atol=1e-5, rtol=1e-4)


def test_bad_window_and_combinations_are_named():
    with pytest.raises(ModelConfigError, match="attention.window=-1"):
        _gpt("sdpa", window=-1)
    cfg = compose_train("experiment=cpu_tiny", "attention.window=-2")
    bad_type = compose_train("experiment=cpu_tiny", "data.document_mask=maybe")
    flex_cpu = compose_train("experiment=cpu_tiny", "attention=flex")
    assert cfg.model.window == -2  # the attention key reaches the model
    with pytest.raises(ConfigError, match=r"attention.window=-2 must be null"):
        train_mod.validate(cfg)
    with pytest.raises(ConfigTypeError, match="data.document_mask"):
        train_mod.check_types(bad_type)
    with pytest.raises(ConfigError, match="attention=flex trains on a CUDA GPU only"):
        train_mod.validate(flex_cpu)
    model = _gpt("sdpa")
    cu = packed_cu_seqlens(torch.ones(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="not to decoding with a KV cache"):
        model(torch.zeros(2, 8, dtype=torch.long), cache=KVCache(model.cfg, 2, 8, "cpu", torch.float32), cu_seqlens=cu)


# ----------------------------------------------------------------------------------------- training runs
def _train(data_cache, out, *extra):
    return train_mod.train(compose_train(*tiny_run_overrides(data_cache, out, *extra)))


def _weights(path):
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_resume_with_document_mask_ends_on_the_uninterrupted_run(data_cache, tmp_path):
    """4 steps straight vs 2 steps, then a resume from that checkpoint: the same weights (the data position and
    the documents come back with the checkpoint)."""
    common = ("data.document_mask=true", "trainer.max_steps=4", "ckpt_every=2", "trainer.val_check_interval=2",
              "logger=none", "model.n_layer=1")
    metrics = _train(data_cache, tmp_path / "straight", *common)
    assert math.isfinite(metrics["val/loss"])
    _train(data_cache, tmp_path / "resumed", *common,
           f"ckpt_path={tmp_path / 'straight' / 'checkpoints' / 'step0000002.ckpt'}")
    a, b = (_weights(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_trains_with_document_mask(data_cache, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    overrides = tiny_run_overrides(data_cache, tmp_path, "logger=none", "trainer.accelerator=cpu", "trainer.devices=2",
                                   "trainer.max_steps=3", "data.document_mask=true", "model.n_layer=1")
    cmd = [sys.executable, "train.py", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 3 and math.isfinite(summary["val/loss"])


def test_document_batches_reach_the_device_with_their_cu_seqlens_checked(monkeypatch):
    """LitGPT moves a document batch's cu_seqlens through flash_kernel.cu_seqlens_to: its values are checked on the
    host against the batch's B·T tokens and T, and the moved copy needs no check by the varlen op (a device read);
    a plain (x, y) batch moves as before, and a cu_seqlens that does not fit the batch is refused on the way."""
    from flash_kernel import interface
    from model.lit_gpt import LitGPT

    module = LitGPT(model=dict(vocab_size=300, seq_len=16, n_layer=1, n_head=2, d_model=32, attention="sdpa"))
    starts = torch.zeros(2, 16, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, 5] = starts[1, 9] = True
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    cu = packed_cu_seqlens(starts)
    moved = module.transfer_batch_to_device((x, y, cu), torch.device("cpu"), 0)
    assert len(moved) == 3 and torch.equal(moved[2], cu)
    reads = []
    stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **kw: reads.append(1) or stack(*a, **kw))
    interface.check_values_of_cu_seqlens(moved[2], moved[2], x.numel(), x.numel(), 16, 16)
    assert not reads, "the moved cu_seqlens is read again by the op's check"
    assert len(module.transfer_batch_to_device((x, y), torch.device("cpu"), 0)) == 2
    with pytest.raises(ValueError, match="cu_seqlens_q\\[-1\\] is 32 but q has 16 rows"):
        module.transfer_batch_to_device((x[:1], y[:1], cu), torch.device("cpu"), 0)
