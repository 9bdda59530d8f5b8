"""flash_kernel/csrc speaks of the code as it is: no version tags (history lives in docs/CHANGELOG.md) and no
pointers into documents. PTX's vector suffixes (red.global.add.v2.f32, ld.shared.v4) are instruction names. Its
generated file is what its generator writes."""

import importlib.util
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "flash_kernel" / "csrc"
VERSION_TAG = re.compile(r"(?<![.\w])v[0-9]+\b")


def test_csrc_has_no_version_tags_or_doc_pointers():
    files = sorted(p for p in CSRC.iterdir() if p.suffix in {".h", ".cuh", ".cu", ".cpp", ".py"})
    assert len(files) > 20
    found = [f"{p.name}:{n}: {line.strip()}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
             if VERSION_TAG.search(line) or "kernel_notes" in line or "CHANGELOG" in line]
    assert found == []


def test_wgmma_cuh_is_what_gen_wgmma_writes():
    spec = importlib.util.spec_from_file_location("gen_wgmma", CSRC / "gen_wgmma.py")
    gen_wgmma = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_wgmma)
    assert (CSRC / "wgmma.cuh").read_text() == gen_wgmma.render(), "rerun python flash_kernel/csrc/gen_wgmma.py"
