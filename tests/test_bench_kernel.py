"""bench/kernel.py's CPU-side parts: FLOP convention, result merging, the table's ratio columns, the figure,
and the refusal to benchmark without a GPU. (The timing itself only runs on the GPU machine.)"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location("bench_kernel", Path(__file__).resolve().parents[1] / "bench" / "kernel.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

DEVICE = "NVIDIA Fake GPU"


def _row(method, tflops, seqlen=2048, hd=128, causal=True, mode="fwd_bwd", status="ok", device=DEVICE):
    return {
        "device": device, "method": method, "hd": hd, "causal": causal, "seqlen": seqlen, "mode": mode,
        "batch": 16384 // seqlen, "heads": 2048 // hd, "dtype": "bf16", "status": status,
        "ms": 1.0 if status == "ok" else None, "tflops": tflops if status == "ok" else None,
        "peak_mem_gib": 1.0 if status == "ok" else None, "note": "",
    }  # fmt: skip


def _synthetic():
    rows = []
    for seqlen in (512, 2048):
        for mode in ("fwd", "fwd_bwd"):
            rows += [
                _row("naive", 20.0, seqlen, mode=mode),
                _row("sdpa", 400.0, seqlen, mode=mode),
                _row("sdpa_flash", 300.0, seqlen, mode=mode),
                _row("sdpa_cudnn", 600.0, seqlen, mode=mode, status="n/a" if seqlen == 512 else "ok"),
                _row("ours", 150.0, seqlen, mode=mode),
            ]
    rows.append(_row("naive", 0, 16384, mode="fwd_bwd", status="OOM"))
    rows.append(_row("ours", 200.0, 2048, hd=64, causal=False, mode="bwd"))
    return rows


def test_flops_follow_the_fa2_paper():
    assert bench.attention_flops(2, 3, 5, 7, causal=False, mode="fwd") == 4 * 2 * 3 * 5 * 5 * 7
    assert bench.attention_flops(2, 3, 5, 7, causal=True, mode="fwd") == 2 * 2 * 3 * 5 * 5 * 7
    fwd = bench.attention_flops(1, 16, 2048, 128, causal=True, mode="fwd")
    assert bench.attention_flops(1, 16, 2048, 128, causal=True, mode="bwd") == 2.5 * fwd
    assert bench.attention_flops(1, 16, 2048, 128, causal=True, mode="fwd_bwd") == 3.5 * fwd
    assert bench.shape_for(2048, 128) == (8, 16) and bench.shape_for(16384, 64) == (1, 32)  # B*T = 16k, H*hd = 2048


def test_merge_replaces_same_key_and_keeps_others():
    old = [_row("ours", 100.0), _row("ours", 90.0, seqlen=512), _row("ours", 80.0, device="Other GPU")]
    merged = bench.merge(old, [_row("ours", 150.0), _row("sdpa", 400.0)])
    assert len(merged) == 4
    ours_2k = [r for r in merged if r["method"] == "ours" and r["seqlen"] == 2048 and r["device"] == DEVICE]
    assert [r["tflops"] for r in ours_2k] == [150.0]


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "results" / "kernel.json"
    bench.save(path, {"environment": {DEVICE: {"torch": "x"}}, "results": _synthetic()})
    assert bench.load(path)["results"] == json.loads(path.read_text())["results"]
    assert not list(path.parent.glob("*.tmp"))
    assert bench.load(tmp_path / "missing.json") == {"environment": {}, "results": []}


def test_table_has_ratio_columns_oom_and_na():
    table = bench.format_table(_synthetic(), DEVICE)
    assert "ours/FLASH" in table and "ours/SDPA" in table and "ours/cuDNN" in table and "ours/FA4" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("| 2048 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[-4:] == ["0.50", "0.38", "0.25", "-"]  # 150 / 300, 150 / 400, 150 / 600; no FA4 row
    line = next(ln for ln in table.splitlines() if ln.startswith("| 512 |"))
    assert line.rstrip(" |").endswith("| -")  # no ratio against a method that could not run
    assert "| OOM |" in table and "n/a" in table
    assert "forward + backward, hd 128, causal" in table and "backward, hd 64, non-causal" in table


def test_plot_writes_png(tmp_path):
    out = bench.plot(_synthetic(), DEVICE, tmp_path / f"kernel_{bench.device_slug(DEVICE)}.png")
    assert out.name == "kernel_nvidia_fake_gpu.png"
    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_only_redraws_from_json(tmp_path, capsys):
    path = tmp_path / "kernel.json"
    bench.save(path, {"environment": {DEVICE: {"torch": "x"}}, "results": _synthetic()})
    assert bench.main(["--plot-only", "--results", str(path)]) == 0
    assert (tmp_path / "kernel_nvidia_fake_gpu.png").exists()
    assert "ours/FLASH" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_to_benchmark_on_cpu(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--results", str(tmp_path / "kernel.json")])
    assert not (tmp_path / "kernel.json").exists()


@pytest.mark.parametrize("method", ["sdpa_flash", "naive", "ours_sm80", "fa4"])
def test_inputs_native_and_bthd(method):
    B, H, T, D = 2, 3, 5, 8
    # native: each method's own contiguous layout, read directly
    (q, k, v, do), leaves = bench.inputs_of("native", method, B, H, T, D, torch.float32, device="cpu")
    want = (B, T, H, D) if method in bench.BTHD_METHODS else (B, H, T, D)
    assert q.shape == do.shape == want and q is leaves[0] and q.is_contiguous()
    # bthd: every method reads the same (B, T, H, D) storage; PyTorch's methods through (B, H, T, D) views of it
    (q, k, v, do), leaves = bench.inputs_of("bthd", method, B, H, T, D, torch.float32, device="cpu")
    assert all(x.shape == (B, T, H, D) and x.is_contiguous() and x.requires_grad for x in leaves)
    if method in bench.BTHD_METHODS:
        assert q is leaves[0] and do.shape == (B, T, H, D)
    else:
        assert q.shape == do.shape == (B, H, T, D) and not q.is_contiguous()
        assert q.data_ptr() == leaves[0].data_ptr() and torch.equal(q, leaves[0].transpose(1, 2))
        q.sum().backward()  # the view's gradient lands in the stored tensor's layout
        assert leaves[0].grad.shape == (B, T, H, D)


def test_inputs_kinds_merge_and_report_apart(tmp_path, capsys):
    native = _row("ours", 150.0)  # rows from before --inputs have no field: native
    bthd = dict(_row("ours", 120.0), inputs="bthd")
    merged = bench.merge([native], [bthd, dict(_row("sdpa_flash", 300.0), inputs="bthd")])
    assert len(merged) == 3 and {bench.inputs_kind(r) for r in merged} == {"native", "bthd"}
    assert "150" in bench.format_table(merged, DEVICE) and "120" not in bench.format_table(merged, DEVICE)
    table = bench.format_table(merged, DEVICE, "bthd")
    assert "same (B, T, H, D) tensors" in table and "| 2048 | 300 | 120 |" in table and "0.40" in table
    path = tmp_path / "kernel.json"
    bench.save(path, {"environment": {}, "results": merged})
    assert bench.main(["--plot-only", "--results", str(path), "--inputs", "bthd"]) == 0
    assert (tmp_path / "kernel_nvidia_fake_gpu_bthd.png").exists() and not (tmp_path / "kernel_nvidia_fake_gpu.png").exists()
    with pytest.raises(ValueError, match="unknown inputs"):
        bench.make_method("sdpa", 1, 1, 8, 8, False, torch.float32, inputs="bhtd")


@pytest.mark.parametrize("rounds", [1, 3])
def test_rounds_interleave_methods_and_take_medians(monkeypatch, rounds):
    # The timing is faked: run_mode returns the next of each method's scripted times and logs the order it ran in.
    script = {"ours": [2.0, 1.0, 9.0], "sdpa_cudnn": [4.0, 5.0, 3.0]}
    calls = []

    def fake_make_method(method, *shape_and_dtype):
        return tuple(torch.zeros(1) for _ in range(4)), method, bench.contextlib.nullcontext

    def fake_run_mode(mode, tensors, fn, warmup_ms, rep_ms):
        calls.append((fn, mode))
        return script[fn][sum(1 for c in calls if c == (fn, mode)) - 1], 0.5

    monkeypatch.setattr(bench, "make_method", fake_make_method)
    monkeypatch.setattr(bench, "run_mode", fake_run_mode)
    monkeypatch.setattr(bench, "kernel_names", lambda hd: {})
    args = bench.parse_args(["--methods", "ours", "sdpa_cudnn", "--hdims", "128", "--causal", "1", "--seqlens", "2048",
                             "--modes", "fwd", "--rounds", str(rounds)])
    rows = {r["method"]: r for r in bench.benchmark(args, DEVICE)}
    assert calls == [("ours", "fwd"), ("sdpa_cudnn", "fwd")] * rounds  # in turn, round after round
    if rounds == 1:
        assert rows["ours"]["ms"] == 2.0 and rows["sdpa_cudnn"]["ms"] == 4.0 and "ms_rounds" not in rows["ours"]
    else:
        assert rows["ours"]["ms"] == 2.0 and rows["sdpa_cudnn"]["ms"] == 4.0  # medians of (2, 1, 9) and (4, 5, 3)
        assert rows["ours"]["ms_rounds"] == [2.0, 1.0, 9.0]
    flops = bench.attention_flops(8, 16, 2048, 128, True, "fwd")
    assert rows["ours"]["tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])


def test_fa4_skipped_with_its_reason_when_it_does_not_import():
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("flash_attn.cute imports here: the method runs instead of being skipped")
    with pytest.raises(bench.BackendUnsupported, match=r"flash_attn\.cute \(FlashAttention-4\) does not import"):
        bench.make_method("fa4", 1, 2, 128, 64, True, torch.bfloat16)
