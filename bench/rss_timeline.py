#!/usr/bin/env python3
"""Runs a command, samples its resident memory (VmRSS, every 10 ms) and
timestamps each line it writes to stderr (kruskal's progress), then prints
the peak, where it came among those lines, and a coarse timeline.

    python3 bench/rss_timeline.py OUT.txt -- kruskal cpd FILE --gpus 4 ...

Linux only (reads /proc). The command's stdout goes to OUT.txt's
neighbour OUT.stdout; the report is printed and written to OUT.txt.
"""
import subprocess
import sys
import threading
import time


def rss_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def main():
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit(__doc__)
    out, cmd = sys.argv[1], sys.argv[3:]
    start = time.monotonic()
    with open(out.rsplit(".", 1)[0] + ".stdout", "w") as stdout:
        p = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
        lines = []

        def read():
            for line in p.stderr:
                lines.append((time.monotonic() - start, line.rstrip("\n")))

        reader = threading.Thread(target=read)
        reader.start()
        samples = []
        while p.poll() is None:
            kb = rss_kb(p.pid)
            if kb is not None:
                samples.append((time.monotonic() - start, kb))
            time.sleep(0.01)
        reader.join()
    report = [f"command: {' '.join(cmd)}", f"exit status {p.returncode}"]
    if samples:
        t_peak, peak = max(samples, key=lambda s: s[1])
        report.append(f"peak VmRSS {peak} kB at {t_peak:.2f} s of {samples[-1][0]:.2f} s")
        before = [l for l in lines if l[0] <= t_peak]
        after = [l for l in lines if l[0] > t_peak]
        if before:
            report.append(f"  last line before it ({before[-1][0]:.2f} s): {before[-1][1]}")
        if after:
            report.append(f"  first line after it ({after[0][0]:.2f} s): {after[0][1]}")
        report.append("timeline (s, VmRSS kB at the sample, stderr lines since the last):")
        step, nxt, li = 0.5, 0.0, 0
        for t, kb in samples:
            if t >= nxt:
                new = []
                while li < len(lines) and lines[li][0] <= t:
                    new.append(lines[li][1][:100])
                    li += 1
                report.append(f"  {t:7.2f} {kb:>12}" + ("  | " + " | ".join(new) if new else ""))
                nxt = t + step
    text = "\n".join(report)
    print(text)
    with open(out, "w") as f:
        f.write(text + "\n")
    sys.exit(p.returncode)


if __name__ == "__main__":
    main()
