"""One rank of test_torch_inference.py: oxccl.torch.inference_all_reduce and
inference_all_gather, eagerly and under torch.compile(fullgraph=True), against references
computed locally from every rank's inputs.

    python torch_inference_worker.py MODE    (torchrun's variables set; MODE: eager, compile, dies,
                                              killed)
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import oxccl
import oxccl.torch as oxt

R = dist.ReduceOp
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int32, torch.int64) + tuple(
    getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)
)


def inputs(rank, count, dtype, seed):
    """Rank `rank`'s input: small integers (sums, products and means of them are exact in
    every float type at these world sizes, except AVG's division)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    lo = 0 if dtype in INTS and not dtype.is_signed else -3
    return torch.randint(lo, 4, (count,), generator=g).to(dtype)


def reference(ins, op, dtype):
    """The reduction computed here, in float64 or int64 (torch lacks arithmetic on some
    unsigned types)."""
    if op == R.AVG:
        return (torch.stack([t.to(torch.float64) for t in ins]).sum(0) / len(ins)).to(dtype)
    if dtype == torch.bool:
        acc = ins[0].clone()
        for t in ins[1:]:
            if op in (R.SUM, R.MAX, R.BOR):
                acc = acc | t
            elif op in (R.PRODUCT, R.MIN, R.BAND):
                acc = acc & t
            else:
                acc = acc ^ t
        return acc
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    acc = ins[0].to(wide)
    for t in ins[1:]:
        t = t.to(wide)
        if op == R.SUM:
            acc = acc + t
        elif op == R.PRODUCT:
            acc = acc * t
        elif op == R.MAX:
            acc = torch.maximum(acc, t)
        elif op == R.MIN:
            acc = torch.minimum(acc, t)
        elif op == R.BAND:
            acc = acc & t
        elif op == R.BOR:
            acc = acc | t
        elif op == R.BXOR:
            acc = acc ^ t
    return acc.to(dtype)


def ops_of(dtype):
    if dtype == torch.bool:
        return (R.SUM, R.MAX, R.MIN, R.PRODUCT, R.BAND, R.BOR, R.BXOR)
    if dtype in FLOATS:
        return (R.SUM, R.MAX, R.MIN, R.PRODUCT, R.AVG)
    return (R.SUM, R.MAX, R.MIN, R.PRODUCT, R.BAND, R.BOR, R.BXOR)


def same(got, want, op, what):
    if op == R.AVG and want.dtype in (torch.float16, torch.bfloat16):
        ok = torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    elif op == R.AVG:
        ok = torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        if want.dtype in INTS:
            got, want = got.to(torch.int64), want.to(torch.int64)
        ok = torch.equal(got, want)
    if not ok:
        bad = (got != want).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"{what}: wrong at {bad}: got {got.flatten()[bad].tolist()} want {want.flatten()[bad].tolist()}")


def check_all_reduce(members, me, group, seed):
    """Every dtype and op at sizes 0, 1 and odd; large ones for the common types; a
    non-contiguous tensor; the functional operator."""
    n = len(members)
    for dtype in FLOATS + INTS + (torch.bool,):
        for op in ops_of(dtype):
            for count in (0, 1, 7, 1001):
                seed += 1
                ins = [inputs(r, count, dtype, seed) for r in range(n)]
                t = ins[me].clone()
                out = oxt.inference_all_reduce(t, op=op, group=group)
                assert out is t
                same(t, reference(ins, op, dtype), op, f"all_reduce {dtype} {op} x{count}")
    for dtype, count in ((torch.float32, 1 << 20), (torch.bfloat16, (1 << 20) + 3), (torch.int64, 300_001)):
        seed += 1
        ins = [inputs(r, count, dtype, seed) for r in range(n)]
        t = ins[me].clone()
        oxt.inference_all_reduce(t, group=group)
        same(t, reference(ins, R.SUM, dtype), R.SUM, f"all_reduce {dtype} x{count}")
    # a non-contiguous view: reduced in place through a copy
    seed += 1
    ins = [inputs(r, 6 * 5, torch.float32, seed).view(6, 5) for r in range(n)]
    base = ins[me].clone()
    view = base.t()
    assert not view.is_contiguous()
    oxt.inference_all_reduce(view, op=R.MAX, group=group)
    same(base, reference(ins, R.MAX, torch.float32), R.MAX, "all_reduce of a transposed view")
    # the functional operator leaves its input alone
    t = ins[me].clone()
    h = oxt._group(group)[1]
    out = torch.ops.oxccl.inference_all_reduce(t, h, 0)
    same(t, ins[me], R.SUM, "functional all_reduce's input")
    same(out, reference(ins, R.SUM, torch.float32), R.SUM, "functional all_reduce")
    return seed


def check_all_gather(members, me, group, seed):
    n = len(members)
    for dtype in (torch.float32, torch.bfloat16, torch.int16, torch.bool, torch.complex64):
        for shape in ((0,), (1,), (7,), (3, 5), (2, 0, 3), (257, 3)):
            for dim in range(len(shape)):
                numel = 1
                for d in shape:
                    numel *= d
                full = [((torch.arange(numel) * (r + 2) + r) % 97).view(shape).to(dtype) for r in range(n)]
                got = oxt.inference_all_gather(full[me], group=group, dim=dim)
                want = torch.cat(full, dim)
                assert got.shape == want.shape, (got.shape, want.shape)
                assert torch.equal(got, want), f"all_gather {dtype} {shape} dim {dim}"
    scalar = torch.tensor(float(me + 1))
    got = oxt.inference_all_gather(scalar, group=group)
    assert torch.equal(got, torch.arange(1, n + 1, dtype=torch.float32)), got
    return seed


def expect_error(cls, fn, what):
    try:
        fn()
    except cls as e:
        return str(e)
    raise AssertionError(f"{what}: no {cls.__name__}")


def eager(rank, world):
    seed = 0
    seed = check_all_reduce(list(range(world)), rank, None, seed)
    seed = check_all_gather(list(range(world)), rank, None, seed)
    # a subgroup: ranks 0 and world-1 (with 3 ranks, rank 1 stays out)
    members = [0, world - 1]
    sub = dist.new_group(members, backend="oxccl")
    if rank in members:
        seed = check_all_reduce(members, members.index(rank), sub, seed)
        check_all_gather(members, members.index(rank), sub, seed)
    # what the ops refuse, on every rank before any data moves
    gloo = dist.new_group(backend="gloo")
    msg = expect_error(oxccl.InvalidArgumentError, lambda: oxt.inference_all_reduce(torch.ones(3), group=gloo), "gloo group")
    assert "not oxccl" in msg, msg
    msg = expect_error(oxccl.InvalidArgumentError, lambda: oxt.inference_all_reduce(torch.ones(3, dtype=torch.int16)), "int16")
    assert "int16" in msg.lower() or "short" in msg.lower(), msg
    premul = dist._make_nccl_premul_sum(2.0) if hasattr(dist, "_make_nccl_premul_sum") else None
    if premul is not None:
        expect_error(oxccl.InvalidArgumentError, lambda: oxt.inference_all_reduce(torch.ones(3), op=premul), "PREMUL_SUM")
    # still in step after the refusals
    t = torch.ones(5)
    oxt.inference_all_reduce(t)
    assert torch.equal(t, torch.full((5,), float(world)))


def compiled(rank, world):
    members = [0, world - 1]
    sub = dist.new_group(members, backend="oxccl")

    def step(x, w):
        h = x @ w  # a row-parallel linear's partial sum
        oxt.inference_all_reduce(h)
        h = torch.relu(h) + 1
        logits = oxt.inference_all_gather(h, dim=-1)  # vocabulary-parallel logits
        m = logits.clone()
        oxt.inference_all_reduce(m, op="max")
        return logits, m

    def sub_step(x):
        y = x * 2
        oxt.inference_all_reduce(y, group=sub)
        return oxt.inference_all_gather(y, group=sub)

    def mutate_input(x):
        oxt.inference_all_reduce(x)
        return x + 1

    backend = os.environ.get("INFER_COMPILE_BACKEND", "inductor")
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(7 + rank)
        x = torch.randint(-3, 4, (4, 8), generator=g).to(dtype)
        w = torch.randint(-2, 3, (8, 6), generator=g).to(dtype)
        want = step(x.clone(), w)
        got = torch.compile(step, fullgraph=True, backend=backend)(x.clone(), w)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b), (dtype, a, b)
        if rank in members:
            want = sub_step(x.clone())
            got = torch.compile(sub_step, fullgraph=True, backend=backend)(x.clone())
            assert torch.equal(got, want), (got, want)
    x = torch.arange(6.0) + rank
    y = x.clone()
    want = mutate_input(y)
    got = torch.compile(mutate_input, fullgraph=True, backend=backend)(x)
    assert torch.equal(got, want) and torch.equal(x, y), (x, y)


def dies(rank, world):
    """Rank world-1 exits after one call, while the others wait in their next one: it must
    raise within the timeout."""
    t = torch.ones(1024)
    oxt.inference_all_reduce(t)
    if rank == world - 1:
        time.sleep(0.5)
        os._exit(0)
    t0 = time.monotonic()
    try:
        for _ in range(100_000):
            oxt.inference_all_reduce(t)
    except oxccl.Error as e:
        print(f"raised {type(e).__name__} after {time.monotonic() - t0:.2f} s: {e}", flush=True)
        os._exit(0)
    print("no error", flush=True)
    os._exit(1)


def killed(rank, world):
    """Checked inference_all_reduce calls of INFER_KILL_NUMEL floats in a loop (60 s at most),
    "ready" after the first; the test SIGKILLs or SIGSTOPs one rank meanwhile. A rank whose call
    raises prints what and when, and exits 0; a wrong sum exits 2."""
    numel = int(os.environ.get("INFER_KILL_NUMEL", "1024"))
    want = float(world * (world + 1) // 2)
    t = torch.empty(numel)
    t0 = time.monotonic()
    first = True
    while time.monotonic() - t0 < 60:
        t.fill_(rank + 1)
        started = time.monotonic()
        try:
            oxt.inference_all_reduce(t)
        except oxccl.Error as e:
            print(f"raised {type(e).__name__} after {time.monotonic() - started:.2f} s: {e}", flush=True)
            os._exit(0)
        if not bool((t == want).all()):
            print(f"wrong sum: {t[:4].tolist()}, want {want}", flush=True)
            os._exit(2)
        if first:
            print("ready", flush=True)
            first = False
    print("no error", flush=True)
    os._exit(1)


def main():
    mode = sys.argv[1]
    dist.init_process_group("oxccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert oxt._CPP is not None, "the C++ torch backend must be built (python -m oxccl.build_torch_ext)"
    {"eager": eager, "compile": compiled, "dies": dies, "killed": killed}[mode](rank, world)
    dist.barrier()
    print(f"inference {mode} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
