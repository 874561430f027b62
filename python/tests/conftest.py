"""Launches ranks as separate processes (each with a timeout), like torchrun would."""

import os
import random
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


_GIVEN_PORTS = set()
_PORT_RNG = random.Random()  # its own: tests may seed the module's


def free_port() -> int:
    """A port for a rendezvous address: free now, never given twice by this process, drawn
    below the kernel's ephemeral range (a port from ``bind(("127.0.0.1", 0))`` lies in that
    range, where every outgoing connection takes ports too, so another job's connection can
    take it before rank 0 binds it; below the range only an explicit bind can)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(1000 if low > 11000 else 0):
        port = _PORT_RNG.randrange(10000, low)
        if port in _GIVEN_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN_PORTS.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _GIVEN_PORTS.add(port)
    return port


def launch(n, worker=None, script=None, args=(), env=None, timeout=240, expect_ok=True):
    """Runs `workers.<worker>()` (or `script args...`) as `n` ranks with torchrun's
    variables set; returns the ranks' (returncode, output). Kills every rank on timeout."""
    port = free_port()
    procs = []
    for r in range(n):
        e = dict(os.environ)
        e.update(
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OXCCL_SECRET="5f3c2a1b0e9d8c7b6a5f4e3d2c1b0a99",
            OXCCL_TIMEOUT=e.get("OXCCL_TIMEOUT", "60"),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        e.update(env or {})
        if worker is not None:
            cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); import workers; workers.{worker}(*sys.argv[1:])", *map(str, args)]
        else:
            cmd = [sys.executable, script, *map(str, args)]
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO))
    deadline = time.monotonic() + timeout
    results = []
    timed_out = False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        results.append((p.returncode, out))
    if expect_ok:
        bad = [(r, rc) for r, (rc, _) in enumerate(results) if rc != 0]
        if bad or timed_out:
            log = "\n".join(f"--- rank {r} (rc {rc})\n{out}" for r, (rc, out) in enumerate(results))
            pytest.fail(f"ranks failed {bad} timed_out={timed_out}\n{log}")
    return results


def signal_one(n, argv, env, victim, sig, after_ready_s, timeout):
    """Starts `n` ranks of `argv` (each prints "ready" once past its set-up), sends `sig` to
    rank `victim` `after_ready_s` seconds after every rank is ready, and returns, for every
    other rank, `(rank, returncode, output, seconds from the signal to its exit)`. The victim
    is continued and killed at the end."""
    import signal as _signal

    port = free_port()
    secret = os.urandom(16).hex()
    procs = []
    for r in range(n):
        e = dict(os.environ)
        e.update(
            RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OXCCL_SECRET=secret,
            OXCCL_HEARTBEAT_TIMEOUT="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        )
        e.update(env)
        procs.append(subprocess.Popen(argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO))
    got = []
    try:
        deadline = time.monotonic() + 240
        for r, p in enumerate(procs):
            while True:
                line = p.stdout.readline()
                assert line and time.monotonic() < deadline, f"rank {r} ended before it was ready"
                if line.strip() == "ready":
                    break
        time.sleep(after_ready_s)
        os.kill(procs[victim].pid, sig)
        signalled = time.monotonic()
        for r, p in enumerate(procs):
            if r != victim:
                out, _ = p.communicate(timeout=timeout)
                got.append((r, p.returncode, out, time.monotonic() - signalled))
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, _signal.SIGCONT)
                p.kill()
            p.communicate()
    return got


@pytest.fixture
def ranks():
    return launch
