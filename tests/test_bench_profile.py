"""bench/profile_step.py's and bench/trace.py's bookkeeping on CPU: kernel names land in the right category, --set
parses, the pipeline's profiler covers the steps it is asked for."""

import gc
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import trace

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_profile_step", REPO / "bench" / "profile_step.py")
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)

# Kernel names as torch.profiler reports them on an H100 (torch 2.11, CUDA 13), shortened where long.
KERNELS = {
    "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTT": "matmul",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas": "matmul",
    "void flash::flash_bwd_kernel_sm90<flash::BwdTraits<128, true> >(flash::BwdParams)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0": "attention",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, false>(int, float)": "norms",
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, 32u, 16u, 64u, true>": "norms",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&)>": "GELU",
    "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)>": "dtype casts and copies",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>": "cross-entropy",
    "void at::native::multi_tensor_apply_kernel<at::native::FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor<float, 4>>": "AdamW",
    "void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<1>, LpNormFunctor<float, 2>>": "reductions",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, sum_functor>>>": "reductions",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>>": "elementwise",
    "triton_red_fused__to_copy_native_layer_norm_0": "norms",
    "triton_red_fused__fused_rms_norm__to_copy_add_0": "norms",  # Inductor's add + RMSNorm, not a cast
    "triton_per_fused__fused_rms_norm__fused_rms_norm_backward__to_copy_add_view_2": "norms",
    "swiglu_bwd_kernel": "elementwise",
    "triton_poi_fused_add_gelu_3": "GELU",
    "triton_red_fused__log_softmax_nll_loss_forward_1": "cross-entropy",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>": "matmul",
    "Memset (Device)": "other",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
}


@pytest.mark.parametrize("name, want", KERNELS.items())
def test_category(name, want):
    assert trace.category(name) == want


def test_summarize_sums_by_category_and_in_total():
    cats = trace.summarize({"nvjet_a": 2.0, "nvjet_b": 3.0, "triton_poi_fused_add_gelu_3": 1.5, "Memset": 0.5})
    assert cats == {"matmul": 5.0, "GELU": 1.5, "other": 0.5, "all kernels": 7.0}
    assert list(cats)[:3] == ["matmul", "GELU", "other"]  # largest first


def test_kernel_times_leave_out_the_gpu_ranges_of_annotations():
    """A profiler that records the CPU puts record_function ranges (the optimizer step, NCCL's calls) on the GPU's
    timeline beside the kernels they span; summed with them, the AdamW and communication categories doubled."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(key="ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", device_type=cuda,
                              is_user_annotation=False, self_device_time_total=6000.0, self_cpu_time_total=0.0),
              SimpleNamespace(key="nccl:_reduce_scatter_base", device_type=cuda, is_user_annotation=True,
                              self_device_time_total=6000.0, self_cpu_time_total=0.0),
              SimpleNamespace(key="Optimizer.step#AdamW.step", device_type=cuda, is_user_annotation=True,
                              self_device_time_total=9000.0, self_cpu_time_total=0.0),
              SimpleNamespace(key="aten::mm", device_type=cpu, is_user_annotation=False, self_device_time_total=0.0,
                              self_cpu_time_total=3000.0)]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert trace.kernel_times(prof, steps=3) == {"ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": 2.0}
    assert trace.host_times(prof, steps=3) == {"aten::mm": 1.0}


def test_host_ops_of_a_cpu_profile_hold_the_matmul():
    from torch.profiler import ProfilerActivity

    a = torch.randn(256, 256)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            a @ a
    ops = trace.host_times(prof, steps=2)
    assert "aten::mm" in ops and ops["aten::mm"] > 0
    assert list(ops.values()) == sorted(ops.values(), reverse=True)
    summary = trace._host_summary(ops)
    assert summary["host_ms_in_ops"] == pytest.approx(sum(ops.values()))
    assert len(summary["host_ops"]) <= trace.KEEP_HOST_OPS


def test_gc_pauses_count_collections_by_generation():
    with trace.GcPauses() as pauses:
        gc.collect()
        gc.collect(0)
        gc.collect(0)
    g = pauses.summary(steps=2)["gc"]
    assert g["collections_per_step"] == {"0": 1.0, "1": 0.0, "2": 0.5}
    assert 0 < g["longest_ms"] <= g["ms_per_step"] * 2
    assert pauses._on_gc not in gc.callbacks  # closed: later collections are not counted
    assert trace.GcPauses().__enter__().summary(1)["gc"]["longest_ms"] == 0.0


def test_a_gpu_trace_reads_back_as_written(tmp_path):
    events = [{"name": "nvjet_a", "cat": "kernel", "ts": 10.0, "dur": 5.0, "args": {"stream": 7, "grid": [4, 1, 1]}},
              {"name": "Memset (Device)", "cat": "gpu_memset", "ts": 20.0, "dur": 1.0, "args": {"stream": 7}}]
    trace.write_gpu_trace(events, tmp_path / "t" / "rank1.json.gz")
    assert trace.read_gpu_trace(tmp_path / "t" / "rank1.json.gz") == [
        {"name": "nvjet_a", "cat": "kernel", "ts": 10.0, "dur": 5.0, "stream": 7, "grid": [4, 1, 1]},
        {"name": "Memset (Device)", "cat": "gpu_memset", "ts": 20.0, "dur": 1.0, "stream": 7, "grid": None}]


def test_set_values_parse_and_errors_name_the_flag():
    assert profile_step.parse_sets(["fp32_residual=true", "dropout=0.1", "n_layer=2", "attention=sdpa"]) == {
        "fp32_residual": True, "dropout": 0.1, "n_layer": 2, "attention": "sdpa"}
    with pytest.raises(SystemExit, match="expected key=value"):
        profile_step.parse_sets(["fp32_residual"])


def test_inductor_settings_are_checked_against_torch_inductor_config():
    assert profile_step.inductor_settings(["max_pointwise_cat_inputs=1", "force_pointwise_cat=true"]) == {
        "max_pointwise_cat_inputs": 1, "force_pointwise_cat": True}
    with pytest.raises(SystemExit, match="has no setting 'max_cat_inputs'"):
        profile_step.inductor_settings(["max_cat_inputs=1"])
    with pytest.raises(SystemExit, match="max_pointwise_cat_inputs='many': the setting is a int"):
        profile_step.inductor_settings(["max_pointwise_cat_inputs=many"])
    with pytest.raises(SystemExit, match="force_pointwise_cat=1: the setting is a bool"):
        profile_step.inductor_settings(["force_pointwise_cat=1"])
    with pytest.raises(SystemExit, match="expected key=value"):
        profile_step.inductor_settings(["force_pointwise_cat"])


def _row(kernels: dict | None = None, **fields) -> dict:
    """A profile row as profile_step.main writes it: GPT3-1.3B, 2 x 8192, flash eager on "GPU X" unless `fields`
    say otherwise; its categories summed from `kernels` (ms per step by name)."""
    kernels = kernels or {"nvjet_a": 6.0}
    return {"device": "GPU X", "model": "gpt3-1.3b", "seq_len": 8192, "batch": 2, "attention": "flash",
            "compile": False, "set": "", "wall_ms_per_step": 10.0, "categories": trace.summarize(kernels),
            "kernels": kernels, **fields}


def test_an_inductor_row_is_its_own_case_and_says_so(monkeypatch):
    base = _row(model="llama-1b", compile=True)
    patched = {**base, "inductor": "max_pointwise_cat_inputs=1"}
    assert profile_step._key(base) != profile_step._key(patched)
    assert "inductor: max_pointwise_cat_inputs=1 on GPU X" in profile_step.table(patched, top=1).splitlines()[0]
    assert "inductor" not in profile_step.table(base, top=1).splitlines()[0]
    monkeypatch.setattr(profile_step.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="--inductor sets this process's"):
        profile_step.main(["--pipeline", "--inductor", "max_pointwise_cat_inputs=1"])


def test_table_shows_shares_and_largest_kernels():
    row = _row({"nvjet_a": 6.0, "Memset": 2.0}, seq_len=2048, batch=8)
    md = profile_step.table(row, top=1)
    assert "| matmul | 6.0 | 75.0% |" in md and "| all kernels | 8.0 | 100.0% |" in md
    assert "`nvjet_a`" in md and "`Memset`" not in md


def test_table_names_the_strategy_and_the_all_reduce_of_a_multi_gpu_row():
    base = _row(world_size=2, reduce_dtype="fp32", nccl_protocol=None)
    heading = {name: profile_step.table({**base, **fields}, top=1).splitlines()[0]
               for name, fields in (("ddp", {"hook": "average"}), ("copy", {"hook": "copy_engine"}),
                                    ("fsdp", {"strategy": "fsdp", "hook": "average"}),
                                    ("fsdp2", {"strategy": "fsdp2", "hook": "average",
                                               "sharding_strategy": "SHARD_GRAD_OP"}))}
    assert "on 2 × GPU X (DDP, fp32 all-reduce)" in heading["ddp"]
    assert "(DDP, fp32 all-reduce, on the copy engines)" in heading["copy"]
    assert "on 2 × GPU X (FSDP, conf/trainer/strategy/fsdp.yaml)" in heading["fsdp"]
    assert "on 2 × GPU X (FSDP2, conf/trainer/strategy/fsdp2.yaml, SHARD_GRAD_OP)" in heading["fsdp2"]
    rows = [{**base, "hook": "average"}, {**base, "strategy": "fsdp", "hook": "average"},
            {**base, "strategy": "fsdp", "hook": "average", "sharding_strategy": "SHARD_GRAD_OP"},
            {**base, "strategy": "fsdp2", "hook": "average"}]
    assert len({profile_step._key(r) for r in rows}) == 4  # each strategy and sharding is a case of its own


def test_communication_overlap_counts_nccl_time_and_the_part_no_kernel_hides():
    """Two steps: NCCL runs 0-10 µs (hidden by a GEMM over 2-6 and an attention kernel over 5-8) and 20-24 µs
    (alone); a second NCCL kernel over 1-3 runs on its own stream inside the first."""
    kernels = [
        {"name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ts": 0.0, "dur": 10.0, "args": {"grid": [16, 1, 1]}},
        {"name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ts": 1.0, "dur": 2.0, "args": {"grid": [8, 1, 1]}},
        {"name": "nvjet_sm90_tst_256x128", "ts": 2.0, "dur": 4.0, "args": {"grid": [132, 1, 1]}},
        {"name": "flash::flash_bwd_hopper_kernel", "ts": 5.0, "dur": 3.0, "args": {"grid": [64, 16, 2]}},
        {"name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ts": 20.0, "dur": 4.0, "args": {"grid": [16, 1, 1]}},
    ]
    o = trace.communication_overlap(kernels, steps=2)
    assert o["nccl_ms"] == pytest.approx(14e-3 / 2)  # the union: 10 + 4 µs
    assert o["exposed_ms"] == pytest.approx(8e-3 / 2)  # 0-2, 8-10 and 20-24 µs
    assert o["nccl_ctas"] == 16
    assert trace.communication_overlap(kernels[2:4], steps=1) == {"nccl_ms": 0, "exposed_ms": 0, "nccl_ctas": 0}


def test_gpu_timeline_spans_first_to_last_event_and_counts_the_gaps():
    """Two steps: kernels over 0-4 and 3-6 µs, a memset over 8-9, a kernel over 12-20: a span of 20 µs with the
    GPU idle over 6-8 and 9-12."""
    events = [{"ts": 0.0, "dur": 4.0}, {"ts": 3.0, "dur": 3.0}, {"ts": 8.0, "dur": 1.0}, {"ts": 12.0, "dur": 8.0}]
    t = trace.gpu_timeline(events, steps=2)
    assert t["span_ms"] == pytest.approx(20e-3 / 2) and t["idle_ms"] == pytest.approx(5e-3 / 2)
    assert trace.gpu_timeline([], steps=1) == {"span_ms": 0.0, "idle_ms": 0.0}
    row = _row(seq_len=2048, batch=8, timeline={"span_ms": 9.5, "idle_ms": 3.5})
    assert "9.5 ms per step from the first kernel to the last, 3.5 ms of it with nothing running" in \
        profile_step.table(row, top=1)


def test_an_accumulated_row_is_its_own_case_and_says_so(monkeypatch):
    base = _row()
    accumulated = {**base, "accumulation": 8}
    assert profile_step._key(base) != profile_step._key(accumulated)
    assert "2×8192 × 8 micro-batches attention=flash" in profile_step.table(accumulated, top=1).splitlines()[0]
    assert "micro-batches" not in profile_step.table(base, top=1).splitlines()[0]
    monkeypatch.setattr(profile_step.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="--micro-batches 0"):
        profile_step.main(["--micro-batches", "0"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 on 2 GPUs: needs 2 CUDA GPUs")
@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_the_fsdp2_step_accumulates_on_two_gpus(tmp_path, sharding):
    """The bare step in FSDP2 (bench/strategies.fsdp2_wrap) under torchrun, two micro-batches a step, our kernel in
    the blocks (head dim 64): it runs, NCCL and the attention kernels among the profiled ones."""
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "bench" / "profile_step.py"), "--model", "gpt-tiny", "--set", "n_head=2", "--seq-len", "256",
           "--tokens-per-step", "1024", "--micro-batches", "2", "--strategy", "fsdp2", "--sharding-strategy", sharding,
           "--warmup", "2", "--steps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert (row["strategy"], row["sharding_strategy"], row["accumulation"]) == ("fsdp2", sharding, 2)
    assert row["wall_ms_per_step"] > 0
    assert row["categories"]["attention"] > 0 and row["categories"]["communication"] > 0


@pytest.mark.slow
def test_the_pipeline_profiler_covers_the_steps_it_is_asked_for(data_cache, tmp_path):
    """PipelineProfiler in a CPU run of train.py, two micro-batches per optimizer step: it profiles optimizer steps
    2-4 (after two untimed ones), all six of their micro-batches, and writes the summary bench/trace.py makes
    of the bare step (no CUDA kernels on a CPU: the categories sum to zero)."""
    import train as train_mod
    from bench.pipeline_profiler import overrides as profiler
    from run_overrides import compose_train, tiny_run_overrides

    out = tmp_path / "profile.json"
    cfg = compose_train(*tiny_run_overrides(data_cache, tmp_path / "run", "trainer=cpu", "global_batch_tokens=512",
                                            "trainer.max_steps=6", *profiler(out, warmup=2, steps=3)))
    train_mod.train(cfg)
    summary = json.loads(out.read_text())
    assert (summary["first_step"], summary["last_step"], summary["micro_batches"]) == (2, 4, 6)
    assert summary["wall_ms_per_step"] > 0 and summary["categories"] == {"all kernels": 0}
    assert set(summary) >= {"timeline", "kernels", "gc"} and "overlap" not in summary  # one rank: no NCCL to overlap


def test_pipeline_mode_launches_train_with_the_profiler_and_keys_its_row(monkeypatch, tmp_path):
    """--pipeline --gpus 2: `python train.py` with trainer=fsdp2 on two GPUs, the sharding as a strategy setting, and
    PipelineProfiler over the asked steps; its summary becomes a row of its own beside the bare step's."""
    import bench.e2e as e2e

    launched = []

    def launch_train(overrides, run_dir):
        launched.append(overrides)
        out = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("+callbacks.pipeline_profiler.out=")))
        run_dir.mkdir(parents=True, exist_ok=True)  # as launch_train makes it
        out.write_text(json.dumps({"first_step": 2, "last_step": 4, "micro_batches": 6, "wall_ms_per_step": 9.0,
                                         "timeline": {"span_ms": 8.0, "idle_ms": 1.0},
                                         "categories": trace.summarize({"nvjet_a": 6.0}), "kernels": {"nvjet_a": 6.0}}))
        return {}

    monkeypatch.setattr(e2e, "launch_train", launch_train)
    monkeypatch.setattr(profile_step, "PIPELINE_OUT", tmp_path / "run")
    monkeypatch.setattr(profile_step.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profile_step.torch.cuda, "get_device_name", lambda *a: "GPU X")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "profile.json"
    case = ["--model", "gpt-tiny", "--seq-len", "256", "--tokens-per-step", "1024", "--micro-batches", "2",
            "--warmup", "2", "--steps", "3", "--strategy", "fsdp2", "--sharding-strategy", "FULL_SHARD"]
    profile_step.main([*case, "--pipeline", "--gpus", "2", "--out", str(out), "--host", "--trace", str(tmp_path / "t"),
                       "--overrides", "~callbacks.gc"])
    (overrides,) = launched
    assert {"trainer=fsdp2", "trainer.devices=2", "trainer.strategy.sharding_strategy=FULL_SHARD",
            "global_batch_tokens=4096", "trainer.max_steps=5", "+callbacks.pipeline_profiler.host=true",
            f"+callbacks.pipeline_profiler.trace={tmp_path / 't'}"} <= set(overrides)
    assert overrides[-1] == "~callbacks.gc"  # the user's overrides come last
    cfg = e2e._compose([o for o in overrides if not o.startswith("trainer.devices")])
    profiler = cfg.callbacks.pipeline_profiler
    assert (profiler._target_, profiler.warmup, profiler.steps) == ("bench.pipeline_profiler.PipelineProfiler", 2, 3)
    assert "gc" not in cfg.callbacks
    (row,) = json.loads(out.read_text())
    assert (row["mode"], row["world_size"], row["strategy"], row["wall_ms_per_step"]) == ("pipeline", 2, "fsdp2", 9.0)
    assert (row["host"], row["overrides"]) == (True, "~callbacks.gc")
    assert profile_step.table(row, top=1).startswith(
        "pipeline (train.py ~callbacks.gc): gpt-tiny 4×256 × 2 micro-batches")
    for other in ({"mode": "bare"}, {"host": False}, {"overrides": ""}):
        assert profile_step._key(row) != profile_step._key({**row, **other})

    with pytest.raises(SystemExit, match="--overrides are train.py's"):
        profile_step.main([*case, "--overrides", "~callbacks.gc"])
    with pytest.raises(SystemExit, match="--gpus is --pipeline's"):
        profile_step.main([*case, "--gpus", "2"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="--pipeline starts its own ranks"):
        profile_step.main([*case, "--pipeline"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pipeline's profile: needs a CUDA GPU")
@pytest.mark.skipif(not (REPO / ".cache" / "data").is_dir(), reason="the pipeline trains on `make data`'s cache")
@pytest.mark.parametrize("gpus", [1, pytest.param(2, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="the pipeline on 2 GPUs: needs 2 CUDA GPUs"))])
def test_the_pipeline_profile_runs_on_gpus(tmp_path, gpus):
    """`profile_step.py --pipeline`: train.py on one GPU, and on two in FSDP2, two micro-batches a step; the
    profile holds the attention kernels and, on two GPUs, NCCL's."""
    out = tmp_path / "profile.json"
    cmd = [sys.executable, str(REPO / "bench" / "profile_step.py"), "--pipeline", "--gpus", str(gpus),
           "--strategy", "fsdp2", "--model", "gpt-tiny", "--set", "n_head=2", "--seq-len", "256",
           "--tokens-per-step", "1024", "--micro-batches", "2", "--warmup", "2", "--steps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert (row["mode"], row["micro_batches"], row["first_step"], row["last_step"]) == ("pipeline", 4, 2, 3)
    assert row["wall_ms_per_step"] > 0 and row["categories"]["attention"] > 0
    assert (row["categories"].get("communication", 0) > 0) == (gpus == 2)
