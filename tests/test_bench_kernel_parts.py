"""bench/kernel_parts.py: kernel names, per-call times, medians over rounds, the table; one case on a GPU."""

import json

import pytest
import torch

from bench import kernel_parts as kp


@pytest.mark.parametrize("raw, name", [
    ("void flash::bwd_convert_dq_kernel<__nv_bfloat16, 128, true, false>(flash::BwdParams)",
     "flash::bwd_convert_dq_kernel"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
     "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)", "at::native::vectorized_elementwise_kernel"),
    ("void flash::f<(flash::Order)0>(int)", "flash::f"),
    ("Memset (Device)", "Memset"),
    ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD"),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90_0", "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90_0"),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at__tensor0000o11101213_"
     "tensor0000o11101213_0", "FlashAttentionBackwardSm90"),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlashAttentionBackwardPostprocess_object_at__"
     "tensorptrf32gmemalign16oi64div4i64div41_tensorptrbf16gmemalign16oi64div8i64div8i64div_0",
     "FlashAttentionBackwardPostprocess"),
])
def test_kernel_names_lose_return_type_templates_and_parameters(raw, name):
    assert kp.kernel_name(raw) == name


def test_per_call_averages_the_calls_and_adds_instantiations():
    # two calls: fwd<1> 30 µs, bwd 100, fwd<2> 10, a memset 4, with 1 µs idle before the memset in the first call
    events = [("void flash::fwd<1>(P)", 0.0, 30.0), ("void flash::bwd<2>(P)", 30.0, 130.0),
              ("void flash::fwd<2>(P)", 130.0, 140.0), ("Memset (Device)", 141.0, 145.0),
              ("void flash::fwd<1>(P)", 200.0, 230.0), ("void flash::bwd<2>(P)", 230.0, 330.0),
              ("void flash::fwd<2>(P)", 330.0, 340.0), ("Memset (Device)", 340.0, 344.0)]
    out = kp.per_call(events[::-1], calls=2)  # any order: the events are sorted by start
    assert list(out) == ["flash::fwd", "flash::bwd", "Memset", kp.TOTAL, kp.SPAN]
    assert out == {"flash::fwd": 40.0, "flash::bwd": 100.0, "Memset": 4.0, kp.TOTAL: 144.0, kp.SPAN: 144.5}


def test_a_flushed_call_leaves_the_flush_out_and_times_the_idle_after_it():
    flush = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int> >(int)"
    events = [(flush, 0.0, 60.0), ("void flash::pre(P)", 75.0, 140.0), ("void flash::main(P)", 140.0, 1140.0),
              (flush, 1200.0, 1260.0), ("void flash::pre(P)", 1265.0, 1330.0), ("void flash::main(P)", 1332.0, 2332.0)]
    out = kp.per_call(events, calls=2, flushed=True)
    assert out == {"flash::pre": 65.0, "flash::main": 1000.0, kp.TOTAL: 1065.0, kp.SPAN: 1066.0,
                   kp.FLUSH_IDLE: 10.0}


@pytest.mark.parametrize("events, calls, flushed, match", [
    ([("a", 0.0, 1.0), ("b", 1.0, 2.0), ("a", 3.0, 4.0)], 2, False, "do not split into 2 calls"),
    ([("a", 0.0, 1.0), ("b", 1.0, 2.0), ("b", 3.0, 4.0), ("a", 4.0, 5.0)], 2, False, "the calls differ"),
    ([("flush", 0.0, 1.0), ("flush", 2.0, 3.0)], 2, True, "no kernel of the call"),
    ([], 1, False, "do not split"),
])
def test_calls_that_cannot_be_told_apart_are_refused(events, calls, flushed, match):
    with pytest.raises(ValueError, match=match):
        kp.split_calls(events, calls, flushed)


def test_medians_take_each_row_over_the_rounds_and_a_missing_kernel_as_zero():
    rounds = [{"a": 1.0, "b": 5.0, kp.TOTAL: 6.0, kp.SPAN: 7.0}, {"a": 3.0, kp.TOTAL: 3.0, kp.SPAN: 3.5},
              {"a": 2.0, "b": 7.0, kp.TOTAL: 9.0, kp.SPAN: 9.0}]
    out = kp.medians(rounds)
    assert list(out) == ["a", "b", kp.TOTAL, kp.SPAN]
    assert out == {"a": 2.0, "b": 5.0, kp.TOTAL: 6.0, kp.SPAN: 7.0}


def test_table_has_a_row_per_kernel_a_column_per_method_and_the_total_last():
    table = kp.format_case("hd=128 causal=0 T=8192 fwd_bwd", {
        "ours": {"flash::main": 4554.1, "flash::convert": 52.5, kp.TOTAL: 4606.6},
        "fa4": {"fa4_bwd": 4400.0, kp.TOTAL: 4400.0},
    })
    lines = table.splitlines()
    assert lines[2] == "| kernel | ours | fa4 |"
    assert lines[4:] == ["| flash::main | 4554.1 | – |", "| flash::convert | 52.5 | – |",
                         "| fa4_bwd | – | 4400.0 |", f"| {kp.TOTAL} | 4606.6 | 4400.0 |"]


def test_default_methods_take_the_candidate_only_when_given():
    assert kp.parse_args([]).methods == ["ours"]
    assert kp.parse_args(["--candidate", "/tmp/b/_C.so"]).methods == ["ours", "ours_candidate"]


def test_bad_rounds_stop_at_the_arguments():
    with pytest.raises(SystemExit):
        kp.parse_args(["--rounds", "0"])


def test_modes_are_kernel_pys_and_the_flush_is_off_by_default():
    args = kp.parse_args(["--modes", "bwd", "fwd"])
    assert args.modes == ["bwd", "fwd"] and not args.flush_l2
    assert kp.parse_args(["--flush-l2"]).flush_l2


def test_refuses_to_run_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        kp.main(["--results", str(tmp_path / "parts.json")])
    assert not (tmp_path / "parts.json").exists()


def _run_on_gpu(tmp_path, args: list[str]) -> list[dict]:
    """kernel_parts.main(args) with ours' kernels built; the rows it wrote."""
    import flash_kernel

    if not flash_kernel.is_available():
        pytest.skip(f"flash_kernel unavailable: {flash_kernel.unavailable_reason()}")
    path = tmp_path / "parts.json"
    assert kp.main(args + ["--rounds", "2", "--iters", "3", "--results", str(path)]) == 0
    return json.loads(path.read_text())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiles attention kernels: needs a CUDA GPU")
def test_a_backward_splits_into_its_kernels_on_the_gpu(tmp_path):
    rows = _run_on_gpu(tmp_path, ["--methods", "ours", "sdpa_flash", "--hdims", "64", "--causal", "1", "--seqlens",
                                  "1024"])
    ours = {r["kernel"]: r["us_per_call"] for r in rows if r["method"] == "ours"}
    # ours' forward + backward: the forward, the backward's preprocess, main kernel and dQ convert, each timed
    for name in ("flash::bwd_preprocess_kernel", "flash::bwd_convert_dq_kernel"):
        assert ours.get(name, 0) > 0, sorted(ours)
    assert any("fwd" in k and us > 0 for k, us in ours.items()), sorted(ours)
    parts = sum(us for k, us in ours.items() if k not in kp.SUMMARY)
    assert ours[kp.TOTAL] == pytest.approx(parts)
    assert ours[kp.SPAN] >= ours[kp.TOTAL] * (1 - 1e-6)  # one stream: the kernels do not overlap
    assert kp.FLUSH_IDLE not in ours
    sdpa = {r["kernel"]: r["us_per_call"] for r in rows if r["method"] == "sdpa_flash"}
    assert sdpa[kp.TOTAL] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiles attention kernels: needs a CUDA GPU")
def test_backward_calls_after_an_l2_flush_on_the_gpu(tmp_path):
    rows = _run_on_gpu(tmp_path, ["--methods", "ours", "--hdims", "128", "--causal", "0", "--seqlens", "1024",
                                  "--modes", "bwd", "--flush-l2"])
    ours = {r["kernel"]: r["us_per_call"] for r in rows}
    assert all(r["mode"] == "bwd" and r["flush_l2"] for r in rows)
    # the backward's three kernels in launch order, and nothing of the forward, nor the flush
    kernels = [k for k in ours if k not in kp.SUMMARY]
    assert len(kernels) == 3 and "fwd" not in kernels[1], kernels
    assert (kernels[0], kernels[2]) == ("flash::bwd_preprocess_kernel", "flash::bwd_convert_dq_kernel"), kernels
    assert ours[kp.SPAN] >= ours[kp.TOTAL] * (1 - 1e-6)
    assert ours[kp.FLUSH_IDLE] >= 0
