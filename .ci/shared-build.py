#!/usr/bin/env python3
"""The README's two commands share one build: `cargo run -p kruskal`
(the main job) and `cargo test --workspace` (the tests) must resolve every
library they both use with the same features, or the tests rebuild that
library and everything above it (most of the workspace). This compares the
two resolutions with `cargo tree` and names every library whose features
differ; exit status 1 if any does. The fix is usually a line in
crates/kruskal/Cargo.toml's list of unified features."""

import subprocess
import sys


def resolve(args):
    out = subprocess.run(
        ["cargo", "tree", "--prefix", "none", "-f", "{p}|{f}", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    features = {}
    for line in out.splitlines():
        line = line.strip()
        if "|" not in line:
            continue
        package, feats = line.split("|", 1)
        package = package.replace(" (*)", "").strip()
        feats = feats.replace(" (*)", "").strip()
        features.setdefault(package, set()).update(f for f in feats.split(",") if f)
    return features


def main():
    program = resolve(["-p", "kruskal", "-e", "normal,build"])
    tests = resolve(["--workspace"])
    differ = []
    for package, feats in sorted(program.items()):
        other = tests.get(package)
        if other is not None and other != feats:
            differ.append(
                f"{package}: the program builds it with [{', '.join(sorted(feats))}], "
                f"the tests with [{', '.join(sorted(other))}]"
            )
    if differ:
        print("the tests would rebuild libraries the program built:", file=sys.stderr)
        for line in differ:
            print("  " + line, file=sys.stderr)
        sys.exit(1)
    print(f"the tests reuse the program's build of all {len(program)} packages it resolves")


if __name__ == "__main__":
    main()
