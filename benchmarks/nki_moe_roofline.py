"""Roofline figure of the NKI MoE layer: modeled trn2 time of one rank's layer vs block size, the floors as lines.

    .venv/bin/python benchmarks/nki_moe_roofline.py [--tokens 4096 --experts 128 --top-k 8 --hidden 2048 --ffn 768]
        [--block-sizes 32,64,128,256] [--data docs/nki_moe_roofline.json] [--out docs/nki_moe_roofline.png]
        [--baseline REPORT.txt ...] [--plot-only]

Per block size, one rank's layer (forward + backward, bf16, LNC 2, the cost report's seeded routing) runs through
the NKI kernels on the emulator (a few minutes each at Qwen3-30B-A3B shapes on a CPU) and its counters through the
trn2 time model (`workbench.kernels.moe_cost`). Writes the numbers (JSON) and the figure (PNG); `--plot-only`
redraws the figure from the JSON. `--baseline` adds the cost reports (their JSON last lines) of an older version of
the kernels as grey points, kept in the JSON under "baseline". A model: nothing here ran on Trainium.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import nki_moe_cost  # noqa: E402 - the cost report next to this script

DOCS = Path(__file__).resolve().parents[1] / "docs"
ENGINES = ("tensor", "vector", "scalar", "dma")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    nki_moe_cost.add_shape_args(p)
    p.add_argument("--block-sizes", default="32,64,128,256")
    p.add_argument("--data", type=Path, default=DOCS / "nki_moe_roofline.json")
    p.add_argument("--out", type=Path, default=DOCS / "nki_moe_roofline.png")
    p.add_argument("--baseline", nargs="*", type=Path, default=[],
                   help="cost-report outputs of older kernels (their JSON last lines), shown as grey points")
    p.add_argument("--plot-only", action="store_true", help="redraw the figure from --data")
    return p.parse_args(argv)


def sweep(args) -> dict:
    """{"shape": ..., "runs": [the cost report's JSON per block size]}."""
    shape = {"tokens": args.tokens, "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
             "ffn": args.ffn, "lnc": 2, "dtype": "bfloat16"}
    runs = []
    for bs in args.block_sizes.split(","):
        report = nki_moe_cost.parse_args(["--tokens", str(args.tokens), "--experts", str(args.experts), "--top-k",
                                          str(args.top_k), "--hidden", str(args.hidden), "--ffn", str(args.ffn),
                                          "--lnc", "2", "--block-size", bs])
        runs.append(nki_moe_cost.measure(report)[0])
        print(json.dumps(runs[-1]), flush=True)
    return {"shape": shape, "runs": runs}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, s = data["runs"], data["shape"]
    x = list(range(len(runs)))
    fig, ax = plt.subplots(figsize=(13, 5.5))
    ax.fill_between(x, [r["model_ms_overlap"] for r in runs], [r["model_ms_serial"] for r in runs], color="tab:blue",
                    alpha=0.12, label="throughput bracket")
    if all("model_ms" in r for r in runs):  # the dependency model (issue 32 on; older JSON has the bracket only)
        ax.plot(x, [r["model_ms"] for r in runs], "o-", color="tab:purple", lw=2,
                label="dependency model (model_ms: the trace on in-order engine queues)")
    ax.plot(x, [r["model_ms_overlap"] for r in runs], "o-", color="tab:blue", lw=1,
            label="bracket: engines overlapped (each kernel = its busiest engine)")
    ax.plot(x, [r["model_ms_serial"] for r in runs], "o--", color="tab:blue", lw=1, label="bracket: no overlap")
    base = {r["block_size"]: r for r in data.get("baseline", [])}
    if base:
        bx = [i for i, r in enumerate(runs) if r["block_size"] in base]
        dependency = all("model_ms" in base[runs[i]["block_size"]] for i in bx)  # older reports: the bracket only
        key, what = ("model_ms", "dependency model") if dependency else ("model_ms_overlap", "engines overlapped")
        ax.plot(bx, [base[runs[i]["block_size"]][key] for i in bx], "X", color="grey", ms=9,
                label=f"earlier kernels (the --baseline reports): {what}")
    for engine, style in zip(ENGINES, ("s:", "^:", "v:", "D:"), strict=True):
        ax.plot(x, [r["model_ms_engines"][engine] for r in runs], style, lw=1, ms=4, alpha=0.8,
                label=f"engine busy: {engine}")
    floors = [(runs[0]["pe_floor_ms"], "PE floor (unpadded expert matmuls, 2 x 79 TFLOPS)", "tab:red", "-"),
              (runs[0]["hbm_floor_ms"], "HBM floor (the kernels' dtypes: bf16 dW)", "tab:green", "-")]
    for y, label, color, ls in floors:
        ax.axhline(y, color=color, ls=ls, lw=1.5, label=f"{label}: {y:.2f} ms")
    ax.axhline(1.3 * runs[0]["roofline_ms"], color="black", ls="--", lw=1, label="1.3 x roofline (goal)")
    ax.set_xticks(x, [str(r["block_size"]) if r.get("kernel_block", r["block_size"]) == r["block_size"] else
                      f"{r['block_size']}\n(kernel block {r['kernel_block']})" for r in runs])
    ax.set_xlabel("model.moe_block_size (kernel block)")
    ax.set_ylabel("ms per MoE layer, forward + backward, one rank")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Modeled trn2 time of one rank's MoE layer (T {s['tokens']}, E {s['experts']}, K {s['top_k']}, "
                 f"D {s['hidden']}, F {s['ffn']}, {s['dtype']}, LNC {s['lnc']})\n"
                 "a model from the NKI emulator's counters (workbench.kernels.moe_cost); nothing ran on Trainium",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.plot_only:
        data = json.loads(args.data.read_text())
    else:
        data = sweep(args)
    if args.baseline:
        data["baseline"] = [json.loads(path.read_text().strip().splitlines()[-1]) for path in args.baseline]
    if not args.plot_only or args.baseline:
        args.data.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, args.out)
    print(f"wrote {args.out}" + ("" if args.plot_only else f" and {args.data}"))


if __name__ == "__main__":
    main()
