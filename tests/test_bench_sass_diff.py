"""bench/sass_diff.py on SASS listings written here: identical code, the same code under another register
allocation, an instruction moved or added (branch targets as labels, so the addresses behind it do not count), a
kernel without a pair, and --check's exit status."""

from __future__ import annotations

import shutil

import pytest

from bench import sass_diff as sd
from bench.sass_mix import parse_sass

HEADER = "\tcode for sm_90a\n"


def listing(functions: dict[str, list[str]]) -> str:
    """A `cuobjdump -sass` listing of the given functions (mangled name -> instructions, addresses every 0x10). An
    item "Lk:" marks the next instruction, and "=>Lk" in an instruction stands for that instruction's address, as the
    compiler would write it wherever the code moved."""
    out = [HEADER]
    for name, items in functions.items():
        code = [text for text in items if not text.endswith(":")]
        marks, n = {}, 0
        for text in items:
            if text.endswith(":"):
                marks[text[:-1]] = n
            else:
                n += 1
        out.append(f"\t\tFunction : {name}\n")
        for i, text in enumerate(code):
            for mark, at in marks.items():
                text = text.replace(f"=>{mark}", f"{16 * at:#x}")
            out.append(f"        /*{16 * i:04x}*/                   {text} ;  /* 0x000fe20000000800 */\n")
    return "".join(out)


# A loop (0x10-0x40) inside a convergence region that ends at 0x50, then a second function.
KERNEL = [
    "S2R R0, SR_TID.X",
    "L0:",
    "IADD3 R2, R0, 0x1, RZ",
    "BSSY B0, =>L1",
    "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR8], R152",
    "@!P0 BRA =>L0",
    "L1:",
    "STG.E.128 desc[UR10][R24.64], R8",
    "EXIT",
]
OTHER = ["MOV R1, 0x2", "EXIT"]
NAMES = ("_ZN5flash6kernelILi128EEEvv", "_ZN5flash5otherEv")


def parse(text: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """(mangled name, [(address, instruction)]) per function, predicates kept: what sass_diff reads."""
    return [(k.name, k.code) for k in parse_sass(text, keep_predicates=True)]


def compare(old: list[str], new: list[str]) -> sd.Comparison:
    a = parse(listing({NAMES[0]: old}))[0]
    b = parse(listing({NAMES[0]: new}))[0]
    return sd.compare("k", sd.Listing(a[0], a[0], a[1]), sd.Listing(b[0], b[0], b[1]))


def test_parse_keeps_predicates_and_addresses():
    [(name, code)] = parse(listing({NAMES[0]: KERNEL}))
    assert name == NAMES[0]
    assert code[4] == (0x40, "@!P0 BRA 0x10")
    assert code[2] == (0x20, "BSSY B0, 0x50")
    assert len(code) == 7


def test_branch_targets_become_labels_before_their_instruction():
    lines = sd.labelled(parse(listing({NAMES[0]: KERNEL}))[0][1])
    assert lines[1] == "L0:" and lines[2].startswith("IADD3")  # 0x10, the loop's head
    assert "@!P0 BRA L0" in lines and "BSSY B0, L1" in lines
    assert lines[lines.index("L1:") + 1].startswith("STG")   # 0x50, BSSY's reconvergence point


def test_identical():
    c = compare(KERNEL, list(KERNEL))
    assert c.verdict == "identical" and c.diff == []


def test_another_register_allocation_is_renamed():
    permuted = [line.replace("R0,", "R7,").replace("R0 ", "R7 ").replace("R2,", "R0,") for line in KERNEL]
    permuted = [line.replace("R152", "R24").replace("R24.64", "R152.64") for line in permuted]
    assert permuted != KERNEL
    c = compare(KERNEL, permuted)
    assert c.verdict == "renamed"


def test_a_register_reused_differently_is_not_renamed():
    # R2 becomes R0: the IADD3 now overwrites the thread index that the old code kept; same shape, other dataflow.
    changed = [line.replace("IADD3 R2, R0", "IADD3 R0, R0") for line in KERNEL]
    c = compare(KERNEL, changed)
    assert c.verdict not in ("identical", "renamed")


def test_an_added_instruction_is_one_line_though_every_address_behind_it_moves():
    added = KERNEL[:3] + ["NOP"] + KERNEL[3:]  # inside the loop: the branches' addresses move
    c = compare(KERNEL, added)
    assert c.verdict == "1 line apart"
    assert c.diff == ["+NOP"]


def test_two_instructions_swapped_count_twice():
    swapped = KERNEL[:7] + [KERNEL[8], KERNEL[7]]
    c = compare(KERNEL, swapped)
    assert c.verdict == "2 lines apart"
    assert sorted(line[0] for line in c.diff) == ["+", "-"] and c.diff[0][1:] == c.diff[1][1:]


def test_a_loop_moved_by_code_before_it_is_the_same_loop_elsewhere_in_its_line():
    # One instruction before the loop: every address from the loop on moves by 16 bytes, the BSSY's target (past the
    # loop) with them, so the loop is the same code, 16 bytes further into its 128-byte line.
    c = compare(KERNEL, KERNEL[:1] + ["NOP"] + KERNEL[1:])
    assert c.verdict == "1 line apart"
    assert c.loop == "the same, at 16 -> 32"
    assert compare(KERNEL, list(KERNEL)).loop == "the same, at 16"


def test_a_loop_with_an_instruction_more_or_a_target_moved_is_not_the_same_loop():
    inside = KERNEL[:3] + ["NOP"] + KERNEL[3:]
    assert compare(KERNEL, inside).loop == "1 line apart, at 16"
    # An instruction between the loop and the BSSY's target: the loop's code is the same but that branch reaches
    # 16 bytes further.
    after = KERNEL[:6] + ["NOP"] + KERNEL[6:]
    assert compare(KERNEL, after).loop == "2 lines apart, at 16"


def test_a_kernel_without_a_loop_has_no_loop_to_compare():
    c = compare(OTHER, OTHER)
    assert c.verdict == "identical" and c.loop == "-"


def test_kernels_without_a_pair_and_check(tmp_path, capsys):
    old = tmp_path / "old.sass"
    new = tmp_path / "new.sass"
    old.write_text(listing({NAMES[0]: KERNEL}))
    new.write_text(listing({NAMES[0]: KERNEL, NAMES[1]: OTHER}))
    assert sd.main([str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "| identical | the same, at 16 |" in out and "| only in new | - |" in out
    assert sd.main([str(old), str(new), "--check"]) == 1
    assert sd.main([str(old), str(old), "--check"]) == 0


def test_report_shows_the_first_differing_lines(tmp_path, capsys):
    old = tmp_path / "old.sass"
    new = tmp_path / "new.sass"
    old.write_text(listing({NAMES[0]: KERNEL}))
    new.write_text(listing({NAMES[0]: KERNEL[:3] + ["NOP", "NOP", "NOP"] + KERNEL[3:]}))
    assert sd.main([f"v1={old}", f"v2={new}", "--show", "2", "--check"]) == 1
    out = capsys.readouterr().out
    assert "| 7 | 10 | 3 lines apart |" in out
    assert "v1 instructions" in out and "(- v1, + v2)" in out
    assert out.count("+NOP") == 2 and "... 1 more" in out


def test_kernel_filter_and_no_match(tmp_path):
    path = tmp_path / "k.sass"
    path.write_text(listing({NAMES[0]: KERNEL, NAMES[1]: OTHER}))
    found = sd.listings(path, "other")
    assert [x.name for x in found.values()] == [NAMES[1]]
    with pytest.raises(SystemExit, match="no kernel matches"):
        sd.main([str(path), str(path), "--kernel", "nothing_named_so"])
    with pytest.raises(SystemExit, match="no such file"):
        sd.main([str(path), str(tmp_path / "missing.sass")])


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt (binutils) is not on PATH")
def test_a_kernel_that_gains_a_parameter_keeps_its_pair(tmp_path, capsys):
    old = tmp_path / "old.sass"
    new = tmp_path / "new.sass"
    old.write_text(listing({"_ZN5flash6kernelILi128EEEvi": KERNEL}))
    new.write_text(listing({"_ZN5flash6kernelILi128EEEvif": KERNEL}))
    assert sd.main([str(old), str(new), "--check"]) == 0
    assert "| identical |" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt (binutils) is not on PATH")
def test_kernels_of_anonymous_namespaces_pair_by_name(tmp_path, capsys):
    """A standalone .cu file's kernels live in an anonymous namespace whose mangled name carries the file's name and
    a hash: two builds of it pair by the readable names, each kernel with its own, and a changed one is found."""
    def name(scope: str, rows: int) -> str:
        return f"_ZN{len(scope)}{scope}8tma_loopILi{rows}EEEvNS_8TileMapsEPxi"
    old_scope, new_scope = "_GLOBAL__N__0a78281a_9_lr_old_cu_main", "_GLOBAL__N__64a231c2_15_layout_rates_cu_main"
    old = tmp_path / "old.sass"
    new = tmp_path / "new.sass"
    old.write_text(listing({name(old_scope, 64): KERNEL, name(old_scope, 16): OTHER}))
    new.write_text(listing({name(new_scope, 64): KERNEL, name(new_scope, 16): OTHER}))
    assert sd.main([str(old), str(new), "--check"]) == 0
    out = capsys.readouterr().out
    assert "`(anonymous namespace)::tma_loop<64>`" in out and "`(anonymous namespace)::tma_loop<16>`" in out
    new.write_text(listing({name(new_scope, 64): KERNEL, name(new_scope, 16): ["NOP", *OTHER]}))
    assert sd.main([str(old), str(new), "--check"]) == 1


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt (binutils) is not on PATH")
def test_overloads_that_read_the_same_keep_one_row_each(tmp_path):
    path = tmp_path / "k.sass"
    path.write_text(listing({"_ZN5flash5otherEv": OTHER, "_ZN5flash5otherEi": KERNEL}))
    found = sd.listings(path, "other")
    assert sorted(found) == ["flash::other [_ZN5flash5otherEi]", "flash::other [_ZN5flash5otherEv]"]


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt (binutils) is not on PATH")
def test_rename_pairs_kernels_whose_template_arguments_changed(tmp_path, capsys):
    """A kernel whose traits gained two template arguments has no pair by name; --rename dropping them pairs it, and
    a rename that makes two kernels one name is refused."""
    old = tmp_path / "old.sass"
    new = tmp_path / "new.sass"
    old.write_text(listing({"_ZN5flash6kernelINS_6TraitsILi80ELi128EEEEEvv": KERNEL}))
    new.write_text(listing({"_ZN5flash6kernelINS_6TraitsILi80ELi128ELi96ELi64EEEEEvv": KERNEL,
                            "_ZN5flash6kernelINS_6TraitsILi80ELi128ELi80ELi128EEEEEvv": OTHER}))
    assert sd.main([str(old), str(new), "--check"]) == 1
    capsys.readouterr()
    drop_96_64 = ["--rename", r"(Traits<\d+, \d+), 96, 64>", r"\1>"]
    assert sd.main([str(old), str(new), "--check", *drop_96_64]) == 1  # the other kernel has no pair
    out = capsys.readouterr().out
    assert "| `flash::kernel<flash::Traits<80, 128> >` | 7 | 7 | identical |" in out
    with pytest.raises(SystemExit, match="makes two kernels"):
        sd.main([str(old), str(new), "--rename", r"(Traits<\d+, \d+), \d+, \d+>", r"\1>"])
