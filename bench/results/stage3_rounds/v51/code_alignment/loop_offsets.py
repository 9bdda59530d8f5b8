"""Where each Hopper kernel's main loop starts (address mod 128), its length, and whether its body equals the
first listed kernel of the same name but the last template argument (code_alignment's variants): usage
`python loop_offsets.py CUBIN [REGEX]` with cuobjdump on PATH. Variants 8-15 compare with variant 8."""
import difflib, pathlib, re, subprocess, sys
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))
import sass_mix as sm
import sass_diff as sd
path = sys.argv[1]
pat = re.compile(sys.argv[2] if len(sys.argv) > 2 else "hopper")
text = subprocess.run(["cuobjdump", "-sass", path], capture_output=True, text=True).stdout
ks = sm.parse_sass(text)
kp = sm.parse_sass(text, keep_predicates=True)
names = sm.demangle([k.name for k in ks])
ref = {}
for k, kk, n in zip(ks, kp, names):
    if not pat.search(n):
        continue
    loop = sm.main_loop(k)
    if loop is None:
        continue
    lo, hi = loop
    code = [(a, t) for a, t in kk.code if lo <= a <= hi]
    def shift(t):
        if sd.CONTROL.match(t):
            t = sd.ADDRESS.sub(lambda m: hex(int(m.group(0), 16) - lo), t)
        return t
    rel = [(a - lo, shift(t)) for a, t in code]
    body = sd.renamed(sd.labelled(rel))
    mv = re.search(r", (-?\d+)>$", n)
    key = re.sub(r", -?\d+>$", ">", n) + ("P" if mv and int(mv.group(1)) >= 8 else "")
    if key not in ref:
        ref[key] = body
        same = "ref"
    else:
        d = [l for l in difflib.unified_diff(sd.erased(ref[key]), sd.erased(body), n=0, lineterm="") if l[:1] in "+-" and not l.startswith(("+++", "---"))]
        same = "same" if body == ref[key] else f"{len(d)} apart"
    print(f"start%128={lo % 128:3d} start={lo:#7x} len={len(code):4d} total={len(k.code):5d} {same:10s} {n[-40:]}")
