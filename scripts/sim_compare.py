#!/usr/bin/env python3
"""Predicted (oxccl sim) against measured (scripts/cluster.sh perf) all_reduce times, per row.
usage: scripts/sim_compare.py DIR [oxccl sim flags, e.g. --net-gbps 0.125]
DIR holds HxL-ALGO.txt perf tables (scripts/sim_check.sh writes them; ALGO auto is the
library's own choice). Measured time: the faster of out-of-place and in-place.
`--cpus load`: for each table, the cores left to its H*L ranks by the load average recorded
before the run (first line, `# load average before the run: L1 L5 L15`):
nproc * n / max(n, L1), i.e. the machine's cores shared by the ranks and the L1 - n other
runnable tasks."""
import glob, json, os, re, subprocess, sys

d = sys.argv[1]
extra = sys.argv[2:]
BIN = os.environ.get("OXCCL_BIN", "target/release/oxccl")
meas = {}  # (H, L, forced) -> {size: (algo, out_us, in_us)}
loads = {}  # (H, L, forced) -> 1-minute load average before the run
for f in sorted(glob.glob(os.path.join(d, "*x*-*.txt"))):
    m = re.match(r"(\d+)x(\d+)-(\w+)\.txt", os.path.basename(f))
    if not m:
        continue
    h, l, forced = int(m[1]), int(m[2]), m[3]
    rows = {}
    for line in open(f):
        if line.startswith("# load average before the run:"):
            loads[(h, l, forced)] = float(line.split(":")[1].split()[0])
        p = line.split()
        if len(p) > 10 and p[1].isdigit() and p[3] == "float":
            rows[int(p[1])] = (p[6], float(p[7]), float(p[12]))
    meas[(h, l, forced)] = rows

env = dict(os.environ, OXCCL_TUNE_FILE="")
errs = []
print("| hosts x ranks | size | algo | measured us (out / in-place) | predicted us | error | cpus |")
print("|---|---:|---|---:|---:|---:|---:|")
for (h, l, forced), rows in sorted(meas.items()):
    sizes = sorted(rows)
    args = list(extra)
    if "--cpus" in args and args[args.index("--cpus") + 1] == "load":
        n = h * l
        load = loads.get((h, l, forced))
        if load is None:
            sys.exit(f"{h}x{l}-{forced}: no load average recorded (--cpus load)")
        args[args.index("--cpus") + 1] = "%.3f" % (os.cpu_count() * n / max(n, load))
    for s in sizes:
        out = subprocess.run([BIN, "sim", "--hosts", str(h), "--ranks-per-host", str(l), "-b", str(s), "-e", str(s), "--json"] + args,
                             env=env, capture_output=True, text=True, check=True).stdout
        p = json.loads(out.splitlines()[0])
        algo, t_out, t_in = rows[s]
        pred = p["predicted_us"].get(algo)
        t = min(t_out, t_in)
        note = ""
        if forced == "auto":
            note = " (chosen; sim chose %s)" % p["algo"]
        if pred is None:
            continue
        e = (pred - t) / t
        errs.append((h, l, forced, s, e))
        print(f"| {h}x{l} | {s} | {algo}{note} | {t_out:.0f} / {t_in:.0f} | {pred:.0f} | {e*100:+.0f}% | {p['cpus']} |")
within = sum(1 for x in errs if abs(x[4]) <= 0.25)
print(f"\n{within} of {len(errs)} rows within 25% (measured: the faster of out-of-place and in-place)")
# Summary by size class.
cls = lambda s: "<=4K" if s <= 4096 else ("32K" if s <= 32768 else ">=256K")
from collections import defaultdict
agg = defaultdict(list)
for h, l, forced, s, e in errs:
    agg[(cls(s), forced == "auto")].append(e)
for k in sorted(agg):
    v = sorted(agg[k])
    w = sum(1 for x in v if abs(x) <= 0.25)
    print(f"{k[0]:>7} {'chosen' if k[1] else 'forced'}: {w}/{len(v)} within 25%, median error {v[len(v)//2]*100:+.0f}%, range {v[0]*100:+.0f}%..{v[-1]*100:+.0f}%")
