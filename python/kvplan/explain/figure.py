"""``kvplan explain --plot``: the run-length histogram and bytes per layer as a PNG (matplotlib,
the ``plot`` extra, imported only when a plot is drawn)."""

from __future__ import annotations

from kvplan.explain.analysis import Explanation, histogram

__all__ = ["plot"]


def plot(e: Explanation, path: str) -> None:
    """Draw the run-length histogram and bytes per layer into ``path`` (PNG).

    Raises:
        ImportError: matplotlib is missing (``pip install 'kvplan[plot]'``).
    """
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "--plot needs matplotlib: pip install 'kvplan[plot]'") from err
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_runs, ax_layers) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = histogram(e.run_lengths)
    ax_runs.bar([r[0] for r in rows], [r[1] for r in rows], color="#4c72b0")
    ax_runs.set_xlabel("run length (pages)")
    ax_runs.set_ylabel("runs")
    ax_runs.set_title(f"run lengths: {len(e.run_lengths):,} runs over {e.pages:,} pages")
    ax_runs.tick_params(axis="x", labelrotation=45)

    layers = sorted(set(e.kv_bytes_per_layer) | set(e.state_bytes_per_layer))
    kv = [e.kv_bytes_per_layer.get(i, 0) / (1 << 20) for i in layers]
    state = [e.state_bytes_per_layer.get(i, 0) / (1 << 20) for i in layers]
    ax_layers.bar(layers, kv, color="#4c72b0", label="KV pages")
    if any(state):
        ax_layers.bar(layers, state, bottom=kv, color="#dd8452", label="per-request state")
        ax_layers.legend(loc="upper left", bbox_to_anchor=(0, -0.18), ncol=2, frameon=False)
    # Headroom so the tallest bars are not cut by the frame.
    ax_layers.set_ylim(0, max(k + s for k, s in zip(kv, state, strict=True)) * 1.1 or 1)
    ax_layers.set_xlabel("layer id")
    ax_layers.set_ylabel("MiB")
    ax_layers.set_title(f"bytes per layer (total {e.bytes / (1 << 20):,.1f} MiB)")
    fig.suptitle(e.title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
