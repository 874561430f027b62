"""Runs PyTorch's own distributed test suite (``DistributedTest._DistTestBase`` from
``torch/testing/_internal/distributed/distributed_test.py``, the suite torch's
``test/distributed/test_distributed_spawn.py`` runs with ``BACKEND=gloo``) against oxccl.

    python run_distributed_test.py --backend oxccl --world-size 2
    python run_distributed_test.py --backend gloo --world-size 3 -k test_all_reduce

What it does, as ``test_distributed_spawn.py`` and torch's ``run_test.py`` do: sets
``BACKEND``, ``WORLD_SIZE``, ``INIT_METHOD``, ``TEMP_DIR`` (and the per-test timeout,
``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``), imports ``oxccl.torch`` (which registers the backend
``"oxccl"``), then defines ``TestDistBackendWithSpawn(TestDistBackend, _DistTestBase)``: every
test starts ``WORLD_SIZE`` rank processes that each call ``init_process_group(backend=BACKEND)``
on a file store, run the test body, and report to the parent, which joins them within the
timeout.

The suite decides what to run, and what to expect, from ``BACKEND`` compared with backend
names: ``BACKEND != "gloo"`` skips the CPU-only tests (batch_isend_irecv on CPU, timeouts,
sparse all_reduce), ``require_backend_is_available({"gloo"})`` guards monitored_barrier and
DDP-on-CPU tests, ``DistTestCases.backend_feature`` lists the backends that support DDP,
subgroups and the object collectives. So that the gloo branches apply to oxccl, the suite's
module is compiled from its source with those comparisons rewritten (an AST pass,
``_GlooLike``: ``BACKEND == "gloo"`` becomes ``BACKEND in ("gloo", "oxccl")``, the same for
``!=`` and the backend sets given to ``require_backend_is_available``; line numbers are
kept, so tracebacks point into the installed file), and oxccl is added to every feature set
that holds gloo (the GPU ones guard tests that also check for devices at run time). Not to
the suite's lists of backends whose per-call profiler events it checks, unless
``--profiler-events``: oxccl does not record them (see docs/torch.md). Everything else, the
backend name passed to ``init_process_group``, ``dist.get_backend()``, and every assertion,
is the suite's own. ``OXCCL_TIMEOUT`` is cleared: the suite gives each group its timeout.

Which tests run: ``selected_tests.txt`` next to this file (the tests that pass on gloo on a
CPU-only machine; docs/torch.md says what the rest are), or ``-k`` substrings, or ``--all``.
The outcome of each test is compared with ``expected_failures.txt``: the run fails (exit
status 1) when a test not listed there fails, errors or times out, when a listed test
passes (so the list stays honest), when a selected test skips, and when the list names a
test that is not selected. ``--no-expect`` just reports. With ``--backend gloo`` every
selected test must pass.

Rank processes are forked from this process by default (``--start-method fork``: torch and
the suite are imported once, which makes a test about 0.5 s instead of 10-30 s on a busy
2-core machine); ``--start-method spawn`` starts them as ``test_distributed_spawn.py`` does
(they import this file again as ``__mp_main__``). A forked rank ends with ``os._exit``, as
every multiprocessing fork child does, so ``atexit`` handlers do not run there (the suite
destroys its process group before; a spawned rank exits normally). Each rank's output goes
to a log file, printed with ``-v`` and kept when the run fails.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
#: Backends the suite's gloo branches apply to.
GLOO_LIKE = ("gloo", "oxccl")


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="oxccl", choices=["oxccl", "gloo"])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--timeout", type=int, default=None, help="per-test timeout in seconds (default 30; 120 with spawn)"
    )
    p.add_argument("--select", default=os.path.join(HERE, "selected_tests.txt"), help="file of test names to run")
    p.add_argument(
        "-k", action="append", default=[], help="run the tests whose name contains this (repeatable)"
    )
    p.add_argument("--all", action="store_true", help="run every test of the suite (slow: for surveys)")
    p.add_argument("--expected", default=os.path.join(HERE, "expected_failures.txt"))
    p.add_argument("--no-expect", action="store_true", help="report only; do not compare with expected_failures.txt")
    p.add_argument("--start-method", default="fork", choices=["fork", "spawn"])
    p.add_argument(
        "--profiler-events",
        action="store_true",
        help="expect gloo's per-call profiler events (\"oxccl:all_reduce\") from oxccl too",
    )
    p.add_argument("--list", action="store_true", help="print the selected test names and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print each failure's output")
    return p.parse_args(argv)


def _config_tags(backend, world_size):
    """The tags an expected-failure line may restrict itself to, for this run."""
    return {backend, f"ws{world_size}"}


def read_expected(path, tags):
    """Reads ``expected_failures.txt``: ``name [tag ...]: reason`` per line (``#`` comments).
    Tags (``ws2``, ``ws3``) restrict a line to runs that have all of them.
    Returns {name: reason} for the lines that apply to this run."""
    expected = {}
    if not os.path.exists(path):
        return expected
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            head, sep, reason = line.partition(":")
            words = head.split()
            if not sep or not words or not reason.strip():
                raise SystemExit(f"{path}:{lineno}: expected 'test_name [tags]: reason', got {line!r}")
            name, line_tags = words[0], set(words[1:])
            unknown = line_tags - {"ws2", "ws3"}
            if unknown:
                raise SystemExit(f"{path}:{lineno}: unknown tags {sorted(unknown)}")
            if line_tags <= tags:
                expected[name] = reason.strip()
    return expected


class _GlooLike(ast.NodeTransformer):
    """Rewrites the suite's backend-name tests so that its gloo branches apply to oxccl."""

    def __init__(self):
        self.compares = 0
        self.requires = 0

    @staticmethod
    def _is_backend(node):
        return isinstance(node, ast.Name) and node.id == "BACKEND"

    def visit_Compare(self, node):
        self.generic_visit(node)
        if (
            self._is_backend(node.left)
            and len(node.ops) == 1
            and isinstance(node.ops[0], (ast.Eq, ast.NotEq))
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value == "gloo"
        ):
            self.compares += 1
            op = ast.In() if isinstance(node.ops[0], ast.Eq) else ast.NotIn()
            names = ast.Tuple([ast.Constant(n) for n in GLOO_LIKE], ast.Load())
            return ast.copy_location(ast.Compare(node.left, [op], [names]), node)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "require_backend_is_available"
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Set)
            and any(isinstance(e, ast.Constant) and e.value == "gloo" for e in node.args[0].elts)
        ):
            self.requires += 1
            node.args[0].elts.extend(ast.Constant(n) for n in GLOO_LIKE if n != "gloo")
        return node


def load_suite():
    """Imports the suite module, compiled from its rewritten source, under its own name."""
    from torch.testing._internal.common_distributed import DistTestCases

    # Where the suite lists gloo as supporting something, oxccl too ("gpu" and "cuda" guard
    # tests that also need devices at run time, and gloo passes some of them on CPU).
    for feature in DistTestCases.backend_feature.values():
        if "gloo" in feature:
            feature.update(n for n in GLOO_LIKE if n != "gloo")
    DistTestCases.backend_feature["plugin"].add("oxccl")
    spec = importlib.util.find_spec(SUITE_MODULE)
    with open(spec.origin) as f:
        tree = ast.parse(f.read(), spec.origin)
    rewrite = _GlooLike()
    tree = ast.fix_missing_locations(rewrite.visit(tree))
    # torch 2.15's suite has 20 comparisons and 15 requirements; far fewer means the suite
    # changed the way it names backends, and this launcher must be looked at again.
    if rewrite.compares < 10 or rewrite.requires < 8:
        raise SystemExit(
            f"{spec.origin}: found only {rewrite.compares} BACKEND ==/!= 'gloo' tests and "
            f"{rewrite.requires} require_backend_is_available({{'gloo'}}): the suite changed"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[SUITE_MODULE] = module
    # dont_inherit: this file's `from __future__ import annotations` must not leak into the
    # suite (DDP checks a comm hook's annotation against dist.GradBucket itself).
    exec(compile(tree, spec.origin, "exec", dont_inherit=True), module.__dict__)
    if os.environ.get("OXCCL_SUITE_PROFILER_EVENTS") == "1":
        # The backends whose calls the profiler checks expect to find as "<backend>:<op>"
        # events (gloo's Works record them; oxccl's do not: see docs/torch.md).
        for name in ("PROFILING_SUPPORTED_BACKENDS", "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
            getattr(module, name).extend(n for n in GLOO_LIKE if n != "gloo")
    return module


def rank_log(test_name, rank):
    """The file a rank's output of a test goes to."""
    return os.path.join(os.environ["OXCCL_SUITE_LOG_DIR"], f"{test_name}.rank{rank}.log")


def setup(backend, world_size, timeout, start_method):
    """Sets the suite's environment, registers oxccl, loads the suite, and defines
    ``TestDistBackendWithSpawn`` in this module (spawned ranks import it again, as
    ``__mp_main__``, and run this from the environment)."""
    os.environ["BACKEND"] = backend
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("INIT_METHOD", "env://")
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(timeout)
    os.environ["OXCCL_SUITE_START_METHOD"] = start_method
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The suite gives each group its timeout (60 s, 1 s in the timeout tests); OXCCL_TIMEOUT
    # would override them.
    os.environ.pop("OXCCL_TIMEOUT", None)
    if "OXCCL_SUITE_LOG_DIR" not in os.environ:
        # TEMP_DIR as torch's run_test.py makes it (each test's setUp makes its own too).
        tmp = tempfile.mkdtemp(prefix="oxccl_torch_suite_")
        os.environ["TEMP_DIR"] = tmp
        for d in ("barrier", "test_dir", "init_dir", "logs"):
            os.mkdir(os.path.join(tmp, d))
        os.environ["OXCCL_SUITE_LOG_DIR"] = os.path.join(tmp, "logs")

    if backend == "oxccl":
        import oxccl.torch  # noqa: F401  registers "oxccl"
    import logging

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    suite = load_suite()
    # Not one "Started process" line per rank and test; failures are still logged.
    logging.getLogger("torch.testing._internal.common_distributed").setLevel(logging.WARNING)

    class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        """As in torch's test_distributed_spawn.py, with the start method chosen here."""

        def setUp(self):
            super().setUp()
            if start_method == "spawn":
                self._spawn_processes()
            else:
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            # Each rank's output goes to its own log (printed with -v); the parent reports
            # a failing rank's traceback anyway.
            log = rank_log(test_name, rank)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            super()._run(rank, test_name, file_name, pipe, **kwargs)

    TestDistBackendWithSpawn.__module__ = __name__
    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"
    globals()["TestDistBackendWithSpawn"] = TestDistBackendWithSpawn
    return TestDistBackendWithSpawn


def main(argv=None):
    a = _args(argv if argv is not None else sys.argv[1:])
    if a.timeout is None:
        # Spawned ranks import torch and the suite again: 10-30 s a test on a busy 2-core machine.
        a.timeout = 120 if a.start_method == "spawn" else 30
    if a.profiler_events:
        os.environ["OXCCL_SUITE_PROFILER_EVENTS"] = "1"
    TestDistBackendWithSpawn = setup(a.backend, a.world_size, a.timeout, a.start_method)
    import torch

    names = sorted(n for n in dir(TestDistBackendWithSpawn) if n.startswith("test"))
    if a.k:
        names = [n for n in names if any(k in n for k in a.k)]
    elif not a.all:
        with open(a.select) as f:
            wanted = [w for w in (ln.split("#", 1)[0].strip() for ln in f) if w]
        missing = sorted(set(wanted) - set(names))
        if missing:
            raise SystemExit(f"{a.select}: not in the suite: {missing}")
        names = [n for n in names if n in set(wanted)]
    if a.list:
        print("\n".join(names))
        shutil.rmtree(os.path.dirname(os.environ["OXCCL_SUITE_LOG_DIR"]), ignore_errors=True)
        return 0

    tags = _config_tags(a.backend, a.world_size)
    # On gloo every selected test must pass: the selection is the tests that pass there.
    expected = {} if a.no_expect or a.backend == "gloo" else read_expected(a.expected, tags)
    print(
        f"== torch {torch.__version__} distributed_test.py: backend {a.backend}, "
        f"world size {a.world_size}, {len(names)} tests, timeout {a.timeout}s each, "
        f"{a.start_method}",
        flush=True,
    )

    outcomes = {}
    t_all = time.monotonic()
    TestDistBackendWithSpawn.setUpClass()  # as unittest's suite would (MASTER_ADDR)
    for name in names:
        test = TestDistBackendWithSpawn(name)
        result = unittest.TestResult()
        t0 = time.monotonic()
        test.run(result)
        dt = time.monotonic() - t0
        if result.skipped:
            outcome, detail = "skip", result.skipped[0][1]
        elif result.failures or result.errors:
            outcome = "FAIL"
            detail = (result.failures or result.errors)[0][1]
            if dt >= a.timeout or "terminated or timed out after" in detail:
                outcome = "TIMEOUT"
        elif result.expectedFailures:
            outcome, detail = "xfail", ""
        else:
            outcome, detail = "pass", ""
        outcomes[name] = (outcome, detail)
        status, note = outcome, ""
        if outcome in ("FAIL", "TIMEOUT") and name in expected:
            status, note = f"x{outcome.lower()}", f"  (expected: {expected[name][:90]})"
        elif outcome == "pass" and name in expected:
            status = "UNEXPECTED PASS"
        line = f"{status:<10} {dt:6.1f}s {name}{note}"
        if outcome == "skip":
            line += f"  ({detail.strip().splitlines()[-1][:100] if detail.strip() else ''})"
        print(line, flush=True)
        if outcome in ("FAIL", "TIMEOUT") and (a.verbose or (not a.no_expect and name not in expected)):
            print(_last_lines(detail, 40), flush=True)
            if a.verbose:
                for r in range(a.world_size):
                    if os.path.exists(rank_log(name, r)):
                        with open(rank_log(name, r), errors="replace") as f:
                            print(f"  --- rank {r} output\n" + _last_lines(f.read(), 40), flush=True)
    TestDistBackendWithSpawn.tearDownClass()
    total = time.monotonic() - t_all

    failed = sorted(n for n, (o, _) in outcomes.items() if o in ("FAIL", "TIMEOUT"))
    passed = sorted(n for n, (o, _) in outcomes.items() if o == "pass")
    skipped = sorted(n for n, (o, _) in outcomes.items() if o == "skip")
    unexpected_fail = [] if a.no_expect else [n for n in failed if n not in expected]
    unexpected_pass = [n for n in passed if n in expected]
    print(
        f"== {len(passed)} passed, {len(failed)} failed ({len(failed) - len(unexpected_fail)} "
        f"expected), {len(skipped)} skipped in {total:.0f}s "
        f"(backend {a.backend}, world size {a.world_size})"
    )
    rc = 0
    if not (a.k or a.all or a.no_expect):
        # The selection is the tests that pass on gloo: a skip hides one, and a line of
        # expected_failures.txt naming no selected test is stale.
        if skipped:
            print("== selected but skipped (they pass on gloo):\n  " + "\n  ".join(skipped))
            rc = 1
        stale = sorted(set(expected) - set(names))
        if stale:
            print("== expected_failures.txt names tests that are not selected:\n  " + "\n  ".join(stale))
            rc = 1
    if unexpected_fail:
        print("== failed and not in expected_failures.txt:\n  " + "\n  ".join(unexpected_fail))
        rc = 1
    if unexpected_pass:
        print("== passed but listed in expected_failures.txt (remove them):\n  " + "\n  ".join(unexpected_pass))
        rc = 1
    logs = os.environ["OXCCL_SUITE_LOG_DIR"]
    if rc or a.verbose:
        print(f"== each rank's output: {logs}")
    else:
        shutil.rmtree(os.path.dirname(logs), ignore_errors=True)
    return rc


def _last_lines(text, n):
    lines = text.rstrip().splitlines()
    return "    " + "\n    ".join(lines[-n:])


if __name__ == "__mp_main__":
    # A spawned rank process: the same setup, from the environment the parent set.
    setup(
        os.environ["BACKEND"],
        int(os.environ["WORLD_SIZE"]),
        int(os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"]),
        os.environ["OXCCL_SUITE_START_METHOD"],
    )

if __name__ == "__main__":
    sys.exit(main())
