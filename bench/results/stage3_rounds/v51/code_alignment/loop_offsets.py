"""Where each Hopper kernel's main loop starts (address mod 128), its length, and whether its body equals the
first listed kernel of the same name but the last template argument (candidate.patch's variants; 8-15 compare with
variant 8): `python loop_offsets.py CUBIN [REGEX]` with cuobjdump on PATH. The loops are bench/sass_diff.py's."""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))
import sass_diff as sd  # noqa: E402

path = pathlib.Path(sys.argv[1])
reference = {}
for name, listing in sd.listings(path, sys.argv[2] if len(sys.argv) > 2 else "hopper").items():
    found = sd.main_loop(listing)
    if found is None:
        continue
    start, body = found
    variant = re.search(r", (-?\d+)>$", name)
    key = re.sub(r", -?\d+>$", ">", name) + ("P" if variant and int(variant.group(1)) >= 8 else "")
    if key not in reference:
        reference[key], same = body, "ref"
    else:
        old = reference[key]
        same = "same" if sd.renamed(body) == sd.renamed(old) else sd.apart(sd.line_diff(old, body))
    length = sum(1 for line in body if not line.endswith(":"))
    print(f"start%128={start % sd.LINE_BYTES:3d} start={start:#7x} len={length:4d} total={len(listing.code):5d} "
          f"{same:14s} {name[-40:]}")
