"""The clean-exit check at a high count (1,000 runs and more): the `exit_queued`
scenario of python/tests/torch_lifecycle_worker.py (queued > 1 MiB async all_reduces, a
then() callback, then exit without waiting) run N times with 2 ranks, each rank a process
that exits through the interpreter's normal shutdown (atexit hooks, finalization, static
destructors), its exit status counted.

scripts/exit_loop.sh starts every rank as a fresh interpreter, which costs about 3 CPU-seconds
of `import torch` per rank: 1,000 runs are an hour and a half of both cores. This driver
imports torch, torch.distributed and oxccl.torch once and forks the two ranks of every run
from that parent (a "zygote", as Android and some serving stacks start workers; a DataLoader
forks its workers the same way). The parent makes no process group and starts no thread
beyond the one `import torch` starts (checked before every fork: /proc/self/task may not grow
past its count after the imports), so each child starts as a fresh interpreter would after
its imports: it makes its group, queues its calls and leaves by `sys.exit(0)` from the top of
its stack, which runs the same shutdown path as a process started from the shell. What
differs from a fresh start: the imports were made before the fork, and frozen (`gc.freeze()`)
so that the final collection skips them; the shutdown under test (oxccl's exit hook, the
completion threads, finalization, static destructors) is the same.

    .venv/bin/python scripts/exit_loop_fork.py 1000            # tally; exit 1 on any failure

Each run is bounded by EXIT_LOOP_TIMEOUT seconds (default 120): a rank past it is killed and
counted as a failure. Every failing run's output is kept under LOG_DIR (default: a fresh
temporary folder).
"""

import gc
import os
import signal
import socket
import sys
import tempfile
import time

import torch  # noqa: F401 - imported once, before the forks
import torch.distributed as dist  # noqa: F401

import oxccl.torch  # noqa: F401 - the backend (and its exit hooks) as a rank would load it

# What was imported goes to the collector's permanent generation (as prefork servers do), so
# that each child's shutdown does not walk torch's objects again: without it the final
# collection of the imports costs a child seconds of CPU at load. What the child makes (its
# group, tensors, works) is collected as in any process.
gc.freeze()

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))
import torch_lifecycle_worker as worker  # noqa: E402


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def threads():
    return len(os.listdir("/proc/self/task"))


def rank_main(rank, port, log):
    """In the forked child: one rank of the scenario, output to `log`, then a normal exit."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OXCCL_SECRET="5f3c2a1b0e9d8c7b6a5f4e3d2c1b0a99",
    )
    os.environ.setdefault("OXCCL_TIMEOUT", "60")
    worker.exit_queued()
    sys.stdout.flush()
    # Leave through the interpreter's shutdown, as a script that ends does: SystemExit
    # unwinds to the top of the stack (the caller below lets it through).
    sys.exit(0)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    timeout = float(os.environ.get("EXIT_LOOP_TIMEOUT", "120"))
    log_dir = os.environ.get("LOG_DIR") or tempfile.mkdtemp(prefix="oxccl-exit-fork.")
    os.makedirs(log_dir, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = threads()  # `import torch` starts one native thread of its own
    tally = {}
    failed = 0
    t0 = time.monotonic()
    for i in range(1, n + 1):
        if threads() > base:
            print(
                f"exit_loop_fork: the parent has {threads()} threads before run {i} ({base} after its imports); "
                "a fork would not be a clean start",
                file=sys.stderr,
            )
            return 2
        port = free_port()
        pids = []
        logs = [os.path.join(log_dir, f"run{i}.rank{r}.log") for r in (0, 1)]
        for r in (0, 1):
            pid = os.fork()
            if pid == 0:
                try:
                    rank_main(r, port, logs[r])
                except SystemExit:
                    raise
                except BaseException as e:  # noqa: BLE001 - reported through the exit code
                    print(f"rank {r} raised {type(e).__name__}: {e}", flush=True)
                    os._exit(3)
            pids.append(pid)
        deadline = time.monotonic() + timeout
        status = {}
        while len(status) < 2:
            for r, pid in enumerate(pids):
                if r in status:
                    continue
                got, st = os.waitpid(pid, os.WNOHANG)
                if got:
                    status[r] = st
            if len(status) < 2:
                if time.monotonic() > deadline:
                    for r, pid in enumerate(pids):
                        if r not in status:
                            os.kill(pid, signal.SIGKILL)
                            _, st = os.waitpid(pid, 0)
                            status[r] = ("timeout", st)
                    break
                time.sleep(0.02)
        bad = False
        for r in (0, 1):
            st = status[r]
            if isinstance(st, tuple):
                key = f"killed past {timeout:.0f} s"
            elif os.WIFSIGNALED(st):
                key = f"signal {os.WTERMSIG(st)}"
            else:
                code = os.WEXITSTATUS(st)
                with open(logs[r]) as f:
                    ok = "exit_queued ok" in f.read()
                key = "0" if code == 0 and ok else (f"{code}" if code else "0 without 'exit_queued ok'")
            tally[key] = tally.get(key, 0) + 1
            bad |= key != "0"
        if bad:
            failed += 1
            print(f"run {i} failed: logs in {log_dir}/run{i}.rank*.log", file=sys.stderr, flush=True)
        else:
            for f in logs:
                os.remove(f)
        if i % 50 == 0 or i == n:
            spent = time.monotonic() - t0
            parts = " ".join(f"[exit {k}: {v}]" for k, v in sorted(tally.items()))
            print(f"after {i} runs (2 ranks each, {spent:.0f} s): {parts}", flush=True)
    print(f"exit_loop_fork: {failed} of {n} runs had a rank that did not exit 0 (logs of failures: {log_dir})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
