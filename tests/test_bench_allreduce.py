"""bench/allreduce.py's bookkeeping on CPU: each protocol's torchrun world gets its NCCL_PROTO, rank 0's JSON lines
become rows, NCCL's transport lines are kept, and a machine without two GPUs is told so."""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "bench_allreduce", Path(__file__).resolve().parents[1] / "bench" / "allreduce.py")
allreduce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allreduce)


def test_each_protocol_runs_in_its_own_world_and_its_rows_and_transport_come_back(monkeypatch):
    seen = []
    row = {"dtype": "fp32", "mb": 25.0, "ms": 0.175, "algbw_gbs": 149.5, "busbw_gbs": 149.5}

    def fake_run(cmd, cwd, env, capture_output, text, timeout):
        seen.append((cmd, env.get("NCCL_PROTO")))
        log = ("host:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM\n"
               "host:1:1 [0] NCCL INFO 24 coll channels, 24 collnet channels, 0 nvls channels\n"
               "host:1:1 [0] NCCL INFO Bootstrap timings total 0.001\n")
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(row) + "\n", stderr=log)

    monkeypatch.setattr(allreduce.subprocess, "run", fake_run)
    monkeypatch.setenv("NCCL_PROTO", "LL")  # the caller's own setting must not leak into "auto"
    args = allreduce.argparse.Namespace(sizes_mb=[25.0], dtypes=["fp32"], warmup=1, iters=2, timeout=10)
    rows, transport = allreduce.run_protocol("auto", 2, args)
    assert rows == [row] and seen[-1][1] is None
    assert transport == ["24 coll channels, 24 collnet channels, 0 nvls channels", "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM"]
    allreduce.run_protocol("Simple", 2, args)
    cmd, proto = seen[-1]
    assert proto == "Simple" and "--nproc_per_node=2" in cmd and cmd[cmd.index("--sizes-mb") + 1] == "25.0"


def test_a_failed_world_and_a_single_gpu_are_named(monkeypatch):
    monkeypatch.setattr(allreduce.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ncclInternalError"))
    args = allreduce.argparse.Namespace(sizes_mb=[1.0], dtypes=["bf16"], warmup=1, iters=1, timeout=10)
    with pytest.raises(SystemExit, match="NCCL_PROTO=LL128: torchrun exited 1"):
        allreduce.run_protocol("LL128", 2, args)
    monkeypatch.setattr(allreduce.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match="needs 2 or more GPUs"):
        allreduce.main([])


def test_rows_merge_by_machine_protocol_dtype_and_size(tmp_path):
    out = tmp_path / "allreduce.json"
    base = {"gpu": "GPU X", "gpus": 2, "torch": "t", "nccl": "n", "date": "d", "dtype": "fp32", "algbw_gbs": 1.0,
            "busbw_gbs": 1.0}
    allreduce.merge(out, [{**base, "protocol": "auto", "mb": 25.0, "ms": 0.2},
                          {**base, "protocol": "Simple", "mb": 25.0, "ms": 0.1}])
    rows = allreduce.merge(out, [{**base, "protocol": "auto", "mb": 25.0, "ms": 0.3},
                                 {**base, "gpu": "GPU Y", "protocol": "auto", "mb": 25.0, "ms": 0.4}])
    assert sorted((r["gpu"], r["protocol"], r["ms"]) for r in rows) == [
        ("GPU X", "Simple", 0.1), ("GPU X", "auto", 0.3), ("GPU Y", "auto", 0.4)]
    md = allreduce.table(rows, "GPU X", 2).splitlines()
    assert md[2].startswith("| auto | fp32 | 25 | 0.300 |") and md[3].startswith("| Simple |") and len(md) == 4
