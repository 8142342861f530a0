"""Writes splatt-med-repeats.tns.gz from splatt-med.tns.gz: the same tensor
with repeated coordinates, in shuffled line order.

Every 97th nonzero (1,031 of them) is split into three lines whose values
add up to the original (halves and quarters: 5 becomes 2.5, 1.25 and 1.25),
and every other 50th (1,979) into two halves. All the parts are exact in
binary and in decimal, so summing the repeated lines gives back splatt-med
exactly: the two files describe the
same tensor, and every fit computed from them must agree.

Run from this folder: python3 make_repeats.py
"""

import gzip
import random


def parts(value, n):
    # Halves and quarters of 1-5 are exact in binary and in short decimals.
    return [value / 2, value / 2] if n == 2 else [value / 2, value / 4, value / 4] if n == 3 else [value]


def main():
    with gzip.open("splatt-med.tns.gz", "rt") as f:
        lines = [l.split() for l in f if l.strip() and not l.startswith("#")]
    out = []
    for k, tok in enumerate(lines):
        idx, value = tok[:-1], float(tok[-1])
        n = 3 if k % 97 == 0 else 2 if k % 50 == 0 else 1
        for v in parts(value, n):
            out.append(" ".join(idx) + f" {v:g}")
    random.Random(17).shuffle(out)
    with gzip.GzipFile("splatt-med-repeats.tns.gz", "wb", mtime=0) as f:
        f.write(("# splatt-med.tns with repeated coordinates; see make_repeats.py\n"
                 + "\n".join(out) + "\n").encode())


if __name__ == "__main__":
    main()
