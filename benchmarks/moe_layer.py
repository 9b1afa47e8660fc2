"""MoE experts layer, fwd+bwd on CPU: blockwise reference vs torchtitan GroupedExperts vs a naive per-expert loop.

    .venv/bin/python benchmarks/moe_layer.py [--tokens 1024 --dim 256 --hidden 256 --block-size 16 --threads 1]

Every option has that default; `--experts 8 64 128 --dtypes float32 bfloat16 --repeats 2` are the others.

All three get the same routing and weights and compute grads for x, the top-k weights and the three expert
weights. torchtitan's path is `LocalTokenDispatcher` (sort by expert) + `GroupedExperts` (`torch._grouped_mm`)
+ combine. Stock GroupedExperts hard-casts x and the weights to bf16 inside forward; like the training path on
CPU, this script applies `workbench.platform.cpu_adjustments` so GroupedExperts computes in the input dtype and the fp32
rows compare fp32 with fp32 (pass --stock-titan to time torchtitan's unadjusted bf16-inside forward instead). The
naive loop is Hugging Face's eager pattern (mask, gather, MLP, index_add per expert).
Ratios are speedups of the reference: titan_time / ref_time and naive_time / ref_time. Not a test: numbers
depend on the machine (2 shared CPU cores here); timing is the best of `--repeats` rounds after a warm-up round.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench.kernels import blockwise_moe, dense_moe_oracle, route  # noqa: E402


def naive_loop(x, ids, w, w_gate, w_up, w_down):
    """Hugging Face's eager experts loop: per hit expert, gather its tokens, run the MLP, index_add_ back.

    In training its cost at large E is dominated by autograd: each `w_gate[e]` select materialises a full
    [E, F, D] zero gradient in backward.
    """
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, k = torch.where(ids == e)
        h = F.silu(x[tok] @ w_gate[e].T) * (x[tok] @ w_up[e].T)
        out.index_add_(0, tok, (h @ w_down[e].T) * w[tok, k, None].to(x.dtype))
    return out


def titan_layer(num_experts, top_k, dim, hidden):
    """torchtitan's EP=1 path; returns fn(x, ids, w, w_gate, w_up, w_down) that copies weights into its module."""
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    experts = GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=num_experts).build()
    dispatcher = LocalTokenDispatcher.Config(num_experts=num_experts, top_k=top_k).build()

    def run(x, ids, w, w_gate, w_up, w_down):
        # parameters are the benchmark's leaves, so grads land where the other paths put theirs
        experts.w1_EFD, experts.w3_EFD, experts.w2_EDF = w_gate, w_up, w_down
        counts = torch.bincount(ids.view(-1), minlength=num_experts)
        routed, counts, meta = dispatcher.dispatch(x, w, ids, counts)
        return dispatcher.combine(experts(routed, counts), meta, x)

    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):  # plain attributes from now on
        delattr(experts, name)
    return run


def make_inputs(tokens, num_experts, top_k, dim, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights, ids = route(torch.randn(tokens, num_experts, generator=g), top_k)
    tensors = [torch.randn(tokens, dim, generator=g), weights,
               torch.randn(num_experts, hidden, dim, generator=g) * dim ** -0.5,
               torch.randn(num_experts, hidden, dim, generator=g) * dim ** -0.5,
               torch.randn(num_experts, dim, hidden, generator=g) * hidden ** -0.5]
    x, w, wg, wu, wd = (t.to(dtype).requires_grad_() for t in tensors)
    return x, ids, w, wg, wu, wd


def time_fwd_bwd(fns, inputs, repeats, slow_s=5.0):
    """Best fwd+bwd seconds per path; paths run round-robin (fair under a fluctuating machine load).

    The first round is a warm-up; a path whose warm-up took over `slow_s` seconds is timed by that run alone.
    """
    x, ids, w, wg, wu, wd = inputs
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype)
    times = {name: [] for name in fns}
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            if round_ > 0 and times[name][0] > slow_s:
                continue
            for t in (x, w, wg, wu, wd):
                t.grad = None
            start = time.perf_counter()
            fn(x, ids, w, wg, wu, wd).backward(grad)
            times[name].append(time.perf_counter() - start)
    return {name: min(ts[1:] or ts) for name, ts in times.items()}


def check_agreement(fns, tokens, num_experts, top_k, dim, hidden):
    """Sanity: every path agrees with the dense oracle on a small fp32 problem (titan within bf16 error)."""
    inputs = make_inputs(min(tokens, 64), num_experts, top_k, dim, hidden, torch.float32, seed=3)
    want = dense_moe_oracle(*inputs).detach()
    for name, fn in fns.items():
        err = (fn(*inputs).detach() - want).abs().max().item() / want.abs().max().item()
        assert err < (2e-2 if name == "titan" else 1e-5), f"{name} disagrees with the oracle: rel err {err:.2e}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; 1 by default: on a shared 2-core box, threading the many "
                             "small per-expert GEMMs thrashes and makes the numbers noise (try 2 on an idle box)")
    parser.add_argument("--stock-titan", action="store_true",
                        help="time torchtitan's GroupedExperts as shipped (bf16 matmuls even for fp32 inputs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.stock_titan:
        from workbench.platform import cpu_adjustments

        cpu_adjustments.apply()  # GroupedExperts in the input dtype, as in CPU training

    print(f"MoE experts fwd+bwd, CPU ({torch.get_num_threads()} threads), T={args.tokens} D={args.dim} "
          f"F={args.hidden}, reference block_size={args.block_size}; best of {args.repeats} rounds after a warm-up")
    print("titan = LocalTokenDispatcher + GroupedExperts, "
          + ("stock: casts to bf16 internally, also in the fp32 rows" if args.stock_titan
             else "computing in the input dtype (workbench.platform.cpu_adjustments, as in CPU training)"))
    header = (f"{'E':>4} {'K':>2} {'dtype':>9} | {'reference':>10} {'titan':>10} {'naive':>10} | "
              f"{'vs titan':>8} {'vs naive':>8}")
    print(header + "\n" + "-" * len(header))
    speedups = {"titan": [], "naive": []}
    for E in args.experts:
        K = 2 if E <= 8 else 8
        fns = {
            "reference": lambda *a: blockwise_moe(*a, block_size=args.block_size),
            "titan": titan_layer(E, K, args.dim, args.hidden),
            "naive": naive_loop,
        }
        check_agreement(fns, args.tokens, E, K, args.dim, args.hidden)
        for dtype in args.dtypes:
            inputs = make_inputs(args.tokens, E, K, args.dim, args.hidden, getattr(torch, dtype))
            t = time_fwd_bwd(fns, inputs, args.repeats)
            vs = {name: t[name] / t["reference"] for name in ("titan", "naive")}
            for name in vs:
                speedups[name].append(vs[name])
            print(f"{E:>4} {K:>2} {dtype:>9} | {t['reference'] * 1e3:>8.1f}ms {t['titan'] * 1e3:>8.1f}ms "
                  f"{t['naive'] * 1e3:>8.1f}ms | {vs['titan']:>7.2f}x {vs['naive']:>7.2f}x")
    print(f"geomean speedup of the reference: {statistics.geometric_mean(speedups['titan']):.2f}x vs titan, "
          f"{statistics.geometric_mean(speedups['naive']):.2f}x vs naive (goal: >= 1.0x and >= 3x)")


if __name__ == "__main__":
    main()
