"""bench/e2e.py's bookkeeping on CPU: results merge by case, the table pairs pipeline with bare loop."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location("bench_e2e", Path(__file__).resolve().parents[1] / "bench" / "e2e.py")
e2e = importlib.util.module_from_spec(spec)
spec.loader.exec_module(e2e)


def _row(mode, attention, tokens_per_s, status="ok", compile=False):
    return {"device": "GPU X", "mode": mode, "model": "gpt3-1.3b", "seq_len": 8192, "batch": 2, "attention": attention,
            "compile": compile, "status": status, "tokens_per_s": tokens_per_s, "tflops_per_gpu": tokens_per_s * 1e-3,
            "mfu": 0.5, "peak_mem_gib": 10.0, "step_time_s": 1.0}


def test_merge_replaces_same_case_and_keeps_others(tmp_path):
    path = tmp_path / "e2e.json"
    e2e.merge(path, [_row("pipeline", "sdpa", 100.0), _row("bare", "sdpa", 200.0)])
    rows = e2e.merge(path, [_row("pipeline", "sdpa", 150.0), _row("pipeline", "naive", 0, status="OOM")])
    assert len(rows) == 3
    assert {r["tokens_per_s"] for r in rows if r["attention"] == "sdpa" and r["mode"] == "pipeline"} == {150.0}


def test_table_ratio_oom_and_plot(tmp_path):
    rows = [_row("pipeline", "flash", 190.0), _row("bare", "flash", 200.0), _row("pipeline", "naive", 0, status="OOM")]
    md = e2e.table(rows)
    flash_line = next(line for line in md.splitlines() if "| flash |" in line)
    assert "| 0.950 |" in flash_line and "| 220 |" in flash_line  # ratio, and the FA2 paper's 8k number
    assert "OOM" in next(line for line in md.splitlines() if "| naive |" in line)
    png = tmp_path / "e2e.png"
    e2e.plot(rows, png)
    assert png.stat().st_size > 1000


def test_a_bar_is_the_latest_row_of_its_options():
    """A later run with other model fields (--set) gets a bar of its own and never stands in for the default's; a
    later run of the same options (another kernel version) replaces its bar."""
    default = {**_row("pipeline", "flash", 190.0), "kernel": "v1", "run": "a"}
    fused = {**_row("pipeline", "flash", 195.0), "kernel": "v1", "set": "fused_add_norm=true", "run": "b"}
    newer = {**_row("pipeline", "flash", 192.0), "kernel": "v2", "run": "c"}
    bars = e2e.latest_bars([fused, default])
    assert sorted(r["tokens_per_s"] for r in bars.values()) == [190.0, 195.0]
    bars = e2e.latest_bars([newer, fused, default])
    assert sorted(r["tokens_per_s"] for r in bars.values()) == [192.0, 195.0]


def test_the_figure_places_only_the_bars_a_case_has():
    """bar_layout: a group holds its own variants one unit apart (no slots for variants measured elsewhere), at
    least three units wide, one unit between groups; each group's tick sits at its centre."""
    a, b = ("m", 2048, 8, 1), ("m", 8192, 2, 1)
    cases = [(*a, "flash", False, 1, "single"), (*a, "sdpa", False, 1, "single"), (*a, "flash", True, 1, "single"),
             (*b, "flash", False, 2, "ddp")]
    bars, centres = e2e.bar_layout(cases)
    assert [x for x, _ in bars] == [0.0, 1.0, 2.0, 5.0] and len({case for _, case in bars}) == 4
    assert [case[:4] for _, case in bars] == [a, a, a, b]
    assert centres == [(1.0, a), (5.0, b)]


def test_ratio_only_pairs_rows_of_one_run():
    rows = [{**_row("pipeline", "flash", 190.0), "run": "b"}, {**_row("bare", "flash", 200.0), "run": "a"}]
    flash_line = next(line for line in e2e.table(rows).splitlines() if "| flash |" in line)
    assert "| 200 | – |" in flash_line  # the bare loop is shown, the cross-run ratio is not
    rows[1]["run"] = "b"
    assert "| 0.950 |" in next(line for line in e2e.table(rows).splitlines() if "| flash |" in line)


def test_refuses_to_measure_without_gpu(tmp_path):
    pytest.importorskip("matplotlib")
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="no CUDA device"):
        e2e.main(["--out", str(tmp_path / "e2e.json")])


def test_multi_gpu_rows_show_per_gpu_scaling_against_one_gpu(tmp_path):
    old = _row("pipeline", "flash", 200.0)  # a row written before multi-GPU runs: read as one GPU
    two = {**_row("pipeline", "flash", 194.0), "gpus": 2, "strategy": "ddp", "tokens_per_s_total": 388.0}
    rows = e2e.merge(tmp_path / "e2e.json", [old, two])
    assert len(rows) == 2  # different GPU counts are different cases
    lines = {line.split("|")[7].strip(): line for line in e2e.table(rows).splitlines()[2:]}
    assert set(lines) == {"1", "2 ddp"}
    assert "| 0.970 |" in lines["2 ddp"]  # 194 / 200 tokens/s per GPU
    e2e.plot(rows, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").stat().st_size > 1000
    bare = [{**old, "mode": "bare", "tokens_per_s": 210.0}, {**two, "mode": "bare", "tokens_per_s": 201.6}]
    lines = {line.split("|")[7].strip(): line for line in e2e.table(rows + bare).splitlines()[2:]}
    assert "| 0.970; bare 0.960 |" in lines["2 ddp"]  # 201.6 / 210 beside the pipeline's


def test_a_multi_gpu_row_keeps_the_one_gpu_rate_it_was_measured_against(tmp_path):
    """A one-GPU row measured again later (another machine, another day) leaves the per-GPU ratio of the rows
    merged before it as they were measured; a row of the new invocation scales against the new one-GPU row."""
    path = tmp_path / "e2e.json"
    one, ddp = _row("pipeline", "flash", 200.0), {**_row("pipeline", "flash", 194.0), "gpus": 2, "strategy": "ddp"}
    e2e.merge(path, [{**one, "run": "a"}, {**ddp, "run": "a"}])
    fsdp = {**ddp, "strategy": "fsdp2", "tokens_per_s": 190.0, "run": "b"}
    rows = e2e.merge(path, [{**one, "tokens_per_s": 210.0, "run": "b"}, fsdp])
    by_gpus = {(r.get("gpus", 1), r.get("strategy")): r for r in rows}
    assert by_gpus[(2, "ddp")]["one_gpu_tokens_per_s"] == 200.0 and by_gpus[(2, "ddp")]["one_gpu_run"] == "a"
    assert by_gpus[(2, "fsdp2")]["one_gpu_tokens_per_s"] == 210.0
    lines = {line.split("|")[7].strip(): line for line in e2e.table(rows).splitlines()[2:]}
    assert "| 0.970 |" in lines["2 ddp"] and "| 0.905 |" in lines["2 fsdp2"]  # 194 / 200 and 190 / 210


def test_rows_name_the_residual_stream_they_ran():
    """Rows from the bf16 residual stream are their own case, next to the fp32-stream rows measured before
    (which carry no 'residual' field), in the JSON, the table and the figure."""
    assert e2e.residual_dtype("gpt3-1.3b") == "bf16"  # the model configs' default
    old, new = _row("pipeline", "flash", 190.0), {**_row("pipeline", "flash", 210.0), "residual": "bf16"}
    assert e2e._attention(old) == "flash" and e2e._attention(new) == "flash, bf16 residual"
    assert e2e._key(old) != e2e._key(new)
    md = e2e.table([old, new])
    assert "| flash | no |" in md and "| flash, bf16 residual | no |" in md


def test_rows_name_how_the_blocks_passed_qkv():
    """flash rows whose blocks passed the fused qkv whole are their own case next to the earlier ones."""
    views = {**_row("pipeline", "flash", 210.0), "residual": "bf16"}
    packed = {**views, "qkv": "packed"}
    sdpa = {**_row("pipeline", "sdpa", 211.0), "residual": "bf16", "qkv": "views"}
    assert e2e._attention(packed) == "flash, bf16 residual, qkv packed"
    assert e2e._attention(sdpa) == "sdpa, bf16 residual"  # views: the way every row before ran
    assert e2e._key(views) != e2e._key(packed)
    md = e2e.table([views, packed, sdpa])
    assert "| flash, bf16 residual | no |" in md and "| flash, bf16 residual, qkv packed | no |" in md


def test_rows_record_whether_the_blocks_pack_qkv():
    """GPT-3 presets under flash pass the fused projection whole; the Llama-style preset (GQA, RoPE) passes views."""
    assert e2e.qkv_layout("gpt3-1.3b", "flash") == "packed"
    assert e2e.qkv_layout("gpt3-1.3b", "sdpa") == "views"
    assert e2e.qkv_layout("llama-1b", "flash") == "views"


def test_rows_name_the_fused_options_their_config_turned_on():
    """The GPT3-1.3B, 2.7B and Llama presets run model/fusion.py's options, the GPT3 ones the GELU epilogues too;
    their rows are a case of their own beside the rows measured before, which ran without them and carry no 'fused'
    field."""
    both = ["fused_add_norm", "fused_bias_gelu"]
    gpt3 = [*both, "gelu_epilogue"]
    assert e2e.fused_options("gpt3-1.3b") == gpt3 and e2e.fused_options("gpt3-2.7b") == gpt3
    assert e2e.fused_options("gpt3-125m") == [] and e2e.fused_options("llama-1b") == ["fused_add_norm"]
    assert e2e.fused_options("gpt3-1.3b", ("fused_bias_gelu=false", "gelu_epilogue=false")) == ["fused_add_norm"]
    assert e2e._attention({**_row("pipeline", "flash", 210.0), "fused": gpt3}).endswith(", GELU epilogues")
    assert e2e.fused_options("gpt3-350m", ("fused_add_norm=true",)) == ["fused_add_norm"]
    before = {**_row("pipeline", "flash", 210.0), "kernel": "v35", "residual": "bf16", "qkv": "packed", "loss": "fused"}
    now = {**before, "fused": both}
    assert e2e._attention(now) == "flash v35, bf16 residual, qkv packed, fused loss, fused add + norm, fused bias-GELU"
    assert e2e._key(before) != e2e._key(now)
    md = e2e.table([before, now])
    assert "| flash v35, bf16 residual, qkv packed, fused loss | no |" in md
    assert "| flash v35, bf16 residual, qkv packed, fused loss, fused add + norm, fused bias-GELU | no |" in md


def test_document_mask_rows_are_their_own_case_beside_the_unmasked_ones(tmp_path):
    plain, masked = _row("pipeline", "flash", 210.0), {**_row("pipeline", "flash", 200.0), "document_mask": True}
    assert e2e._attention(masked) == "flash, document mask" and e2e._key(plain) != e2e._key(masked)
    rows = e2e.merge(tmp_path / "e2e.json", [plain, masked])
    assert len(rows) == 2
    md = e2e.table(rows)
    assert "| flash | no |" in md and "| flash, document mask | no |" in md
    assert "data.document_mask=true" in e2e._overrides("gpt3-1.3b", 8192, 2, "flash", False, 10, 5, document_mask=True)
    e2e.plot(rows, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").stat().st_size > 1000


def test_rows_of_another_build_must_be_named_and_stay_apart():
    """FLASH_KERNEL_EXT runs another build: its rows carry --kernel-label and are a case of their own."""
    assert e2e.kernel_label(None, None) == e2e.KERNEL_VERSION
    assert e2e.kernel_label("v32+overlap", "/tmp/b/_C.so") == "v32+overlap"
    with pytest.raises(SystemExit, match="name it with --kernel-label"):
        e2e.kernel_label(None, "/tmp/b/_C.so")
    base = dict(device="d", mode="pipeline", model="m", seq_len=8192, batch=2, attention="flash", compile=False)
    assert e2e._key(dict(base, kernel="v32")) != e2e._key(dict(base, kernel="v32+overlap"))


def test_the_loss_defaults_to_what_train_py_runs():
    """Rows measure the pipeline users launch: --loss defaults to conf/train.yaml's key, and --loss still picks."""
    from omegaconf import OmegaConf

    train_default = OmegaConf.load(Path(e2e.REPO) / "conf" / "train.yaml").loss
    assert e2e.parse_args([]).loss == train_default == "fused"
    assert e2e.parse_args(["--loss", "torch"]).loss == "torch"


def test_micro_batches_hold_the_tokens_per_step_and_refuse_a_remainder():
    assert e2e.batch_and_accumulation(16384, 8192, None) == (2, 1)
    assert e2e.batch_and_accumulation(16384, 8192, 1) == (1, 2)
    assert e2e.batch_and_accumulation(16384, 2048, 2) == (2, 4)
    for micro in (3, 0):  # 16384 is not a whole number of 3 × 2048 tokens; no forward of zero sequences
        with pytest.raises(SystemExit, match="--micro-batch"):
            e2e.batch_and_accumulation(16384, 2048, micro)
    with pytest.raises(SystemExit, match="--micro-batch 3 at T = 2048"):  # before any case runs
        e2e.parse_args(["--seqlens", "2048", "--micro-batch", "3"])


def test_accumulation_reaches_train_py_as_the_global_batch():
    """K micro-batches of B sequences on each of N GPUs: global_batch_tokens = B·T·K·N, which recipe/batch.py turns
    back into K accumulation steps; one forward per step sets no global batch (data.batch_size alone)."""
    one = e2e._overrides("gpt3-2.7b", 8192, 2, "flash", False, 15, 5)
    assert not any(o.startswith("global_batch_tokens") for o in one) and "data.batch_size=2" in one
    acc = e2e._overrides("gpt3-2.7b", 8192, 1, "flash", False, 15, 5, accumulation=2, gpus=2)
    assert "global_batch_tokens=32768" in acc and "data.batch_size=1" in acc


def test_accumulated_rows_are_their_own_case_and_say_so(tmp_path):
    whole = _row("pipeline", "flash", 200.0)
    micro = {**_row("pipeline", "flash", 190.0), "batch": 1, "accumulation": 2}
    rows = e2e.merge(tmp_path / "e2e.json", [whole, micro])
    assert len(rows) == 2
    lines = e2e.table(rows).splitlines()
    assert any("| 8192 | 1 × 2 acc. | flash |" in line and "| 190 |" in line for line in lines)
    assert any("| 8192 | 2 | flash |" in line and "| 200 |" in line for line in lines)
    if importlib.util.find_spec("matplotlib"):
        e2e.plot(rows, tmp_path / "e2e.png")
        assert (tmp_path / "e2e.png").stat().st_size > 1000


def test_set_model_fields_reach_train_py_and_name_their_rows(tmp_path):
    """--set's fields follow the preset in train.py's overrides (and in the labels' config: an fp32 residual set here
    is what the row says); its rows are a case of their own; a malformed item stops before any case runs."""
    args = e2e.parse_args(["--seqlens", "8192", "--set", "fused_bias_gelu=true", "fused_add_norm=true"])
    [sets] = args.variants
    assert sets == ("fused_add_norm=true", "fused_bias_gelu=true")
    overrides = e2e._overrides("gpt3-1.3b", 8192, 2, "flash", False, 15, 5, sets=sets)
    assert overrides[-2:] == ["model.fused_add_norm=true", "model.fused_bias_gelu=true"]
    assert e2e.residual_dtype("gpt3-1.3b", ("fp32_residual=true",)) == "fp32"
    assert e2e.residual_dtype("gpt3-1.3b") == "bf16"
    plain = _row("pipeline", "flash", 200.0)
    fused = {**_row("pipeline", "flash", 204.0), "set": " ".join(sets)}
    rows = e2e.merge(tmp_path / "e2e.json", [plain, fused])
    assert len(rows) == 2
    assert e2e._attention(fused) == "flash, fused_add_norm=true fused_bias_gelu=true"
    with pytest.raises(SystemExit, match="expected key=value"):
        e2e.parse_args(["--set", "fused_add_norm"])


def test_rounds_combine_to_medians_and_a_failed_round_is_the_result():
    runs = [{"status": "ok", "tokens_per_s": t, "mfu": t / 1000, "peak_mem_gib": m}
            for t, m in ((100.0, 10.0), (104.0, 9.0), (101.0, 11.0))]
    row = e2e.combine_rounds(runs)
    assert row == {"status": "ok", "rounds": [100.0, 104.0, 101.0], "tokens_per_s": 101.0, "mfu": 0.101,
                   "peak_mem_gib": 11.0}
    assert e2e.combine_rounds(runs[:1]) == runs[0]  # one round: the run as it is, no 'rounds'
    assert e2e.combine_rounds([*runs, {"status": "OOM"}]) == {"status": "OOM"}


def _measured(tokens_per_s):
    """run_case's result for a case that ran."""
    t = tokens_per_s
    return {"status": "ok", "tokens_per_s": t, "tflops_per_gpu": t, "mfu": t / 1000, "peak_mem_gib": 1.0}


@pytest.fixture
def one_fake_gpu(monkeypatch):
    """main() on a CPU as if one GPU were there (run_case is the test's), with no figure drawn."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU X")
    monkeypatch.setattr(e2e, "can_plot", lambda script: False)


def test_rounds_alternate_the_cases_and_skip_what_ran_out_of_memory(tmp_path, monkeypatch, one_fake_gpu):
    """--rounds 2 runs sdpa, flash, naive, then again: the table shows medians; naive, out of memory in round 1, is not
    run again."""
    order, rates = [], {"sdpa": iter([100.0, 102.0]), "flash": iter([110.0, 106.0])}

    def fake_run_case(mode, model, T, B, attn, *rest):
        order.append(attn)
        if attn == "naive":
            return {"status": "OOM"}
        return _measured(next(rates[attn]))

    monkeypatch.setattr(e2e, "run_case", fake_run_case)
    out = tmp_path / "e2e.json"
    e2e.main(["--models", "gpt3-125m", "--seqlens", "1024", "--attentions", "naive", "sdpa", "flash",
              "--modes", "pipeline", "--rounds", "2", "--out", str(out)])
    assert order == ["sdpa", "flash", "naive", "sdpa", "flash"]
    rows = {r["attention"]: r for r in json.loads(out.read_text())}
    assert rows["flash"]["tokens_per_s"] == 108.0 and rows["flash"]["rounds"] == [110.0, 106.0]
    assert rows["sdpa"]["tokens_per_s"] == 101.0 and rows["naive"]["status"] == "OOM"
    with pytest.raises(SystemExit, match="--rounds 0"):
        e2e.parse_args(["--rounds", "0"])


def test_vs_runs_a_second_variant_of_every_case_in_turn(tmp_path, monkeypatch, one_fake_gpu):
    """--vs adds a variant with more model fields (after --set's, its value winning a shared key); every round runs
    the default and the variant one after the other, and each variant's rows are a case of their own."""
    assert e2e.variants(["fp32_residual=true"], ["fused_add_norm=true", "fp32_residual=false"]) == [
        ("fp32_residual=true",), ("fp32_residual=false", "fused_add_norm=true")]
    assert e2e.variants([], []) == [()]
    order, rates = [], {(): iter([100.0, 104.0]), ("fused_add_norm=true",): iter([110.0, 106.0])}

    def fake_run_case(mode, model, T, B, attn, comp, warmup, steps, gpus, strategy, loss, docs, K, sets, strategy_sets):
        order.append(sets)
        return _measured(next(rates[sets]))

    monkeypatch.setattr(e2e, "run_case", fake_run_case)
    out = tmp_path / "e2e.json"
    e2e.main(["--models", "gpt3-125m", "--seqlens", "1024", "--attentions", "flash", "--modes", "pipeline",
              "--rounds", "2", "--vs", "fused_add_norm=true", "--out", str(out)])
    assert order == [(), ("fused_add_norm=true",)] * 2
    rows = {r.get("set"): r for r in json.loads(out.read_text())}
    assert rows[None]["tokens_per_s"] == 102.0 and rows["fused_add_norm=true"]["tokens_per_s"] == 108.0
    with pytest.raises(SystemExit, match="expected key=value"):
        e2e.parse_args(["--vs", "fused_add_norm"])


def test_the_multi_gpu_bare_loop_runs_under_torchrun_and_reads_rank_0s_line(monkeypatch):
    """run_bare_multi starts torchrun on this script with the case as JSON, and reads the result line rank 0
    prints; a rank out of memory is the case's OOM, a world that ends without a result is an error."""
    import subprocess

    calls = []

    def fake_run(stdout_lines, returncode=0):
        def run(cmd, **kwargs):
            calls.append(cmd)
            return subprocess.CompletedProcess(cmd, returncode, stdout="\n".join(stdout_lines), stderr="boom")
        return run

    result = {"tokens_per_s": 100.0, "tflops_per_gpu": 1.0, "mfu": 0.5, "peak_mem_gib": 2.0, "step_time_s": 0.1}
    monkeypatch.setattr(e2e.subprocess, "run", fake_run(["NCCL INFO ...", e2e.BARE_RESULT + json.dumps(result)]))
    out = e2e.run_bare_multi("gpt3-1.3b", 8192, 2, "flash", False, 5, 10, 2, "fsdp", "fused", 1, ("fused_add_norm=true",))
    assert out == result
    cmd = calls[-1]
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert cmd[5].endswith("bench/e2e.py") and cmd[6] == "--bare-rank"
    spec = json.loads(cmd[7])
    assert spec == {"model": "gpt3-1.3b", "seq_len": 8192, "batch": 2, "attention": "flash", "compile": False,
                    "warmup": 5, "steps": 10, "strategy": "fsdp", "loss": "fused", "accumulation": 1,
                    "sets": ["fused_add_norm=true"], "strategy_sets": []}
    assert e2e.parse_args(["--bare-rank", cmd[7]]).bare_rank == cmd[7]  # what each rank parses

    monkeypatch.setattr(e2e.subprocess, "run", fake_run([e2e.BARE_RESULT + '{"status": "OOM"}'], returncode=1))
    with pytest.raises(e2e.TrainingOutOfMemory):
        e2e.run_bare_multi("gpt3-1.3b", 8192, 2, "flash", False, 5, 10, 2, "ddp")
    monkeypatch.setattr(e2e.subprocess, "run", fake_run([], returncode=1))
    with pytest.raises(RuntimeError, match="exited 1: boom"):
        e2e.run_bare_multi("gpt3-1.3b", 8192, 2, "flash", False, 5, 10, 2, "ddp")


def test_several_gpus_run_the_bare_loop_beside_the_pipeline(tmp_path, monkeypatch, one_fake_gpu):
    """With --gpus 2 both modes run on two GPUs, and the table pairs them (pipeline / bare) as on one GPU; the rows
    name the GPU0-GPU1 link."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(e2e, "gpu_info", lambda: {"gpu": "GPU X", "gpus": 2, "interconnect": "NV18"})
    ran = []

    def fake_run_case(mode, model, T, B, attn, comp, warmup, steps, gpus, strategy, *rest):
        ran.append((mode, gpus, strategy))
        return _measured({"pipeline": 95.0, "bare": 100.0}[mode])

    monkeypatch.setattr(e2e, "run_case", fake_run_case)
    out = tmp_path / "e2e.json"
    e2e.main(["--models", "gpt3-125m", "--seqlens", "1024", "--attentions", "flash", "--gpus", "2",
              "--strategy", "fsdp", "--out", str(out)])
    assert ran == [("pipeline", 2, "fsdp"), ("bare", 2, "fsdp")]
    line = e2e.table(json.loads(out.read_text())).splitlines()[2]
    assert "| 2 fsdp, NV18 |" in line and "| 0.950 |" in line  # pipeline / bare


def test_a_strategy_setting_reaches_both_modes_and_makes_its_own_rows(tmp_path, monkeypatch, one_fake_gpu):
    """--strategy-set: train.py gets trainer.strategy.<key>=<value> (and composes it), the bare loop's ranks the
    same settings; the rows are cases of their own beside the default's, scaled against the one-GPU row."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(e2e, "gpu_info", lambda: {"gpu": "GPU X", "gpus": 2, "interconnect": "NV18"})
    launched, specs = [], []
    monkeypatch.setattr(e2e, "launch_train", lambda overrides, run_dir: launched.append(overrides) or {})
    monkeypatch.setattr(e2e, "rates", lambda metrics: _measured(90.0))
    monkeypatch.setattr(e2e, "run_bare_multi", lambda *a, **k: specs.append(a) or _measured(100.0))
    monkeypatch.setattr(e2e, "run_pipeline", lambda *a: _measured(96.0))
    monkeypatch.setattr(e2e, "run_bare", lambda *a: _measured(100.0))
    monkeypatch.setattr(e2e, "_free_cuda", lambda: None)
    out = tmp_path / "e2e.json"
    e2e.main(["--models", "gpt3-125m", "--seqlens", "1024", "--attentions", "sdpa", "--gpus", "1", "2",
              "--strategy", "fsdp", "--strategy-set", "sharding_strategy=SHARD_GRAD_OP", "--out", str(out)])
    (overrides,) = launched
    assert "trainer.strategy.sharding_strategy=SHARD_GRAD_OP" in overrides
    cfg = e2e._compose([o for o in overrides if not o.startswith(("trainer.devices", "callbacks.perf"))])
    assert cfg.trainer.strategy.sharding_strategy == "SHARD_GRAD_OP"
    assert specs[0][-1] == ("sharding_strategy=SHARD_GRAD_OP",)  # the bare loop's ranks: run_bare_multi's last
    rows = json.loads(out.read_text())
    assert {(r["gpus"], r.get("strategy_set")) for r in rows} == {(1, None), (2, "sharding_strategy=SHARD_GRAD_OP")}
    line = next(line for line in e2e.table(rows).splitlines() if "SHARD_GRAD_OP" in line)
    assert "| 2 fsdp sharding_strategy=SHARD_GRAD_OP, NV18 |" in line and "| 0.900 | 0.938; bare 1.000 |" in line

    with pytest.raises(SystemExit, match="the bare loop does not run state_dict_type"):
        e2e.parse_args(["--gpus", "2", "--strategy", "fsdp", "--strategy-set", "state_dict_type=full"])
    e2e.parse_args(["--gpus", "2", "--strategy", "fsdp", "--strategy-set", "state_dict_type=full", "--modes",
                    "pipeline"])
    with pytest.raises(SystemExit, match="give --gpus N > 1"):
        e2e.parse_args(["--strategy-set", "bucket_cap_mb=100"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the bare loop on 2 GPUs: needs 2 CUDA GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_bare_loop_trains_on_two_gpus(strategy):
    out = e2e.run_bare_multi("gpt-tiny", 256, 4, "sdpa", False, 2, 4, 2, strategy, timeout=300)
    assert out["tokens_per_s"] > 0 and out["peak_mem_gib"] > 0 and 0 < out["mfu"] < 1
