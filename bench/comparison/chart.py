"""chart.png: time per block (block-bound requests) and per page (contiguous requests) of
every variant, log-log."""

from __future__ import annotations

import os


def chart(out_dir, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("sglang plan", "SGLang 0.5.23 plan", "o", "tab:red"),
              ("sglang handoff", "SGLang plan + Mooncake lists", "x", "tab:orange"),
              ("kvplan fresh", "kvplan, fresh memory", "s", "tab:cyan"),
              ("kvplan pooled", "kvplan, pooled (steady state)", "D", "tab:blue"),
              ("kvplan handoff", "kvplan plan + as_lists()", "^", "tab:green")]
    # Left: block-bound requests (fragmented ones and the single 61-block request).
    # Right: contiguous multi-page requests (61-188 blocks from thousands of pages), where the
    # cost is the page scan, so it is shown per page.
    left = [r for r in rows if r["sc"].frag > 0 or r["sc"].key == "dsv3-single-61"]
    right = [r for r in rows if r["sc"].frag == 0 and r["sc"].key != "dsv3-single-61"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), dpi=110,
                             gridspec_kw={"width_ratios": [1.6, 1]})
    for ax, subset, xkey, xlabel, ylabel in (
        (axes[0], left, "n_blocks", "blocks per plan", "time per block (ns), median"),
        (axes[1], right, "pages", "pages per request (contiguous: 61-188 blocks)",
         "time per page (ns), median"),
    ):
        for key, label, marker, color in series:
            pts = []
            for r in subset:
                if key not in r["med"]:
                    continue
                x = r["n_blocks"] if xkey == "n_blocks" else r["sc"].n_pages
                pts.append((x, r["med"][key] / x))
            if not pts:
                continue
            pts.sort()
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker=marker, linestyle=":", color=color, label=label, alpha=0.85,
                    markersize=5, linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title("fragmented requests + single 61-block request", fontsize=9)
    axes[1].set_title("contiguous requests (all pages in one run: page scan)", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle("KV transfer planning: kvplan vs SGLang 0.5.23 (same inputs, identical "
                 "blocks; one run of bench/compare_sglang.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "chart.png"))
    plt.close(fig)
