"""Draw the intranode sweep (benchmarks/sweep_vs_deepep.sh's JSON lines): per SM count, time per call and aggregate
logical bandwidth against tokens per rank, ours and DeepEP v1.2.1, with the device's copy bandwidth as a line.

    python benchmarks/plot_sweep.py benchmarks/results/sweep_2026-12-04.jsonl benchmarks/results/sweep_2026-12-04.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

CALLS = (
    ("dispatch_fp8_us", "FP8 dispatch (fresh)"),
    ("dispatch_fp8_cached_us", "FP8 dispatch (cached)"),
    ("combine_bf16_us", "BF16 combine"),
)
STYLE = {"ours": dict(color="tab:blue", marker="o"), "deepep": dict(color="tab:gray", marker="s", linestyle="--")}
LABEL = {"ours": "ep_dispatcher", "deepep": "DeepEP v1.2.1"}


def load(path: str):
    copy_gbps, rows = None, []
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            if "copy_gbps_rw" in entry:
                copy_gbps = entry["copy_gbps_rw"]
            else:
                rows.append(entry)
    return copy_gbps, rows


def logical_gbps(entry: dict, key: str) -> float:
    """Aggregate logical bandwidth of one call: the driver's received bytes over its median time (all ranks)."""
    per_token = entry["hidden"] * (1 + 4 / 128) if "dispatch" in key else entry["hidden"] * 2
    return entry["recv_tokens_total"] * per_token / (entry[key] * 1e-6) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jsonl")
    parser.add_argument("png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    copy_gbps, rows = load(args.jsonl)
    by_sms = defaultdict(list)
    for entry in rows:
        by_sms[entry["sms"]].append(entry)
    sms_values = sorted(by_sms)
    fig, axes = plt.subplots(
        2 * len(sms_values), len(CALLS), figsize=(5 * len(CALLS), 3.6 * 2 * len(sms_values)), squeeze=False
    )
    for i, sms in enumerate(sms_values):
        for j, (key, title) in enumerate(CALLS):
            ax_t, ax_bw = axes[2 * i][j], axes[2 * i + 1][j]
            for impl in ("deepep", "ours"):
                pts = sorted((e["tokens"], e[key], logical_gbps(e, key)) for e in by_sms[sms] if e["impl"] == impl)
                if not pts:
                    continue
                tokens = [p[0] for p in pts]
                ax_t.plot(tokens, [p[1] for p in pts], label=LABEL[impl], **STYLE[impl])
                ax_bw.plot(tokens, [p[2] for p in pts], label=LABEL[impl], **STYLE[impl])
            if copy_gbps:
                ax_bw.axhline(copy_gbps, color="tab:red", linewidth=1, label="copy bandwidth (read + write)")
            ranks = by_sms[sms][0]["ranks"]
            ax_t.set_title(f"{title}: {ranks} ranks x {sms} SMs")
            ax_t.set_ylabel("time per call (us)")
            ax_bw.set_ylabel("aggregate logical GB/s")
            for ax in (ax_t, ax_bw):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("tokens per rank")
                ax.grid(True, alpha=0.3)
                ax.legend(fontsize=8)
    fig.suptitle("Intranode, one H200 under MPS: hidden 7168, top-8 of 256 experts (same driver, same device call)")
    fig.tight_layout()
    fig.savefig(args.png, dpi=90)


if __name__ == "__main__":
    main()
