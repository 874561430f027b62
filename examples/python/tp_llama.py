"""Tensor-parallel token generation with a small Llama-like decoder (random weights, no
download): RMSNorm, rotary attention with a KV cache, SwiGLU MLP; attention heads and MLP
columns split over the ranks (column-parallel q/k/v and gate/up, row-parallel o and down,
one all_reduce after each), the vocabulary split too (each rank computes its slice of the
logits, then an all_gather), as vLLM, SGLang and DeepSpeed inference do on CPUs.

Every way of all-reducing first generates in float32 and must give the single-process
model's tokens (and logits within 1e-3); then each is timed in --dtype (bfloat16 by
default), in the same processes, alternating rounds. The ways:

- ``oxccl_op``: ``oxccl.torch.inference_all_reduce`` / ``inference_all_gather`` (oxccl's
  torch op for inference), where the installed oxccl has them;
- ``oxccl``: ``dist.all_reduce`` on an "oxccl" process group;
- ``gloo``: ``dist.all_reduce`` on a "gloo" process group;
- ``ds``: DeepSpeed's ``deepspeed.comm.inference_all_reduce`` (its shared-memory op), where
  DeepSpeed is installed and builds its op (``bash ../shared/anchors/install_more.sh``).

    torchrun --nproc-per-node 2 examples/python/tp_llama.py                  # benchmark
    torchrun --nproc-per-node 2 examples/python/tp_llama.py --tokens 8 --rounds 1   # quick check
    oxccl run -n 2 -- python examples/python/tp_llama.py --ways oxccl,gloo

Prints, per way: tokens per second and per-token latency (p50, p99) of the slowest rank, and
how many greedy tokens equal the single-process model's in --dtype (in bfloat16 a random
model's nearly flat logits let any change of summation order flip a token after a few).
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import oxccl.torch as oxt  # registers the "oxccl" backend


class Config:
    def __init__(self, a):
        self.vocab = a.vocab
        self.dim = a.dim
        self.layers = a.layers
        self.heads = a.heads
        self.hidden = a.hidden
        self.max_len = a.prompt + a.tokens
        self.head_dim = a.dim // a.heads


def make_weights(cfg, seed, dtype):
    """The full model's weights, the same on every rank (a fixed seed)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    layers = []
    for _ in range(cfg.layers):
        layers.append(
            dict(
                attn_norm=torch.ones(cfg.dim, dtype=dtype),
                wq=w(cfg.dim, cfg.dim),
                wk=w(cfg.dim, cfg.dim),
                wv=w(cfg.dim, cfg.dim),
                wo=w(cfg.dim, cfg.dim),
                mlp_norm=torch.ones(cfg.dim, dtype=dtype),
                w_gate=w(cfg.hidden, cfg.dim),
                w_up=w(cfg.hidden, cfg.dim),
                w_down=w(cfg.dim, cfg.hidden),
            )
        )
    return dict(
        embed=w(cfg.vocab, cfg.dim, scale=1.0),
        layers=layers,
        norm=torch.ones(cfg.dim, dtype=dtype),
        lm_head=w(cfg.vocab, cfg.dim),
    )


def shard(full, cfg, rank, n):
    """This rank's slices: q/k/v and gate/up by output rows (heads, columns), o and down by
    input columns, the LM head by vocabulary rows."""
    hs = cfg.heads // n * cfg.head_dim  # this rank's share of the attention width
    fs = cfg.hidden // n
    vs = cfg.vocab // n

    def rows(t, size):
        return t[rank * size : (rank + 1) * size].contiguous()

    def cols(t, size):
        return t[:, rank * size : (rank + 1) * size].contiguous()

    layers = []
    for L in full["layers"]:
        layers.append(
            dict(
                attn_norm=L["attn_norm"],
                wq=rows(L["wq"], hs),
                wk=rows(L["wk"], hs),
                wv=rows(L["wv"], hs),
                wo=cols(L["wo"], hs),
                mlp_norm=L["mlp_norm"],
                w_gate=rows(L["w_gate"], fs),
                w_up=rows(L["w_up"], fs),
                w_down=cols(L["w_down"], fs),
            )
        )
    return dict(embed=full["embed"], layers=layers, norm=full["norm"], lm_head=rows(full["lm_head"], vs))


def rms_norm(x, w, eps=1e-6):
    v = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(v + eps)).to(x.dtype) * w


def rope(cfg, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    t = torch.arange(cfg.max_len).float()
    f = torch.outer(t, inv)
    return f.cos().to(dtype), f.sin().to(dtype)


def apply_rope(x, cos, sin):
    # x: [heads, seq, head_dim]; rotate pairs (even, odd).
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


class Model:
    """The decoder over `n` ranks; `reduce(t)` sums partial results in place over the
    ranks, `gather(t)` concatenates the ranks' slices of the last dimension (n == 1: the
    single-process model, neither is called)."""

    def __init__(self, cfg, w, n, reduce=None, gather=None):
        self.cfg, self.w, self.n = cfg, w, n
        self.reduce, self.gather = reduce, gather
        self.local_heads = cfg.heads // n
        self.cos, self.sin = rope(cfg, w["embed"].dtype)

    def new_cache(self):
        c, dt = self.cfg, self.w["embed"].dtype
        shape = (self.local_heads, c.max_len, c.head_dim)
        return [(torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)) for _ in range(c.layers)]

    def forward(self, tokens, pos, cache):
        """Logits of the last position, given `tokens` at positions pos.. (prefill or one)."""
        c = self.cfg
        s = tokens.shape[0]
        x = self.w["embed"][tokens]  # [s, dim]
        cos, sin = self.cos[pos : pos + s], self.sin[pos : pos + s]
        for L, (kc, vc) in zip(self.w["layers"], cache):
            h = rms_norm(x, L["attn_norm"])
            q = (h @ L["wq"].T).view(s, self.local_heads, c.head_dim).transpose(0, 1)
            k = (h @ L["wk"].T).view(s, self.local_heads, c.head_dim).transpose(0, 1)
            v = (h @ L["wv"].T).view(s, self.local_heads, c.head_dim).transpose(0, 1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kc[:, pos : pos + s] = k
            vc[:, pos : pos + s] = v
            att = F.scaled_dot_product_attention(
                q, kc[:, : pos + s], vc[:, : pos + s], is_causal=False,
                attn_mask=self._mask(s, pos, x.dtype),
            )
            o = att.transpose(0, 1).reshape(s, -1) @ L["wo"].T  # partial sum over heads
            if self.n > 1:
                self.reduce(o)
            x = x + o
            h = rms_norm(x, L["mlp_norm"])
            m = (F.silu(h @ L["w_gate"].T) * (h @ L["w_up"].T)) @ L["w_down"].T
            if self.n > 1:
                self.reduce(m)
            x = x + m
        h = rms_norm(x[-1:], self.w["norm"])
        logits = h @ self.w["lm_head"].T  # [1, vocab / n]
        if self.n > 1:
            logits = self.gather(logits)
        return logits[0]

    @staticmethod
    def _mask(s, pos, dtype):
        if s == 1:
            return None
        # Causal over the new positions, everything before them visible.
        m = torch.full((s, pos + s), float("-inf"), dtype=dtype)
        return torch.triu(m, diagonal=pos + 1)

    def generate(self, prompt, steps, times=None):
        """Greedy decoding: the prompt's logits, then `steps` tokens (and per-token times)."""
        cache = self.new_cache()
        with torch.inference_mode():
            logits = self.forward(prompt, 0, cache)
            out, all_logits = [], [logits]
            pos = prompt.shape[0]
            for _ in range(steps):
                t0 = time.perf_counter()
                tok = int(torch.argmax(logits))
                out.append(tok)
                logits = self.forward(torch.tensor([tok]), pos, cache)
                pos += 1
                if times is not None:
                    times.append(time.perf_counter() - t0)
                all_logits.append(logits)
        return out, torch.stack(all_logits)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ways", default="oxccl_op,oxccl,gloo,ds")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=16, help="tokens of the float32 check")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    ways = [w for w in a.ways.split(",") if w]
    for w in ways:
        assert w in ("oxccl_op", "oxccl", "gloo", "ds"), f"unknown way {w}"

    dscomm = None
    if "ds" in ways:
        try:
            import deepspeed
            import deepspeed.comm as dscomm

            os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
            if dscomm.comm.cdb.shm_comm_op is None:
                raise RuntimeError("DeepSpeed did not build its shm op")
        except Exception as e:  # noqa: BLE001 - any reason makes the way unavailable
            print(f"# tp_llama: DeepSpeed's op unavailable ({type(e).__name__}: {e}); 'ds' left out", file=sys.stderr)
            ways.remove("ds")
            dscomm = None
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = Config(a)
    assert cfg.heads % n == 0 and cfg.hidden % n == 0 and cfg.vocab % n == 0, "sizes must divide by the ranks"
    groups = {"gloo": dist.new_group(backend="gloo")}
    if any(w.startswith("oxccl") for w in ways):
        groups["oxccl"] = dist.new_group(backend="oxccl")
    if "oxccl_op" in ways and not hasattr(oxt, "inference_all_reduce"):
        if rank == 0:
            print("# tp_llama: this oxccl has no oxccl.torch.inference_all_reduce; 'oxccl_op' left out", file=sys.stderr)
        ways.remove("oxccl_op")

    def dist_gather(group):
        def g(t):
            # The ranks' [1, vocab/n] slices, stacked on dim 0: [n, vocab/n] -> [1, vocab].
            out = torch.empty((n * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)
            dist.all_gather_into_tensor(out, t.contiguous(), group=group)
            return out.reshape(1, -1)

        return g

    def op_gather(t):
        out = oxt.inference_all_gather(t.contiguous(), group=groups["oxccl"])
        # dim 0 concatenation of the ranks' [1, vocab/n] slices: [n, vocab/n] -> [1, vocab]
        return out.reshape(1, -1)

    comms = {}
    for w in ways:
        if w == "oxccl_op":
            comms[w] = (lambda t: oxt.inference_all_reduce(t, group=groups["oxccl"]), op_gather)
        elif w == "ds":
            comms[w] = (lambda t: dscomm.inference_all_reduce(t), dist_gather(groups["gloo"]))
        else:
            grp = groups[w]
            comms[w] = ((lambda g: lambda t: dist.all_reduce(t, group=g))(grp), dist_gather(grp))

    prompt = torch.randint(0, cfg.vocab, (a.prompt,), generator=torch.Generator().manual_seed(7))

    # 1. Correctness, in float32: every way's greedy tokens equal the single-process model's
    # and its logits are close (the sums' order differs: per-rank partial sums, then the
    # reduction). In bfloat16 a random model's nearly flat logits make greedy decoding
    # diverge after a few tokens under any change of summation order, so bfloat16 is timed
    # and its agreement reported, not required.
    full = make_weights(cfg, seed=1234, dtype=torch.float32)
    mine = shard(full, cfg, rank, n)
    steps = min(a.tokens, a.check_tokens)
    ref_tokens, ref_logits = Model(cfg, full, 1).generate(prompt, steps)
    for w in ways:
        red, gat = comms[w]
        toks, logits = Model(cfg, mine, n, red, gat).generate(prompt, steps)
        err = (logits - ref_logits).abs().max().item()
        scale = ref_logits.abs().max().item()
        if toks != ref_tokens or err > 1e-3 * max(1.0, scale):
            print(f"rank {rank}: {w}: float32 tokens or logits differ from the single-process model "
                  f"(max |diff| {err:.3g}, scale {scale:.3g}; tokens {toks} vs {ref_tokens})", file=sys.stderr)
            sys.exit(1)
    if dtype != torch.float32:
        full = make_weights(cfg, seed=1234, dtype=dtype)
        mine = shard(full, cfg, rank, n)
        ref_tokens, _ = Model(cfg, full, 1).generate(prompt, a.tokens)
    else:
        ref_tokens, _ = Model(cfg, full, 1).generate(prompt, a.tokens)
    del full

    # 2. Speed, in --dtype: the ways alternate, the order rotating each round.
    times = {w: [] for w in ways}
    agree = {w: a.tokens for w in ways}
    for r in range(a.rounds):
        order = ways[r % len(ways):] + ways[: r % len(ways)]
        for w in order:
            dist.barrier(group=groups["gloo"])
            red, gat = comms[w]
            tt = []
            toks, _ = Model(cfg, mine, n, red, gat).generate(prompt, a.tokens, tt)
            same = next((i for i, (x, y) in enumerate(zip(toks, ref_tokens)) if x != y), a.tokens)
            agree[w] = min(agree[w], same)
            times[w].extend(tt)

    def slowest(x):
        v = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=groups["gloo"])
        return v.item()

    rows = []
    for w in ways:
        t = sorted(times[w])
        p50 = slowest(t[len(t) // 2])
        p99 = slowest(t[min(len(t) - 1, int(len(t) * 0.99))])
        tps = slowest(sum(t) / len(t))
        rows.append((w, 1.0 / tps, p50 * 1e3, p99 * 1e3, agree[w]))
    if rank == 0:
        print(f"# tp_llama: {n} ranks, {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads, hidden {cfg.hidden}, "
              f"vocab {cfg.vocab}, {a.dtype}, prompt {a.prompt}, {a.tokens} tokens x {a.rounds} rounds, "
              f"{a.threads} thread(s) per rank; {2 * cfg.layers} all_reduces of {cfg.dim * dtype.itemsize} B per token")
        print(f"# float32 check: {steps} tokens of every way equal the single-process model's, logits within 1e-3")
        print(f"{'way':>9} {'tokens/s':>9} {'p50 ms':>8} {'p99 ms':>8}  first tokens equal to the 1-process {a.dtype} model")
        for w, tps, p50, p99, same in rows:
            print(f"{w:>9} {tps:>9.1f} {p50:>8.3f} {p99:>8.3f}  {same}/{a.tokens}")
    dist.barrier(group=groups["gloo"])
    print(f"rank {rank}: done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
