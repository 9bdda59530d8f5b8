"""The kernels' build switches (docs/kernel_design.md, "Build switches") compile, and compile to what they claim.

Each switch selects, with `if constexpr`, one of two schedules or tiles, and the default build discards the other
unchecked, so nothing else compiles it until a GPU build does. Here nvcc compiles the affected Hopper
instantiations to PTX (no ptxas, a few seconds each) with and without the switch: with it, the source must
compile, and a schedule switch must wait for one wgmma group while another is in flight (`wgmma.wait_group.sync.aligned
1`: S_j before the warpgroup's own P V in the forward, dV and dQ_i before dK in the backward), a tile switch must
issue its wgmma shape (or, for a switch of warpgroups, carry its launch bound); without it, neither. A build that
names no switch is the build with each switch at the default docs/kernel_design.md gives it.
"""

import re

import pytest

SWITCHES = {  # switch -> (an instantiation file whose schedule it changes, its default, other switches held)
    # the file's 128-key tiles (below 2k keys) take the overlap from the next switch: held off
    "FLASH_FWD_INTRA_WG_OVERLAP": ("flash_fwd_hdim128_bf16.cu", 1, ["FLASH_FWD_INTRA_WG_OVERLAP_BC128=0"]),
    # hd96's 192-key tile and its three-warpgroup tiles run the overlap whatever this switch says: all held off,
    # the file has only 128-key tiles of two warpgroups
    "FLASH_FWD_INTRA_WG_OVERLAP_BC128": ("flash_fwd_hdim96_bf16.cu", 1,
                                         ["FLASH_FWD_HD96_BC192=0", "FLASH_FWD_HD96_P_SMEM=0",
                                          "FLASH_FWD_HD80_CAUSAL_3WG=0"]),
    "FLASH_FWD_INTRA_WG_OVERLAP_HD64": ("flash_fwd_hdim64_bf16.cu", 1, []),
    "FLASH_BWD_DQ_BEFORE_DK": ("flash_bwd_hdim128_bf16.cu", 1, []),
}
WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned (\d+);")


def _waits(ptx: str) -> dict[int, int]:
    """{N: count} of `wgmma.wait_group N` in the PTX."""
    waits: dict[int, int] = {}
    for n in WAIT.findall(ptx):
        waits[int(n)] = waits.get(int(n), 0) + 1
    return waits


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_a_switch_compiles_and_waits_for_one_group_while_another_runs(switch, device_ptx):
    source, default, held = SWITCHES[switch]
    off, on = device_ptx.each(source, [f"{switch}=0", *held], [f"{switch}=1", *held])
    assert _waits(off).get(0) and not _waits(off).get(1), _waits(off)
    assert _waits(on).get(0) and _waits(on).get(1), _waits(on)
    assert device_ptx(source, held) == (on if default else off), f"{switch}'s default is not {default}"


WGMMA = "wgmma.mma_async.sync.aligned."
DESC_IMMEDIATE = re.compile(r"or\.b64\s+%rd\d+, %rd\d+, (-\d+);|mov\.u32\s+%r\d+, (-2147483616);")


def has_sw64_desc(ptx: str) -> bool:
    """Whether the PTX builds a wgmma descriptor of the SW64 layout: layout type 2 in bits 62-63, a 64-bit immediate
    with bit 63 set and bit 62 clear (SW32's type 3 sets both; SW128's 1, bit 62 alone, is positive); under
    FLASH_WGMMA_DESC_PAIR its high word, 0x80000020 (layout type 2, the 512-byte atom as stride)."""
    return any(pair or (int(wide) & (2**64 - 1)) >> 62 == 2 for wide, pair in DESC_IMMEDIATE.findall(ptx))


def splits_n80(ptx: str) -> bool:
    """Whether the backward's hd65-80 twins run 80-wide tiles: dV and dK as n64 + n16 wgmmas over the SW128 and SW32
    blocks, which the 128-wide tiles issue as n80. An n16 alone does not tell them apart: the twins' dQ rows of 80
    floats give the second dQ warpgroup an n16 on either tile."""
    return WGMMA + "m64n16k16" in ptx and WGMMA + "m64n80k16" not in ptx


TMA_STORE = "cp.async.bulk.tensor.4d.global.shared::cta"  # a TMA store of a tile (dK_j or dV_j) from shared memory
TILE_SWITCHES = [  # (switch, an instantiation file whose tiles it changes, its default, the PTX that marks them,
    #  other switches held: FLASH_FWD_NARROW_PV, FLASH_BWD_NARROW_DKV and FLASH_BWD_NARROW_DQ narrow the 128-wide
    #  tiles only, which FLASH_FWD_HD96_SW64 and FLASH_BWD_HD96_SW64 replace at hd96)
    ("FLASH_FWD_NARROW_PV", "flash_fwd_hdim96_bf16.cu", 1, WGMMA + "m64n96k16", ["FLASH_FWD_HD96_SW64=0"]),
    ("FLASH_BWD_NARROW_DKV", "flash_bwd_hdim96_bf16.cu", 1, WGMMA + "m64n96k16", ["FLASH_BWD_HD96_SW64=0"]),
    ("FLASH_FWD_HD96_BC192", "flash_fwd_hdim96_bf16.cu", 1, WGMMA + "m64n192k16", []),
    # the backward's twins on FLASH_HD80_TAIL's tiles split their n80 products (next row): held off
    ("FLASH_NARROW_HD80", "flash_fwd_hdim96_bf16.cu", 1, WGMMA + "m64n80k16", []),
    ("FLASH_NARROW_HD80", "flash_bwd_hdim96_bf16.cu", 1, WGMMA + "m64n80k16", ["FLASH_HD80_TAIL=0"]),
    # 80-wide tiles: O += P V, dV, dK and the second dQ warpgroup take an n16 wgmma over the SW32 block
    ("FLASH_HD80_TAIL", "flash_fwd_hdim96_bf16.cu", 1, WGMMA + "m64n16k16", []),
    ("FLASH_HD80_TAIL", "flash_bwd_hdim96_bf16.cu", 1, splits_n80, []),
    # a producer + 3 consumers; the causal hd80 tile has them too
    ("FLASH_FWD_HD96_P_SMEM", "flash_fwd_hdim96_bf16.cu", 1, ".maxntid 512, 1, 1", ["FLASH_FWD_HD80_CAUSAL_3WG=0"]),
    ("FLASH_BWD_NARROW_DQ", "flash_bwd_hdim96_bf16.cu", 1, WGMMA + "m64n32k16", ["FLASH_BWD_HD96_SW64=0"]),
    # the 144-key tiles: hd80's causal one and hd96's dense non-causal one, each with the other held off
    ("FLASH_FWD_HD80_CAUSAL_3WG", "flash_fwd_hdim96_bf16.cu", 1, WGMMA + "m64n144k16", ["FLASH_FWD_HD96_BC144=0"]),
    ("FLASH_FWD_HD96_BC144", "flash_fwd_hdim96_bf16.cu", 1, WGMMA + "m64n144k16", ["FLASH_FWD_HD80_CAUSAL_3WG=0"]),
    ("FLASH_FWD_HD96_SW64", "flash_fwd_hdim96_bf16.cu", 1, has_sw64_desc, []),
    ("FLASH_BWD_HD96_SW64", "flash_bwd_hdim96_bf16.cu", 1, has_sw64_desc, []),
    # not a tile: the persistent hd64 backward, whose dK_j and dV_j leave by TMA stores (one block per tile: threads')
    ("FLASH_BWD_PERSISTENT", "flash_bwd_hdim64_bf16.cu", 1, TMA_STORE, []),
    # not a tile: the blocks' phase stamps (block_trace.h), read from the global timer
    ("FLASH_BWD_TRACE", "flash_bwd_hdim128_bf16.cu", 0, "%globaltimer", []),
]


@pytest.mark.parametrize("switch, source, default, mark, held", TILE_SWITCHES,
                         ids=[f"{switch}-{source.split('_')[1]}" for switch, source, *_ in TILE_SWITCHES])
def test_a_tile_switch_compiles_to_its_tiles(switch, source, default, mark, held, device_ptx):
    off, on = device_ptx.each(source, [f"{switch}=0", *held], [f"{switch}=1", *held])
    marked = mark if callable(mark) else lambda ptx: mark in ptx
    assert marked(on) and not marked(off)
    assert device_ptx(source, held) == (on if default else off), f"{switch}'s default is not {default}"


def test_a_switch_named_at_its_default_shares_the_default_build(device_ptx):
    """device_ptx keys a build by the defines that differ from the headers' defaults, so naming a switch at its default
    reuses the build that names none (one nvcc run fewer per switch); a bare NAME is NAME=1, as for nvcc."""
    named = {*SWITCHES, *(row[0] for row in TILE_SWITCHES)}
    assert named <= set(device_ptx.defaults), named - set(device_ptx.defaults)
    source = "flash_fwd_hdim64_bf16.cu"
    at_defaults = device_ptx.key(source, ["FLASH_HD80_TAIL=1", "FLASH_BWD_TRACE=0"])
    assert at_defaults == device_ptx.key(source, []) == (source, ())
    assert device_ptx.key(source, ["FLASH_FWD_EXP_SPLIT=100", "FLASH_BWD_TRACE"]) == (
        source, ("FLASH_BWD_TRACE=1", "FLASH_FWD_EXP_SPLIT=100"))


def test_the_persistent_backward_runs_hd96_non_causal_only(device_ptx):
    """FLASH_BWD_PERSISTENT at hd81-96, whose dK_j and dV_j leave by TMA stores from a buffer of their own: of the
    hd96 file's Hopper backward kernels only the dense non-causal one on the 96-wide tiles stores them so (the causal
    and varlen kernels and the hd80 twins run one block per tile, hopper_bwd_traits.h); with the switch off, none."""
    builds = device_ptx.each("flash_bwd_hdim96_bf16.cu", [], ["FLASH_BWD_PERSISTENT=0"])

    def storing(ptx):
        kernels = _kernels(ptx, "flash_bwd_hopper_kernel")
        assert len(kernels) == 6, [_name(k) for k in kernels]  # two tiles x (non-causal, causal, varlen / local)
        return [_name(k) for k in kernels if TMA_STORE in k]

    (kernel,) = storing(builds[0])
    assert "HopperBwdTraitsILi96E" in kernel and "ELb0ELb0EEEv" in kernel, kernel  # 96 wide; not causal, not varlen
    assert storing(builds[1]) == []


def _desc_layouts(ptx: str) -> set[int]:
    """The layout types (bits 62-63) of the 64-bit wgmma descriptor immediates in the PTX with bit 63 set: 2 (SW64) and
    3 (SW32); SW128's 1 is positive and not among them."""
    return {(int(wide) & (2**64 - 1)) >> 62 for wide, _ in DESC_IMMEDIATE.findall(ptx) if wide}


def test_the_causal_hd80_tile_takes_q_and_k_80_wide_and_v_96_wide(device_ptx):
    """FLASH_HD80_TAIL in the forward's causal 192 x 144 tile (FLASH_FWD_HD80_CAUSAL_3WG): Q and K 80 wide, their fifth
    k16 step through SW32 descriptors, and V 96 wide in SW64, so that O += P V is one n80 wgmma per k-step reading P
    from shared memory once (no n16); with the switch off, all three 96 wide in SW64, no SW32 descriptor."""
    tile = "ELi144ELi2E"  # 144-key blocks on 2 stages: only this tile, with hd96's non-causal one held off
    builds = device_ptx.each("flash_fwd_hdim96_bf16.cu", ["FLASH_FWD_HD96_BC144=0"],
                             ["FLASH_HD80_TAIL=0", "FLASH_FWD_HD96_BC144=0"])
    (on,), (off,) = (_kernels(ptx, tile) for ptx in builds)
    assert "HopperFwdTraitsILi80ELi144E" in _name(on) and "HopperFwdTraitsILi96ELi144E" in _name(off)
    assert _desc_layouts(on) == {2, 3} and _desc_layouts(off) == {2}
    for kernel in (on, off):
        assert WGMMA + "m64n80k16" in kernel and WGMMA + "m64n16k16" not in kernel


UNMASKED = "EEELb0ELb0EEEv"  # a forward kernel's mangled template tail: neither causal nor varlen / local
HD128_BC192 = "HopperFwdTraitsILi128ELi192ELi2E"  # hd128's forward tile on 192-key blocks, in a mangled name
HD128_BC128 = "HopperFwdTraitsILi128ELi128ELi3E"  # and on 128-key blocks


def test_hd96s_144_key_tile_runs_dense_non_causal_calls_only(device_ptx):
    """FLASH_FWD_HD96_BC144: of the hd96 file's kernels on 96-wide Q K^T, one runs 144-key blocks (the config's
    DenseTraits), the dense non-causal one; causal and varlen / local calls keep the 128-key tile; off, none."""
    tile = "HopperFwdTraitsILi96ELi144ELi2E"  # 96-wide tiles, 144-key blocks on 2 stages
    on, off = device_ptx.each("flash_fwd_hdim96_bf16.cu", [], ["FLASH_FWD_HD96_BC144=0"])
    (kernel,) = _kernels(on, tile)
    assert UNMASKED in _name(kernel) and WGMMA + "m64n144k16" in kernel, _name(kernel)
    assert _kernels(off, tile) == []


def _name(kernel: str) -> str:
    """A kernel's mangled name, from its PTX (what precedes its parameter list)."""
    return kernel.split("(")[0]


def _kernels(ptx: str, *name_parts: str) -> list[str]:
    """The PTX of each kernel whose name contains every one of `name_parts`."""
    return [e for e in ptx.split(".visible .entry ")[1:] if all(n in _name(e) for n in name_parts)]


def _counts_after(kernel: str, marker: str, pattern: str) -> list[int]:
    """For each `marker` in a kernel's PTX, how many matches of the regex `pattern` follow it before the next barrier,
    wgmma or wgmma wait."""
    counts = []
    for chunk in kernel.split(marker)[1:]:
        ends = [i for i in (chunk.find(m) for m in ("bar.sync", "wgmma.mma_async", "wgmma.wait_group")) if i >= 0]
        counts.append(len(re.findall(pattern, chunk[:min(ends, default=len(chunk))])))
    return counts


def _exponentials_after_a_wait(ptx: str, *name_parts: str) -> list[int]:
    """For each `wgmma.wait_group 0` in the kernel whose name contains every one of `name_parts`, how many ex2
    instructions follow it before the next barrier, wgmma or wgmma wait."""
    return _counts_after(_kernels(ptx, *name_parts)[0], "wgmma.wait_group.sync.aligned 0;", r"ex2\.approx")


def test_the_exponential_split_moves_half_of_them_after_the_wait_for_p_v(device_ptx):
    """FLASH_FWD_EXP_SPLIT: in hd128's 192-key non-causal kernel, a turn after the first exponentiates 2 rows x 12 of
    S_j's 24 n8 tiles x 2 columns = 48 elements after the wait for its own P V at 50%, none at 100 (the first turn,
    which waits for S_0 alone, exponentiates all 96 after its wait either way); hd64's three warpgroups keep all
    before it at any setting."""
    tile = (HD128_BC192, UNMASKED)
    half, whole = device_ptx.each("flash_fwd_hdim128_bf16.cu", *([f"FLASH_FWD_EXP_SPLIT={pct}"] for pct in (50, 100)))
    assert 48 in _exponentials_after_a_wait(half, *tile) and 96 + 2 in _exponentials_after_a_wait(half, *tile)
    assert max(_exponentials_after_a_wait(whole, *tile)[1:]) == 0
    assert device_ptx("flash_fwd_hdim128_bf16.cu", []) == half, "FLASH_FWD_EXP_SPLIT's default is not 50"
    hd64 = device_ptx.each("flash_fwd_hdim64_bf16.cu", *([f"FLASH_FWD_EXP_SPLIT={pct}"] for pct in (50, 100)))
    assert hd64[0] == hd64[1]


def test_the_rescale_threshold_puts_o_s_rescale_behind_a_warp_vote(device_ptx):
    """FLASH_FWD_RESCALE_THRESHOLD: at 8, every Hopper forward kernel votes across the warp (`vote.sync.any`) on
    whether some row moved its max, once per softmax; at 0 none votes and O is rescaled every turn. By default
    (-1) hd64's dense non-causal kernels vote (neither causal nor varlen / local), and no other kernel does."""
    for source in ("flash_fwd_hdim64_bf16.cu", "flash_fwd_hdim128_bf16.cu"):
        off, lazy, default = device_ptx.each(source, *([f"FLASH_FWD_RESCALE_THRESHOLD={t}"] for t in (0, 8, -1)))
        kernels = _kernels(lazy, "flash_fwd_hopper_kernel")
        assert kernels and all("vote.sync.any.pred" in e for e in kernels), source
        assert "vote.sync" not in off, source
        for kernel in _kernels(default, "flash_fwd_hopper_kernel"):
            assert ("vote.sync" in kernel) == ("hdim64" in source and UNMASKED in _name(kernel)), _name(kernel)
        assert device_ptx(source, []) == default, "FLASH_FWD_RESCALE_THRESHOLD's default is not -1"


def _o_multiplies_before_p_v(kernel: str) -> list[int]:
    """For each `wgmma.commit_group` in a kernel's PTX, how many fp32 multiplies follow it before the next wgmma, wgmma
    wait or barrier: O's rescale where it runs between the commit of S_j's group and the issue of P V."""
    return _counts_after(kernel, "wgmma.commit_group.sync.aligned;", r"\bmul(?:\.rn)?(?:\.ftz)?\.f32\b")


def test_o_is_rescaled_before_p_v_where_the_switch_says(device_ptx):
    """FLASH_FWD_RESCALE_BEFORE_PV: at 1 every hd128 Hopper forward kernel (each runs the intra-warpgroup overlap and
    no rescale threshold) multiplies O's 64 accumulators per thread between the commit of S_j's wgmma group and the
    issue of P V; at 0 none does. By default (-1) only the dense non-causal kernel on 192-key blocks does."""
    source = "flash_fwd_hdim128_bf16.cu"
    off, on, default = device_ptx.each(source, *([f"FLASH_FWD_RESCALE_BEFORE_PV={v}"] for v in (0, 1, -1)))
    assert len(_kernels(on, "flash_fwd_hopper_kernel")) == 6  # two tiles x (non-causal, causal, varlen / local)
    for kernel in _kernels(on, "flash_fwd_hopper_kernel"):
        assert 64 in _o_multiplies_before_p_v(kernel), _name(kernel)
    for kernel in _kernels(off, "flash_fwd_hopper_kernel"):
        assert max(_o_multiplies_before_p_v(kernel)) == 0, _name(kernel)
    for kernel in _kernels(default, "flash_fwd_hopper_kernel"):
        before = 64 in _o_multiplies_before_p_v(kernel)
        assert before == (HD128_BC192 in _name(kernel) and UNMASKED in _name(kernel)), _name(kernel)
    assert device_ptx(source, []) == default, "FLASH_FWD_RESCALE_BEFORE_PV's default is not -1"


def _s_wgmma_shapes(kernel: str) -> set[str]:
    """The wgmma shapes of a kernel's PTX whose A operand is a shared-memory descriptor (S = Q K^T's; P V's A is in
    registers), e.g. {"m64n192k16", "m64n64k16"}."""
    return set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.\w+\.\w+ \{[^}]*\}, %rd", kernel))


def test_the_last_key_block_narrows_where_the_switch_says(device_ptx):
    """FLASH_FWD_NARROW_LAST_BLOCK: at 1 every hd128 Hopper forward kernel also issues S = Q K^T over 64 keys (a last
    block's first 64-key step), the 192-key ones over 128 keys too; at 0 every S spans its whole key block. By default
    (-1) every kernel narrows but the dense non-causal one on 128-key blocks, which T a multiple of 128 fills."""
    source = "flash_fwd_hdim128_bf16.cu"
    off, on, default = device_ptx.each(source, *([f"FLASH_FWD_NARROW_LAST_BLOCK={v}"] for v in (0, 1, -1)))
    assert len(_kernels(on, "flash_fwd_hopper_kernel")) == 6  # two tiles x (non-causal, causal, varlen / local)
    for kernel in _kernels(on, "flash_fwd_hopper_kernel"):
        wide = HD128_BC192 in _name(kernel)
        expected = {"m64n192k16", "m64n64k16", "m64n128k16"} if wide else {"m64n128k16", "m64n64k16"}
        assert _s_wgmma_shapes(kernel) == expected, _name(kernel)
    for kernel in _kernels(off, "flash_fwd_hopper_kernel"):
        wide = HD128_BC192 in _name(kernel)
        assert _s_wgmma_shapes(kernel) == {"m64n192k16" if wide else "m64n128k16"}, _name(kernel)
    for kernel in _kernels(default, "flash_fwd_hopper_kernel"):
        filled = HD128_BC128 in _name(kernel) and UNMASKED in _name(kernel)
        assert ("m64n64k16" in _s_wgmma_shapes(kernel)) != filled, _name(kernel)
    assert device_ptx(source, []) == default, "FLASH_FWD_NARROW_LAST_BLOCK's default is not -1"


DESC_PAIR = re.compile(r"mov\.b64 %rd\d+, \{%r\d+, %r\d+\};")
SW128_DESC = "4611686293305294848"  # 0x4000004000000000: layout type 1 (128-byte swizzle), a 1024-byte stride
SW128_DESC_HI = re.compile(r"mov\.u32\s+%r\d+, 1073741888;")  # its high word, 0x40000040, as a 32-bit immediate


@pytest.mark.parametrize("source", ["flash_fwd_hdim128_bf16.cu", "flash_bwd_hdim128_bf16.cu"])
def test_the_descriptor_pair_switch_builds_each_descriptor_from_two_words(source, device_ptx):
    """FLASH_WGMMA_DESC_PAIR: at 1 every Hopper kernel builds its wgmma descriptors by `mov.b64 {lo, hi}` (the
    128-byte-swizzle ones with the high word 0x40000040), so no 64-bit descriptor constant is left for NVVM to fold
    into the advances; at 0, the default, none is built that way and the constant is ORed in."""
    off, on = device_ptx.each(source, *([f"FLASH_WGMMA_DESC_PAIR={v}"] for v in (0, 1)))
    assert not DESC_PAIR.search(off) and SW128_DESC in off
    kernels = _kernels(on, "_hopper_kernel")
    assert kernels and all(DESC_PAIR.search(e) and SW128_DESC_HI.search(e) for e in kernels)
    assert SW128_DESC not in on
    assert device_ptx(source, []) == off, "FLASH_WGMMA_DESC_PAIR's default is not 0"


BULK_LOAD = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"  # ld_mma's rows of a query block
LSE_LOAD = "cp.async.ca.shared.global"  # L_i and D_i, 4 bytes per thread (load_lse_delta)


def test_l_and_d_go_through_the_matmuls_in_the_dense_bf16_backward_only(device_ptx):
    """FLASH_BWD_LD_IN_MMA: the dense Hopper backward kernels of the bf16 files take the query block's rows of ld_mma
    by bulk copies and add them to S^T and dP^T by a wgmma with A from registers (one per product), with no 4-byte
    copy of L_i and D_i; the varlen kernel keeps those copies; the fp16 file compiles
    as without the switch; with the switch off, no bulk copy."""
    on, off = device_ptx.each("flash_bwd_hdim128_bf16.cu", [], ["FLASH_BWD_LD_IN_MMA=0"])
    kernels = {_name(k): k for k in _kernels(on, "flash_bwd_hopper_kernel")}
    assert len(kernels) == 3, list(kernels)  # non-causal, causal, varlen / local
    for name, kernel in kernels.items():
        varlen = name.endswith("ELb0ELb1EEEvNS_9BwdParamsENS_13BwdTensorMapsENS_8BwdTilesE")
        assert (BULK_LOAD in kernel) != varlen and (LSE_LOAD in kernel) == varlen, name
        register_a = re.findall(WGMMA + r"m64n64k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", kernel)
        # S^T's (issued before the loop and at each iteration's end: kIssueNextSEarly) and dP^T's
        assert len(register_a) == (0 if varlen else 3), (name, len(register_a))
    assert all(BULK_LOAD not in k and LSE_LOAD in k for k in _kernels(off, "flash_bwd_hopper_kernel"))
    fp16_on, fp16_off = device_ptx.each("flash_bwd_hdim128_fp16.cu", [], ["FLASH_BWD_LD_IN_MMA=0"])
    assert fp16_on == fp16_off
