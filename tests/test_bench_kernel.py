"""bench/kernel.py's CPU-side parts: FLOP convention, result merging, the table's ratio columns, the figure,
and the refusal to benchmark without a GPU; for --varlen also the document-length distributions, their
packing, the FlexAttention masks and the skip paths. (The timing itself only runs on the GPU machine.)"""

import contextlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import doc_lengths as dl
from bench import kernel_varlen as kv

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


def test_candidate_build_has_its_own_ratio_columns():
    rows = [_row("ours", 400.0), _row("fa4", 500.0), _row("ours_candidate", 450.0)]
    table = bench.format_table(rows, DEVICE)
    assert "candidate/ours" in table and "candidate/FA4" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("| 2048 |"))
    assert [c.strip() for c in line.strip("|").split("|")][-2:] == ["1.12", "0.90"]
    assert "candidate/ours" not in bench.format_table(rows[:2], DEVICE)


def test_default_methods_take_the_candidate_only_when_given():
    assert "ours_candidate" not in bench.parse_args([]).methods
    assert bench.parse_args(["--candidate", "/tmp/b/_C.so"]).methods[-1] == "ours_candidate"


def test_candidate_method_needs_a_candidate_build(monkeypatch):
    monkeypatch.setattr(bench, "CANDIDATE", None)
    monkeypatch.setattr(bench, "CANDIDATE_OVERRIDES", {})
    with pytest.raises(bench.BackendUnsupported, match="no --candidate build or --candidate-overrides"):
        bench.make_method("ours_candidate", 1, 1, 8, 64, True, torch.bfloat16)


def test_candidate_overrides_make_the_candidate_method():
    args = bench.parse_args(["--candidate-overrides", "bwd_causal_group_heads=1", "causal_group_heads=2"])
    assert args.candidate_overrides == {"bwd_causal_group_heads": 1, "causal_group_heads": 2}
    assert args.methods[-1] == "ours_candidate"
    assert bench.parse_args(["--candidate-overrides", "bwd=sm80"]).candidate_overrides == {"bwd": "sm80"}
    for bad in ("bwd_causal_group_heads", "no_such_switch=1"):  # not KEY=VALUE; not a switch set_kernel_overrides has
        with pytest.raises(SystemExit):
            bench.parse_args(["--candidate-overrides", bad])


def test_gqa_inputs_and_rows_stay_apart():
    (q, k, v, do), leaves = bench.inputs_of("bthd", "sdpa", 2, 8, 16, 64, torch.float32, device="cpu", gqa=4)
    assert q.shape == do.shape == (2, 8, 16, 64) and k.shape == v.shape == (2, 2, 16, 64)  # (B, H, T, D) views
    assert leaves[1].shape == (2, 16, 2, 64)  # stored (B, T, Hkv, D)
    with pytest.raises(bench.BackendUnsupported, match="no grouped-query form"):
        bench.make_method("naive", 1, 8, 16, 64, True, torch.float32, gqa=4)
    for bad in (["--gqa", "0"], ["--gqa", "3"]):  # 3 divides no head count of hidden 2048
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    dense, grouped = _row("ours", 400.0), dict(_row("ours", 300.0), gqa=4)
    assert len(bench.merge([dense], [grouped])) == 2  # one key each
    table = bench.format_table([dense, grouped], DEVICE)
    assert "400" in table and "300" not in table
    table = bench.format_table([dense, grouped], DEVICE, gqa=4)
    assert "300" in table and "400" not in table and "4 query heads per key/value head" in table


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


# ------------------------------------------------------------------ --varlen: document-masked and sliding-window grid

def test_document_lengths_of_a_shard_and_their_packing():
    # Each document is its tokens then <|endoftext|> (id 0 here); tokens after the last separator are dropped.
    assert dl.lengths_from_shard(np.array([5, 6, 0, 7, 0, 0, 8, 9], dtype=np.uint16), eot=0).tolist() == [3, 2, 1]
    assert dl.sample_lengths("fixed2k", 16384) == [2048] * 8
    assert dl.sample_lengths("fixed4k", 5000) == [4096, 904]  # the last document cut to fit
    logn = dl.sample_lengths("lognormal", 16384)
    assert sum(logn) == 16384 and min(logn) >= 1 and logn == dl.sample_lengths("lognormal", 16384)
    assert logn != dl.sample_lengths("lognormal", 16384, seed=1)
    many = dl.sample_lengths("lognormal", 5_000_000)[:-1]
    assert 0.9 * dl.LOGNORMAL_MEDIAN < np.median(many) < 1.1 * dl.LOGNORMAL_MEDIAN
    pool = np.array([100, 200, 300, 5000])
    drawn = dl.sample_lengths("corpus", 4096, pool)
    assert sum(drawn) == 4096 and set(drawn[:-1]) <= {100, 200, 300, 5000}
    assert drawn == dl.sample_lengths("corpus", 4096, pool[::-1].copy())  # the draw ignores the pool's order
    assert dl.cu_seqlens([3, 0, 2]).tolist() == [0, 3, 3, 5] and dl.cu_seqlens([3, 0, 2]).dtype == np.int32
    assert dl.document_ids([2, 0, 1]).tolist() == [0, 0, 2]
    assert dl.summary([1024, 3072]) == {"docs": 2, "max_doc": 3072, "token_mean_doc": (1024**2 + 3072**2) / 4096}
    with pytest.raises(ValueError, match="unknown document-length distribution 'zipf'"):
        dl.sample_lengths("zipf", 16)
    with pytest.raises(ValueError, match="needs the corpus lengths"):
        dl.sample_lengths("corpus", 16)
    with pytest.raises(ValueError, match="total tokens must be >= 1"):
        dl.sample_lengths("fixed1k", 0)


def test_corpus_lengths_read_from_a_prepared_cache(tmp_path):
    from data.config import PrepareConfig
    from data.prepare import prepare, split_documents
    from data.tokenizer import load_tokenizer

    docs = [f"def f{i}():\n    return {i} * x\n" * (1 + i % 5) for i in range(12)]
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, doc in enumerate(docs):
        (folder / f"doc{i:02d}.txt").write_text(doc)
    cfg = PrepareConfig(source=f"files:{folder}", vocab_size=300, val_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    assert dl.corpus_lengths_from_cache(cfg=cfg) is None  # not prepared yet
    path = prepare(cfg)
    lengths, info = dl.corpus_lengths_from_cache(cfg=cfg)
    tokenizer = load_tokenizer(path / "tokenizer.json")
    train, _ = split_documents(len(docs), 0.25, 0)
    assert lengths.tolist() == [len(tokenizer.encode(docs[i]).ids) + 1 for i in train]  # + <|endoftext|>
    meta = json.loads((path / "meta.json").read_text())
    assert info["documents"] == meta["documents"]["train"] and info["tokens"] == meta["tokens"]["train"]
    assert info["from"] == f"prepared cache {path}"


def test_corpus_lengths_fall_back_to_the_committed_file(tmp_path, monkeypatch):
    said = []
    lengths, info = dl.corpus_lengths(tmp_path / "no-cache", say=said.append)
    committed = json.loads(dl.COMMITTED.read_text())
    assert lengths.tolist() == committed["lengths"] and len(lengths) == committed["documents"] > 1000
    assert sum(committed["lengths"]) == committed["tokens"] and committed["vocab_size"] == 50257
    assert info["from"] == f"committed {dl.COMMITTED.name}"
    assert len(said) == 1 and "make data" in said[0] and str(tmp_path / "no-cache") in said[0]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"bad\.json.*bench/doc_lengths\.py --write"):
        dl.corpus_lengths(tmp_path / "no-cache", committed=tmp_path / "bad.json", say=said.append)
    # --write: the cache's lengths, sorted, with what produced them; refused without a prepared cache
    with pytest.raises(SystemExit, match="run `make data` first"):
        dl.write_committed(tmp_path / "no-cache", tmp_path / "out.json")
    found = (np.array([7, 3, 5]), {"from": "prepared cache x", "cache": "x", "python": "3.12.0", "documents": 3, "tokens": 15})
    monkeypatch.setattr(dl, "corpus_lengths_from_cache", lambda cache_dir=None, cfg=None: found)
    dl.write_committed(tmp_path, tmp_path / "out.json")
    lengths, info = dl.load_committed(tmp_path / "out.json")
    assert lengths.tolist() == [3, 5, 7] and info["python"] == "3.12.0" and info["from"] == "committed out.json"


def test_varlen_flops_count_the_visible_pairs_only():
    # A packed call of fixed-length documents counts what dense causal attention on (B, T) counts (FA2 convention).
    H, D = 16, 128
    for mode in ("fwd", "bwd", "fwd_bwd"):
        assert kv.pair_flops(kv.visible_pairs([2048] * 8), H, D, mode) == bench.attention_flops(8, H, 2048, D, True, mode)
    assert kv.visible_pairs([100, 50]) == (100**2 + 50**2) / 2
    assert kv.visible_pairs([4096], window=4096) == kv.visible_pairs([4096], window=99999) == 4096**2 / 2
    # A window w < T: the band's area, w T - w^2 / 2, within 1% of the exact count of sum_i (min(i, w) + 1).
    T, w = 4096, 256
    exact = sum(min(i, w) + 1 for i in range(T))
    assert kv.visible_pairs([T], w) == w * T - w * w / 2 and abs(kv.visible_pairs([T], w) / exact - 1) < 0.01
    assert kv.visible_pairs([8192] * 2, 1024) < kv.visible_pairs([8192] * 2, 4096) < kv.visible_pairs([8192] * 2)
    # The dense baseline: the power of two nearest the token-weighted mean document length, the same tokens.
    assert kv.dense_shape([2048] * 8, 16384) == (8, 2048) and kv.dense_shape([16384], 16384) == (1, 16384)
    assert kv.dense_shape([1700, 2500, 1000], 16384) == (8, 2048) and kv.dense_shape([3] * 100, 16384) == (128, 128)


def test_varlen_cases_cover_the_distributions_and_windows():
    args = kv.parse_args([])
    cases = kv.make_cases(args, np.array([300, 1500, 9000]))
    docs = [c for c in cases if c.grid == "docs"]
    windows = [c for c in cases if c.grid == "window"]
    assert len(docs) == len(kv.DOC_CASES) * 2 and len(windows) == 2 * 2 * 4  # per hd; T 8k/16k x causal + 3 windows
    assert all(c.tokens == 16384 and c.heads * c.hd == 2048 for c in cases)
    assert {(c.name, c.window) for c in windows if c.hd == 64} == {
        (f"T{t}", w) for t in (8192, 16384) for w in (-1, 256, 1024, 4096)}
    assert next(c for c in windows if c.name == "T8192").lengths == (8192, 8192)
    assert next(c for c in docs if c.name == "fixed1k").lengths == (1024,) * 16
    assert kv.methods_of(windows[0], kv.METHODS) == ["ours", "ours_candidate", "flex", "fa4"]
    assert kv.methods_of(docs[0], kv.METHODS) == kv.METHODS
    one = kv.make_cases(kv.parse_args(["--cases", "fixed2k", "--hdims", "128"]))
    assert [(c.name, c.hd, c.heads) for c in one] == [("fixed2k", 128, 16)]
    for bad in (["--windows", "-1"], ["--window-seqlens", "3000"], ["--rounds", "0"], ["--hdims", "0"]):
        with pytest.raises(SystemExit):
            kv.parse_args(bad)


def test_flex_masks_match_per_document_and_windowed_attention():
    # Eager flex_attention on the CPU (the benchmark compiles it on the GPU): the block masks say what the kernels do.
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    H, D = 2, 16
    case = kv.Case("docs", "mixed", D, H, (100, 1, 50, 105))
    q, k, v = (torch.randn(1, H, case.tokens, D) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        o = flex_attention(q, k, v, block_mask=kv.flex_block_mask(case, "cpu"))
    cu = dl.cu_seqlens(case.lengths)
    want = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                      for a, b in zip(cu[:-1], cu[1:])], dim=2)  # fmt: skip
    torch.testing.assert_close(o, want)
    # Documents and a window together: the packed sequence's own mask, spelled out.
    windowed = kv.Case("docs", "mixed", D, H, case.lengths, window=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = flex_attention(q, k, v, block_mask=kv.flex_block_mask(windowed, "cpu"))
    i, doc = torch.arange(case.tokens), torch.from_numpy(dl.document_ids(case.lengths))
    visible = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= 8) & (doc[:, None] == doc[None, :])
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, attn_mask=visible))
    # Sliding window (w, 0): query i sees keys i - w ... i, in each of the B rows.
    case = kv.Case("window", "T256", D, H, (256, 256), window=32)
    q, k, v = (torch.randn(2, H, 256, D) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = flex_attention(q, k, v, block_mask=kv.flex_block_mask(case, "cpu"))
    i = torch.arange(256)
    visible = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= 32)
    assert int(visible.sum()) == sum(min(t, 32) + 1 for t in range(256))
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, attn_mask=visible))


def test_varlen_methods_that_cannot_run_say_why(monkeypatch):
    import flash_kernel

    case = kv.Case("window", "T8192", 128, 16, (8192, 8192), window=256)
    if not torch.cuda.is_available():
        for method in ("ours", "ours_dense"):
            with pytest.raises(kv.dense.BackendUnsupported, match="flash_kernel unavailable"):
                kv.make_method(method, kv.Case("docs", "fixed2k", 128, 16, (2048,) * 8), torch.bfloat16)
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:
        with pytest.raises(kv.dense.BackendUnsupported, match=r"flash_attn\.cute \(FlashAttention-4\) does not import"):
            kv.make_method("fa4", case, torch.bfloat16)
    # A kernel built before the varlen function or the window argument existed: skipped, saying which is missing.
    monkeypatch.setattr(flash_kernel, "is_available", lambda *a, **k: True)
    monkeypatch.delattr(flash_kernel, "flash_attn_varlen_func", raising=False)
    with pytest.raises(kv.dense.BackendUnsupported, match="flash_kernel has no flash_attn_varlen_func"):
        kv.make_method("ours", kv.Case("docs", "fixed2k", 128, 16, (2048,) * 8), torch.bfloat16)
    monkeypatch.setattr(flash_kernel, "flash_attn_func", lambda q, k, v, causal=True: q)
    with pytest.raises(kv.dense.BackendUnsupported, match="has no window_size"):
        kv.make_method("ours", case, torch.bfloat16)
    with pytest.raises(ValueError, match="no window case"):
        kv.make_method("ours_dense", case, torch.bfloat16)


def _fake_varlen_run(monkeypatch, argv):
    """kernel_varlen.benchmark with its methods and timer faked: ms by method (window rows scale with the
    visible pairs), fa4 skipped. Returns the rows and the order the timer ran in."""
    calls = []
    base_ms = {"ours": 1.0, "ours_candidate": 0.8, "ours_dense": 0.95, "flex": 1.6}

    def fake_make_method(method, case, dtype, device=None):
        if method == "fa4":
            raise kv.dense.BackendUnsupported("flash_attn.cute (FlashAttention-4) does not import: fake")
        ms = base_ms[method] * kv.visible_pairs(case.lengths, case.window) / kv.visible_pairs(case.lengths)
        return tuple(torch.zeros(1) for _ in range(4)), (method, ms), contextlib.nullcontext, {"layout": "fake"}

    def fake_run_mode(mode, tensors, fn, warmup_ms, rep_ms):
        calls.append((fn[0], mode))
        return fn[1] * (3.5 if mode == "fwd_bwd" else 1.0), 0.25

    monkeypatch.setattr(kv, "make_method", fake_make_method)
    monkeypatch.setattr(kv.dense, "run_mode", fake_run_mode)
    monkeypatch.setattr(kv.dense, "_free", lambda: None)  # no CUDA cache to empty; gc per row is slow here
    rows = kv.benchmark(kv.parse_args(argv), DEVICE)
    return rows, calls


def test_varlen_grid_rows_table_and_figure(monkeypatch, tmp_path, capsys):
    rows, calls = _fake_varlen_run(monkeypatch, ["--cases", "fixed2k", "window", "--hdims", "128", "--windows", "256",
                                                 "--window-seqlens", "8192", "--rounds", "2"])
    # In turn, round after round, per case and mode: docs (ours, ours_dense, flex), then window causal, window 256.
    assert calls[:6] == [("ours", "fwd"), ("ours_dense", "fwd"), ("flex", "fwd")] * 2
    get = {(r["grid"], r["window"], r["method"], r["mode"]): r for r in rows}
    assert get[("docs", -1, "fa4", "fwd")]["status"] == "skipped" and "fake" in get[("docs", -1, "fa4", "fwd")]["note"]
    ours = get[("docs", -1, "ours", "fwd_bwd")]
    assert ours["status"] == "ok" and ours["ms"] == 3.5 and ours["docs"] == 8 and ours["max_doc"] == 2048
    assert ours["tflops"] == pytest.approx(bench.attention_flops(8, 16, 2048, 128, True, "fwd_bwd") / 3.5e-3 / 1e12)
    assert get[("docs", -1, "ours_dense", "fwd")]["pairs"] == ours["pairs"]  # fixed2k: the same work as (8, 2k)
    w = get[("window", 256, "ours", "fwd")]
    assert w["pairs"] == 2 * (256 * 8192 - 256**2 / 2) and w["ms"] < get[("window", -1, "ours", "fwd")]["ms"]
    assert w["tflops"] == pytest.approx(get[("window", -1, "ours", "fwd")]["tflops"])  # time tracks the visible work
    table = kv.format_table(rows, DEVICE)
    line = next(ln for ln in table.splitlines() if ln.startswith("| fixed2k |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:4] == ["fixed2k", "8", "2048", "2048"] and cells[7] == "skipped" and cells[8] == "8 x 2k"
    assert cells[-3:] == ["0.95", "1.60", "-"]  # ours/dense = 0.95 ms / 1 ms; ours/flex; no FA4
    line = next(ln for ln in table.splitlines() if ln.startswith("| 8k | 256 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[5] == f"{w['ms']:.3f}" and cells[-3:] == [f"{w['ms'] / 1.0:.2f}", "1.60", "-"]
    assert "sliding window, forward + backward, hd 128" in table and "- fa4: flash_attn.cute" in table
    # Results merge per (device, grid, case, window, method, hd, mode) and redraw without a GPU.
    newer = dict(ours, tflops=1.0)
    merged = kv.merge(rows, [newer])
    assert len(merged) == len(rows) and newer in merged
    path = tmp_path / "kernel_varlen.json"
    bench.save(path, {"environment": {DEVICE: {"corpus_lengths": "committed"}}, "results": rows})
    assert bench.main(["--varlen", "--plot-only", "--results", str(path)]) == 0
    png = tmp_path / "kernel_varlen_nvidia_fake_gpu.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "ours/flex" in out and "corpus_lengths committed" in out


def test_varlen_candidate_is_timed_in_turn_with_ours(monkeypatch):
    # Without a candidate build or overrides, ours_candidate is no default method, and asked for it says why.
    assert "ours_candidate" not in kv.parse_args([]).methods
    assert "ours_candidate" in kv.parse_args(["--candidate-overrides", "bwd_causal_group_heads=1"]).methods
    monkeypatch.setattr(kv.dense, "CANDIDATE", None)
    monkeypatch.setattr(kv.dense, "CANDIDATE_OVERRIDES", {})
    with pytest.raises(kv.dense.BackendUnsupported, match="no --candidate build or --candidate-overrides given"):
        kv.make_method("ours_candidate", kv.Case("docs", "fixed2k", 128, 16, (2048,) * 8), torch.bfloat16)
    # With one: timed in turn with ours in both grids, and a candidate/ours column (its TFLOP/s over ours').
    monkeypatch.setitem(kv.dense.__dict__, "CANDIDATE_OVERRIDES", {"bwd_causal_group_heads": 1})
    real = kv.make_method
    rows, calls = _fake_varlen_run(monkeypatch, ["--cases", "fixed2k", "window", "--hdims", "128", "--windows", "256",
                                                 "--window-seqlens", "8192", "--rounds", "2", "--modes", "bwd",
                                                 "--methods", "ours", "ours_candidate"])
    assert calls[:4] == [("ours", "bwd"), ("ours_candidate", "bwd")] * 2
    assert {r["grid"] for r in rows if r["method"] == "ours_candidate"} == {"docs", "window"}
    table = kv.format_table(rows, DEVICE)
    assert "ours varlen, candidate" in table and "| ours, candidate |" in table
    for start in ("| fixed2k |", "| 8k | 256 |"):
        line = next(ln for ln in table.splitlines() if ln.startswith(start))
        assert line.strip("|").split("|")[-1].strip() == "1.25"  # 1 ms against 0.8 ms
    assert "candidate/ours" not in kv.format_table([r for r in rows if r["method"] != "ours_candidate"], DEVICE)
    # The candidate runs ours' function under bench.kernel's candidate context.
    monkeypatch.setattr(kv, "make_method", real)
    monkeypatch.setattr(kv, "_ours", lambda name: (lambda *a, **k: a[0]))
    *_, context, fields = kv.make_method("ours_candidate", kv.Case("docs", "fixed2k", 128, 16, (64,) * 2),
                                         torch.float32, device="cpu")
    assert context is kv.dense._candidate_context and fields["layout"] == "packed (128, H, D)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_varlen_refuses_to_benchmark_on_cpu(tmp_path):
    with pytest.raises(SystemExit, match=r"--varlen: needs a CUDA GPU"):
        bench.main(["--varlen", "--results", str(tmp_path / "kernel_varlen.json")])
    with pytest.raises(SystemExit, match="no results"):
        bench.main(["--varlen", "--plot-only", "--results", str(tmp_path / "kernel_varlen.json")])
    assert not (tmp_path / "kernel_varlen.json").exists()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the --varlen grid: needs a CUDA GPU")
def test_varlen_grid_runs_on_the_gpu(tmp_path):
    # A small slice of both grids end to end (flex compiles three masks): compiled flex runs; ours runs, or says
    # why not; FA4 too.
    path = tmp_path / "kernel_varlen.json"
    assert bench.main(["--varlen", "--tokens", "4096", "--cases", "fixed1k", "window", "--window-seqlens", "2048",
                       "--windows", "256", "--hdims", "64", "--modes", "fwd_bwd", "--rounds", "1", "--warmup-ms", "2",
                       "--rep-ms", "5", "--results", str(path)]) == 0  # fmt: skip
    rows = bench.load(path)["results"]
    assert len(rows) == 4 + 2 * 3  # the docs case's methods, then causal and window 256 with ours, flex, fa4
    assert all(r["status"] in ("ok", "skipped") for r in rows), [(r["method"], r["note"]) for r in rows if r["status"] != "ok"]
    assert all(r["status"] == "ok" and r["tflops"] > 0 for r in rows if r["method"] == "flex")
    import flash_kernel

    if flash_kernel.is_available():
        assert all(r["status"] == "ok" for r in rows if r["method"] == "ours_dense" or (r["method"] == "ours" and r["window"] < 0))


def test_mode_step_runs_what_each_mode_times():
    q = torch.ones(3, requires_grad=True)
    forwards = []

    def fn():
        forwards.append(1)
        return q * 2

    do = torch.ones(3)
    bench.mode_step("fwd", fn, do)()
    assert len(forwards) == 1 and q.grad is None
    step = bench.mode_step("bwd", fn, do)  # its one forward runs here; every call reuses its graph
    step()
    step()
    assert len(forwards) == 2 and q.grad.tolist() == [4.0, 4.0, 4.0]
    q.grad = None
    bench.mode_step("fwd_bwd", fn, do)()
    assert len(forwards) == 3 and q.grad.tolist() == [2.0, 2.0, 2.0]
