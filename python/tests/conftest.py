"""Launches ranks as separate processes (each with a timeout), like torchrun would."""

import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
