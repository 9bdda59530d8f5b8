"""Document masking and sliding windows on a GPU: flash (the varlen kernel, the whole batch in one call) and flex
(compiled FlexAttention) against the fp32 per-document reference, forward and backward, within twice the error
of PyTorch's own bf16 sdpa (the FA2 paper's rule); the GPT's loss and gradients through each; and a compiled GPT
whose batches bring cu_seqlens of changing lengths; and DDP and FSDP runs on two GPUs with document masking that
resume from their middle checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.windows import packed_cu_seqlens
from model.attention import ATTENTION, attention_mask
from model.gpt import GPT, GPTConfig
from model.loss import next_token_loss
from run_overrides import tiny_run_overrides

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


def _starts(batch, seq_len, n_docs, seed):
    """(B, T) document starts: position 0, n_docs - 1 random others per window, one-token documents included."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.zeros(batch, seq_len, dtype=torch.bool)
    starts[:, 0] = True
    for b in range(batch):
        starts[b, torch.randperm(seq_len - 1, generator=g)[: n_docs - 1] + 1] = True
    starts[0, 7:9] = True
    return starts


def _run(name, q, k, v, window, cu, do):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    B, T = q.shape[:2]
    o = ATTENTION[name](q, k, v, mask=attention_mask(name, B, T, T, q.device, window, cu))
    o.backward(do)
    return [o.float(), q.grad.float(), k.grad.float(), v.grad.float()]


@pytest.mark.parametrize("window", [None, 100], ids=["full", "w100"])
@pytest.mark.parametrize("n_kv_head", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", ["flash", "flex"])
def test_masked_attention_matches_the_fp32_reference(name, n_kv_head, window):
    B, T, H, D = 2, 1024, 8, 64
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, T, n_kv_head, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    cu = packed_cu_seqlens(_starts(B, T, n_docs=6, seed=n_kv_head)).cuda()
    ref = _run("naive", *(t.float() for t in (q, k, v)), window, cu, do.float())
    sdpa = _run("sdpa", q, k, v, window, cu, do)
    ours = _run(name, q, k, v, window, cu, do)
    for what, r, s, o in zip(("o", "dq", "dk", "dv"), ref, sdpa, ours):
        err, err_sdpa = (o - r).abs().max().item(), (s - r).abs().max().item()
        assert err <= 2 * err_sdpa + 1e-3, f"{name} {what}: max error {err:.2e}, bf16 sdpa's {err_sdpa:.2e}"


@pytest.mark.parametrize("options", [{}, {"n_kv_head": 2, "pos_emb": "rope", "window": 64}], ids=["gpt3", "gqa_rope_window"])
@pytest.mark.parametrize("name", ["flash", "flex"])
def test_gpt_with_documents_agrees_with_sdpa(name, options):
    idx = torch.randint(0, 500, (2, 512), device="cuda")
    cu = packed_cu_seqlens(_starts(2, 512, n_docs=4, seed=1)).cuda()
    losses, grads = {}, {}
    for attention in ("sdpa", name):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=500, seq_len=512, n_layer=2, n_head=8, d_model=512, attention=attention,
                              **options)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = next_token_loss(model(idx, cu_seqlens=cu), idx)
        loss.backward()
        losses[attention], grads[attention] = loss.item(), [p.grad.float() for p in model.parameters()]
    assert losses[name] == pytest.approx(losses["sdpa"], rel=1e-2)
    for g, g_ref in zip(grads[name], grads["sdpa"]):
        assert (g - g_ref).norm() <= 0.05 * g_ref.norm() + 1e-6


@pytest.mark.parametrize("name", ["flash", "flex"])
def test_compiled_gpt_takes_batches_with_different_document_counts(name):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=500, seq_len=256, n_layer=2, n_head=4, d_model=256, attention=name)).cuda()
    model.compile()
    idx = torch.randint(0, 500, (2, 256), device="cuda")
    for n_docs in (1, 3, 9, 20):  # cu_seqlens of 5, 9, 33 and 65 entries
        cu = packed_cu_seqlens(_starts(2, 256, n_docs=n_docs, seed=n_docs)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = next_token_loss(model(idx, cu_seqlens=cu), idx)
        loss.backward()
        assert torch.isfinite(loss)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP and FSDP with document masking: needs 2 GPUs")


@two_gpus
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpu_run_with_document_mask_resumes_onto_the_uninterrupted_run(data_cache, tmp_path, strategy):
    """Both ranks pack their documents into one varlen call per layer; a run resumed from step 4's checkpoint (an
    FSDP checkpoint is a directory of shards) reaches the last step with the uninterrupted run's loss, up to the
    attention backward's atomics."""
    steps = 8
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)

    def launch(out, *extra):
        overrides = tiny_run_overrides(
            data_cache, out, f"trainer={strategy}", "trainer.devices=2", "trainer.precision=bf16-mixed",
            "attention=flash", "data.document_mask=true", "model.d_model=128", "model.n_head=2", "logger=none",
            f"trainer.max_steps={steps}", "ckpt_every=4", "trainer.val_check_interval=4", *extra)
        proc = subprocess.run([sys.executable, "train.py", *overrides], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((out / "metrics.json").read_text())

    straight = launch(tmp_path / "straight")
    middle = tmp_path / "straight" / "checkpoints" / "step0000004.ckpt"
    assert middle.is_dir() if strategy == "fsdp" else middle.is_file()
    resumed = launch(tmp_path / "resumed", f"ckpt_path={middle}")
    assert straight["world_size"] == resumed["world_size"] == 2
    assert straight["global_step"] == resumed["global_step"] == steps
    assert resumed["train/loss"] == pytest.approx(straight["train/loss"], rel=2e-2)
    assert resumed["val/loss"] == pytest.approx(straight["val/loss"], rel=2e-2)
