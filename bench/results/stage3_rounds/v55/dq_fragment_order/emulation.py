# End-to-end emulation of the fragment-ordered dQ path (candidate.patch): fragments -> sdQ -> bulk reduce ->
# dq_accum -> convert kernel's reads, for each Hopper config; also the zero columns of the hd80 twins.
import random
def off(r, c):  # dq_accum_offset
    block = c // 64
    tid = (r % 64) // 16 * 32 + (r % 8) * 4 + (c % 8) // 2
    vec = (c % 64) // 8 * 128 + tid
    return block * 64 * 64 + vec * 4 + ((r % 16) // 8) * 2 + c % 2

def run(kBlockM, kDqRow, wgs, zero_cols, Tq, seqs=None):
    # wgs: list of (dq_row0, dq_col0, ncols) per warpgroup
    rows_pad = -(-Tq // 128) * 128
    dq_accum = [0.0] * (rows_pad * kDqRow)
    D = [[random.random() for _ in range(kDqRow)] for _ in range(rows_pad)]
    for r in range(rows_pad):
        for c in range(kDqRow - zero_cols, kDqRow): D[r][c] = 0.0
    for m in range(rows_pad // kBlockM):
        sdq = [None] * (kBlockM * kDqRow)
        # zero init of the zero columns (done once per stage in the kernel; stages are reused, values stay)
        for row in range(kBlockM):
            for col in range(kDqRow - zero_cols, kDqRow, 2):
                p = row // 64 * 64 * kDqRow + off(row % 64, col)
                sdq[p] = 0.0; sdq[p + 1] = 0.0
        for (row0, col0, ncols) in wgs:
            for tid in range(128):
                w, lane = tid // 32, tid % 32
                g, t = lane // 4, lane % 4
                base = row0 // 64 * 64 * kDqRow + col0 * 64 + 4 * tid  # floats (the kernel: bytes / 4)
                for i in range(ncols // 8):
                    if col0 + 8 * i >= kDqRow: continue
                    vals = []
                    for r in range(2):
                        for e in range(2):
                            vals.append(D[m * kBlockM + row0 + 16 * w + g + 8 * r][col0 + 8 * i + 2 * t + e])
                    p = base + 4 * 128 * i
                    # dq[4i + 2r + e] order: (r=0,e=0), (0,1), (1,0), (1,1)
                    for k in range(4):
                        assert sdq[p + k] is None, (m, tid, i, k)
                        sdq[p + k] = vals[k]
        assert all(v is not None for v in sdq), "sdQ tile not fully written"
        for k in range(kBlockM * kDqRow):  # bulk reduce of the whole tile
            dq_accum[m * kBlockM * kDqRow + k] += sdq[k]
    # convert kernel
    for q in range(Tq):
        tile = q // 64 * 64 * kDqRow
        for col in range(0, kDqRow, 8):
            at = tile + off(q % 64, col)
            for j in range(4):
                for e in range(2):
                    got = dq_accum[at + 4 * j + e]
                    assert got == D[q][col + 2 * j + e], (q, col, j, e)
    return True

random.seed(0)
for Tq in (1, 63, 64, 65, 200, 257):
    assert run(64, 128, [(0, 0, 64), (0, 64, 64)], 0, Tq)        # hd128
    assert run(64, 96, [(0, 0, 64), (0, 64, 32)], 0, Tq)         # hd96 (SW64 tiles: n64 + n32)
    assert run(64, 96, [(0, 0, 64), (0, 64, 16)], 16, Tq)        # hd80 twins: n64 + n16, columns 80-95 zeros
    assert run(128, 64, [(0, 0, 64), (64, 0, 64)], 0, Tq)        # hd64: 128 rows split by queries
print("ok")
