#!/usr/bin/env python3
"""One line per run of scripts/cluster_probe.sh (a folder written by `cluster.sh perf` with
OXCCL_CLUSTER_STATS): usage: scripts/cluster_probe.py DIR NAME, or --header; `--sample
PREFIX HOSTS` is the sampler cluster.sh runs during the run (writes ss.txt to stdout).

Columns: the call's time (the faster of out-of-place and in-place, ms) and the ranks' CPU
per call (user + system of all ranks, ms); `busy`: the machine's busy cores while data
flowed (from the first 100 ms sample after the connection's first 16 MB to the last sample
where it still moved), `sirq`: the part of them in softirq, `ctx/ms`: context switches per
ms; the tbf qdiscs' drops and overlimits (all of them, hosts' eth0 and switch ports), the
hosts' TCP retransmitted segments (`rtx`) and tail loss probes (`tlp`); then host 0's data
socket from `ss -ti` (its last sample): cwnd (segments), smoothed and minimum RTT (ms),
the congestion control's bandwidth estimate (bbr only), the time the sender was busy and
the share of it limited by the receive window (`rwnd%`) or by its send buffer (`sndbuf%`),
the median RTT while data flowed; `ksirq`: cores spent in the ksoftirqd threads (softirq work
deferred to a thread that competes with the ranks for a CPU), and NET_TX, NET_RX and HRTIMER
softirqs per ms, all while data flowed."""
import json
import re
import sys

HEAD = (f"{'setting':>14} {'t_ms':>6} {'cpu_ms':>6} {'busy':>5} {'sirq':>5} {'ctx/ms':>6} "
        f"{'drops':>6} {'overlim':>8} {'rtx':>5} {'tlp':>4} {'cwnd':>5} {'rtt':>6} {'minrtt':>6} "
        f"{'bw':>9} {'busy_ms':>7} {'rwnd%':>5} {'sndbuf%':>7} {'rtt_med':>7} {'ksirq':>5} "
        f"{'tx/ms':>6} {'rx/ms':>6} {'hrt/ms':>6}")


def samples(path):
    """[(t, cpu fields, ctxt, {host: [socket dicts]})] from ss.txt."""
    out, cur, host, sock = [], None, None, None
    for line in open(path):
        if line.startswith("# t "):
            cur = {"t": float(line.split()[2]), "cpu": None, "ctxt": 0, "hosts": {}}
            out.append(cur)
        elif cur is None:
            continue
        elif line.startswith("cpu "):
            cur["cpu"] = [int(x) for x in line.split()[1:]]
        elif line.startswith("ctxt"):
            cur["ctxt"] = int(line.split()[1])
        elif line.startswith("ksoftirqd "):
            p = line.split()
            if len(p) >= 3:
                cur["ksoftirqd_ns"] = cur.get("ksoftirqd_ns", 0) + int(p[2])
        elif re.match(r" *(NET_TX|NET_RX|HRTIMER):", line):
            p = line.split()
            cur[p[0].rstrip(":")] = sum(int(v) for v in p[1:])
        elif line.startswith("# host "):
            host = int(line.split()[2])
            cur["hosts"][host] = []
        elif host is not None and line[:1] not in ("\t", " ") and ":" in line and not line.startswith("Recv-Q"):
            sock = {"addr": " ".join(line.split()[2:4])}
            cur["hosts"][host].append(sock)
        elif host is not None and line.startswith("\t") and sock is not None:
            toks = line.split()
            for i, tok in enumerate(toks):
                if ":" in tok and not tok.startswith("bbr:"):
                    k, v = tok.split(":", 1)
                    sock[k] = v
                elif tok.startswith("bbr:"):
                    m = re.search(r"bw:([0-9.]+)([KMG]?)bps", tok)
                    if m:
                        scale = {"": 1e-9, "K": 1e-6, "M": 1e-3, "G": 1.0}[m[2]]
                        sock["bbr_bw"] = "%.2fG" % (float(m[1]) * scale)
                elif tok in ("pacing_rate", "delivery_rate", "send") and i + 1 < len(toks):
                    sock[tok] = toks[i + 1]
    return out


def num(v, default=0.0):
    m = re.match(r"[0-9.]+", v or "")
    return float(m[0]) if m else default


def limited(v):
    """'12ms(3.4%)' -> 3.4"""
    m = re.search(r"\(([0-9.]+)%\)", v or "")
    return float(m[1]) if m else 0.0


def data_socket(s, host):
    socks = s["hosts"].get(host, [])
    return max(socks, key=lambda x: num(x.get("bytes_acked")), default=None)


def sample(prefix, hosts):
    """Every 100 ms until killed: what samples() reads (scripts/cluster.sh OXCCL_CLUSTER_STATS)."""
    import glob
    import subprocess
    import time
    ksoft = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            if open(f"{d}/comm").read().startswith("ksoftirqd/"):
                ksoft.append(f"{d}/schedstat")
        except OSError:
            pass
    while True:
        out = [f"# t {time.time():.6f}"]
        stat = open("/proc/stat").read().splitlines()
        out += [l for l in stat if l.startswith("cpu ") or l.startswith("ctxt")]
        out += [l for l in open("/proc/softirqs").read().splitlines()
                if re.match(r" *(NET_TX|NET_RX|TIMER|HRTIMER|TASKLET):", l)]
        for f in ksoft:
            try:
                out.append(f"ksoftirqd {f.split('/')[2]} {open(f).read().strip()}")
            except OSError:
                pass
        for k in range(hosts):
            out.append(f"# host {k}")
            r = subprocess.run(["nsenter", f"--net=/run/netns/{prefix}h{k}", "ss", "-tin", "state", "established"],
                               capture_output=True, text=True)
            out.append(r.stdout.rstrip("\n"))
        print("\n".join(out), flush=True)
        time.sleep(0.1)


def main():
    if sys.argv[1] == "--header":
        print(HEAD)
        return
    if sys.argv[1] == "--sample":
        sample(sys.argv[2], int(sys.argv[3]))
        return
    d, name = sys.argv[1], sys.argv[2]
    rows = [json.loads(l) for l in open(f"{d}/perf.json")]
    best = min(rows, key=lambda r: r["time_us"])
    ss = samples(f"{d}/ss.txt")
    # The window while data flowed: host 0's data socket past 16 MB, until it stops moving.
    flow = []
    last = -1.0
    for s in ss:
        x = data_socket(s, 0)
        acked = num(x.get("bytes_acked")) if x else 0.0
        if acked >= 16 << 20 and acked > last:
            flow.append(s)
        last = acked
    busy = sirq = ctx = ksirq = float("nan")
    rates = {}
    rtt_med = float("nan")
    if len(flow) >= 2 and flow[0]["cpu"] and flow[-1]["cpu"]:
        a, b = flow[0]["cpu"], flow[-1]["cpu"]
        dt = [y - x for x, y in zip(a, b)]
        total = sum(dt[:8]) or 1
        ncpu = total / ((flow[-1]["t"] - flow[0]["t"]) * 100)
        # user, nice, system, irq, softirq (not idle, iowait, or steal: the hypervisor's)
        busy = (dt[0] + dt[1] + dt[2] + dt[5] + dt[6]) / total * ncpu
        sirq = dt[6] / total * ncpu
        span_ms = (flow[-1]["t"] - flow[0]["t"]) * 1e3
        ctx = (flow[-1]["ctxt"] - flow[0]["ctxt"]) / span_ms
        # Cores spent in ksoftirqd, and softirqs raised per ms.
        ksirq = (flow[-1].get("ksoftirqd_ns", 0) - flow[0].get("ksoftirqd_ns", 0)) / 1e6 / span_ms
        rates = {k: (flow[-1].get(k, 0) - flow[0].get(k, 0)) / span_ms for k in ("NET_TX", "NET_RX", "HRTIMER")}
        rtts = sorted(num(data_socket(s, 0).get("rtt")) for s in flow if data_socket(s, 0))
        rtt_med = rtts[len(rtts) // 2]
    drops = over = 0
    for f in __import__("glob").glob(f"{d}/tc-*.txt"):
        t = open(f).read()
        for m in re.finditer(r"dropped (\d+), overlimits (\d+)", t):
            drops += int(m[1])
            over += int(m[2])
    rtx = tlp = 0
    for f in __import__("glob").glob(f"{d}/nstat-*.txt"):
        for line in open(f):
            p = line.split()
            if len(p) >= 2 and p[0] == "TcpRetransSegs":
                rtx += int(p[1])
            elif len(p) >= 2 and p[0] == "TcpExtTCPLossProbes":
                tlp += int(p[1])
    # The last sample where host 0's data socket was seen.
    x = next((data_socket(s, 0) for s in reversed(ss) if data_socket(s, 0)), None) or {}
    rtt = x.get("rtt", "").split("/")[0]
    print(f"{name:>14} {best['time_us'] / 1e3:>6.1f} {best['cpu_us'] / 1e3:>6.1f} {busy:>5.2f} {sirq:>5.2f} "
          f"{ctx:>6.1f} {drops:>6} {over:>8} {rtx:>5} {tlp:>4} {x.get('cwnd', '-'):>5} {num(rtt):>6.3f} "
          f"{num(x.get('minrtt')):>6.3f} {x.get('bbr_bw', '-'):>9} {x.get('busy', '-'):>7} "
          f"{limited(x.get('rwnd_limited')):>5.1f} {limited(x.get('sndbuf_limited')):>7.1f} {rtt_med:>7.3f} "
          f"{ksirq:>5.2f} " + " ".join(f"{rates.get(k, float('nan')):>6.1f}" for k in ("NET_TX", "NET_RX", "HRTIMER")))


main()
