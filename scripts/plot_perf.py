"""Plots bus bandwidth against size for oxccl, Open MPI and gloo from compare.sh outputs.

Usage: python3 scripts/plot_perf.py DIR   (reads DIR/<collective>-<ranks>.txt, writes DIR/*.png
and DIR/summary.md, the ratio tables in Markdown). Where DIR/shared/<collective>-<ranks>.txt
exists (the same comparison with oxccl's buffers from alloc_shared, `oxccl perf -R 1`), its
oxccl line joins the plot and its rows a second table in the summary.
"""
import glob
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def ratio_rows(path):
    """The final table of compare.sh (bytes, oxccl us, mpi us, gloo us, ratios and, for
    all_reduce with DeepSpeed installed, its columns), or of
    scripts/anchors/compare_reduce.sh (no gloo column: NaN)."""
    rows, seen = [], False
    for line in open(path):
        if line.startswith("#") and "mpi/ox time" in line:
            seen, rows = True, []
            continue
        f = line.split()
        # 6 columns; 8 where compare.sh adds DeepSpeed's (ds us, ds/ox time), not plotted here
        if seen and len(f) in (6, 8) and f[0].isdigit():
            rows.append((int(f[0]), float(f[1]), float(f[2]), float(f[3])))
        elif seen and len(f) == 4 and f[0].isdigit():
            rows.append((int(f[0]), float(f[1]), float(f[2]), float("nan")))
    return rows


HEADER = ["| collective | ranks | bytes | oxccl µs | Open MPI µs | gloo µs | MPI/oxccl time | gloo/oxccl time |",
          "|---|---|---|---|---|---|---|---|"]


def table_rows(coll, n, rows):
    out = []
    for b, ox, mpi, gl in rows:
        g = f"{gl:.2f} | {gl / ox:.2f}" if gl == gl else "– | –"
        out.append(f"| {coll} | {n} | {b} | {ox:.2f} | {mpi:.2f} | {g.split(' | ')[0]} | {mpi / ox:.2f} | {g.split(' | ')[1]} |")
    return out


def main(d):
    summary = ["Private buffers (the default):", ""] + HEADER
    shared_summary = ["", "Shared buffers (`Communicator::alloc_shared`, `oxccl perf -R 1`):", ""] + HEADER
    for path in sorted(glob.glob(os.path.join(d, "*-[0-9].txt"))):
        name = os.path.basename(path)[:-4]
        coll, n = name.rsplit("-", 1)
        n = int(n)
        rows = ratio_rows(path)
        if not rows:
            continue
        fac = FACTOR[coll](n)
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, label in [(1, "oxccl"), (2, "Open MPI 4.1 (shared memory)"), (3, "gloo (torch, TCP loopback)")]:
            xs = [r[0] for r in rows if r[i] == r[i] and r[i] > 0]
            ys = [r[0] / r[i] / 1e3 * fac for r in rows if r[i] == r[i] and r[i] > 0]
            ax.plot(xs, ys, marker="o", label=label)
        shared_path = os.path.join(d, "shared", os.path.basename(path))
        shared = ratio_rows(shared_path) if os.path.exists(shared_path) else []
        if shared:
            ax.plot([r[0] for r in shared], [r[0] / r[1] / 1e3 * fac for r in shared],
                    marker="s", label="oxccl, shared buffers (-R 1)")
            shared_summary.extend(table_rows(coll, n, shared))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{coll}, {n} ranks, float32 sum, one host (2 cores)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(d, f"{name}.png"), dpi=90)
        plt.close(fig)
        summary.extend(table_rows(coll, n, rows))
    if len(shared_summary) > 5:
        summary.extend(shared_summary)
    with open(os.path.join(d, "summary.md"), "w") as f:
        f.write("\n".join(summary) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/perf")
