"""The rank side of test_torch_p2p_calls.py: gather, scatter and uneven all_to_all (the calls
the backend runs as point-to-point messages) next to user sends of the same tag, size and
dtype, and after a call refused on one rank only. Each receive must get its own call's data
(a receive that took the first message of its source and tag would swap them, as gloo does)
or raise, never return another call's bytes.

    python torch_p2p_calls_worker.py
    P2P_CALLS_GROUPS=gloo python torch_p2p_calls_worker.py   # the same checks on gloo
"""

import datetime
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

import oxccl  # noqa: F401
import oxccl.torch  # noqa: F401 - registers "oxccl"

R = int(os.environ["RANK"])
N = int(os.environ["WORLD_SIZE"])
GROUPS = os.environ.get("P2P_CALLS_GROUPS", "oxccl")
CHECKS = []

warnings.filterwarnings("ignore")

USER, GATHER, SCATTER, A2A = 1, 2, 3, 4


def check(fn):
    CHECKS.append(fn)
    return fn


def block(src, what, rows=2):
    """The block `src` sends for call `what`: the same shape and dtype for every call."""
    return torch.full((rows, 2), float(100 * what + src))


def eq(got, want, what):
    assert torch.equal(got, want), f"{what}: got {got.flatten().tolist()} want {want.flatten().tolist()}"


def raised(fn):
    """The exception `fn` raises, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the refusal expected
        return e
    return None


def refused(fn, what):
    try:
        fn()
    except Exception:  # noqa: BLE001 - the refusal expected
        return
    raise AssertionError(f"{what}: accepted")


@check
def gather_refused_on_the_root_then_retried(g):
    """Rank 1 sends a user message, then gathers; the root refuses its first gather (a
    gather_list of the wrong length), retries, then receives: the gather gets the gather's
    block and the recv the user message. On oxccl the root's refusal reaches every rank
    before any data moves (each raises it, naming the root's reason), and every rank
    retries; on gloo the others wait in their first gather for the root's retry."""
    if R == 0:
        refused(lambda: dist.gather(block(0, GATHER), [torch.zeros(2, 2) for _ in range(N + 1)], dst=0, group=g),
                "a gather_list of N+1 tensors")
        outs = [torch.zeros(2, 2) for _ in range(N)]
        dist.gather(block(0, GATHER), outs, dst=0, group=g)
        for p in range(N):
            eq(outs[p], block(p, GATHER), f"gather block of rank {p}")
        for p in range(1, N):
            u = torch.zeros(2, 2)
            dist.recv(u, src=p, group=g)
            eq(u, block(p, USER), f"user message of rank {p}")
    else:
        dist.send(block(R, USER), dst=0, group=g)
        if GROUPS == "oxccl":
            e = raised(lambda: dist.gather(block(R, GATHER), dst=0, group=g))
            assert e is not None and "the root (rank 0) refused" in str(e) and f"{N + 1} output tensors" in str(e), e
        dist.gather(block(R, GATHER), dst=0, group=g)


@check
def scatter_refused_on_the_root_then_retried(g):
    """The root refuses its first scatter (a scatter_list of the wrong length), sends a user
    message to every rank, then scatters: each rank's scatter gets its block, its recv the
    user message. On oxccl every rank raises the root's refusal first and retries, as in
    gather_refused_on_the_root_then_retried."""
    out = torch.zeros(2, 2)
    if R == 0:
        refused(lambda: dist.scatter(out, [block(0, SCATTER)] * (N + 1), src=0, group=g), "a scatter_list of N+1 tensors")
        for p in range(1, N):
            dist.send(block(p, USER), dst=p, group=g)
        dist.scatter(out, [block(p, SCATTER) for p in range(N)], src=0, group=g)
        eq(out, block(0, SCATTER), "the root's own block")
    else:
        if GROUPS == "oxccl":
            e = raised(lambda: dist.scatter(out, src=0, group=g))
            assert e is not None and "the root (rank 0) refused" in str(e) and f"{N + 1} input tensors" in str(e), e
            eq(out, torch.zeros(2, 2), "nothing received by the refused scatter")
        dist.scatter(out, src=0, group=g)
        eq(out, block(R, SCATTER), "scatter block")
        u = torch.zeros(2, 2)
        dist.recv(u, src=0, group=g)
        eq(u, block(R, USER), "user message")


def rows(src, dst):
    return 1 + src + 2 * dst


@check
def uneven_all_to_all_after_user_sends(g):
    """Every rank sends every other a user message the size of its all_to_all block, then
    an uneven all_to_all_single, then receives the user messages."""
    for p in range(N):
        if p != R:
            dist.send(block(R, USER, rows(R, p)), dst=p, group=g)
    inp = torch.cat([block(R, A2A, rows(R, p)) for p in range(N)])
    out = torch.zeros(sum(rows(p, R) for p in range(N)), 2)
    dist.all_to_all_single(out, inp, [rows(p, R) for p in range(N)], [rows(R, p) for p in range(N)], group=g)
    eq(out, torch.cat([block(p, A2A, rows(p, R)) for p in range(N)]), "all_to_all_single")
    for p in range(N):
        if p != R:
            u = torch.zeros(rows(p, R), 2)
            dist.recv(u, src=p, group=g)
            eq(u, block(p, USER, rows(p, R)), f"user message of rank {p}")


@check
def batch_refused_then_retried(g):
    """Rank 1's batch_isend_irecv is refused at its second operation (a negative tag), then
    retried: its first isend must not also go out (torch issues a batch one operation at a
    time), else rank 0's later recv takes that extra copy instead of the later send."""
    if R > 1:
        return
    peer = 1 - R
    t, u = block(R, USER), torch.zeros(2, 2)
    if R == 1:
        refused(lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer, g),
                                                dist.P2POp(dist.irecv, u, peer, g, tag=-1)]),
                "a negative tag")
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer, g), dist.P2POp(dist.irecv, u, peer, g)]):
        w.wait()
    eq(u, block(peer, USER), "the batch's receive")
    if R == 0:
        z = torch.zeros(2, 2)
        dist.recv(z, src=1, group=g)
        eq(z, block(1, GATHER), "the recv after the batch")
    else:
        dist.send(block(1, GATHER), dst=0, group=g)


def gather_against_scatter(g):
    """Rank 0 gathers while the others scatter from rank 0: every rank raises a mismatch
    naming both calls (not a timeout, not the other call's bytes). Breaks the group."""
    out = torch.full((2, 2), -1.0)
    try:
        if R == 0:
            dist.gather(block(0, GATHER), [torch.zeros(2, 2) for _ in range(N)], dst=0, group=g)
        else:
            dist.scatter(out, src=0, group=g)
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        assert "mismatch" in msg and "gather" in msg and "scatter" in msg and "collective #1" in msg, msg
        eq(out, torch.full((2, 2), -1.0), "nothing received")
        return
    raise AssertionError("gather against scatter: accepted")


def main():
    # gloo for the default group (barriers between checks); each check on an oxccl group of its
    # own, so that a check that breaks its communicator does not fail the next ones
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    want = "BackendOxcclCpp"
    groups = GROUPS
    bad = []
    # (gather against scatter waits forever on gloo)
    for fn in CHECKS + ([gather_against_scatter] if groups == "oxccl" else []):
        g = dist.new_group(list(range(N)), backend=groups)
        kind = type(g._get_backend(torch.device("cpu"))).__name__
        assert groups != "oxccl" or kind == want, f"the oxccl backend in use is {kind}, expected {want}"
        try:
            fn(g)
        except Exception as e:  # noqa: BLE001
            bad.append(f"{fn.__name__}: {e!r}" + ("" if isinstance(e, AssertionError) else "\n" + traceback.format_exc()))
        dist.barrier()
    for line in bad:
        print(f"rank {R}: WRONG {line}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        sys.exit(1)
    print(f"rank {R}: {len(CHECKS) + 1} checks: torch p2p calls ok", flush=True)


if __name__ == "__main__":
    main()
