"""PNG plots of a bench report (matplotlib, imported by report.write_plots only when it is installed).

- sweep.png: TTFT, TPOT/ITL and E2E percentiles and the audit's mismatch rate against QPS.
- throughput.png: request throughput and goodput, and output token throughput, against QPS; failures too.
- latency_cdf.png: the distribution (CDF) of TTFT, TPOT, ITL and E2E at every level.
QPS is the offered rate for open-loop levels and the achieved request throughput for closed-loop ones.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from tether.loadtest.records import RequestRecord


def _x(levels: list[dict]) -> tuple[list[float], str]:
    if all(lv["mode"] == "open" for lv in levels):
        return [lv["rate"] for lv in levels], "offered load (requests/s, Poisson)"
    return [lv["summary"]["request_throughput"] or 0.0 for lv in levels], "achieved load (requests/s, closed loop)"


def _lat(levels: list[dict], metric: str, q: str) -> list[float | None]:
    return [lv["summary"]["latency_ms"][metric][q] for lv in levels]


def sweep(levels: list[dict], path: Path) -> None:
    x, xlabel = _x(levels)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = ((axes[0][0], "ttft", "time to first token"), (axes[0][1], "tpot", "time per output token"),
              (axes[1][0], "e2e", "end-to-end latency"))
    for ax, metric, title in panels:
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, _lat(levels, metric, q), style, label=f"{metric.upper()} {q}")
        if metric == "tpot":
            ax.plot(x, _lat(levels, "itl", "p99"), "x-.", label="ITL p99")
        ax.set(title=title, xlabel=xlabel, ylabel="ms")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[1][1]
    audited = [lv for lv in levels if lv["audit"]]
    if audited:
        ax_x = [xi for xi, lv in zip(x, levels) if lv["audit"]]
        ax.plot(ax_x, [100 * (lv["audit"]["mismatch_rate"] or 0.0) for lv in audited], "o-", color="crimson",
                label="MISMATCH")
        ax.plot(ax_x, [100 * lv["audit"]["within_margin"] / max(1, lv["audit"]["audited"]) for lv in audited],
                "s--", color="gray", label="within margin")
        for xi, lv in zip(ax_x, audited):
            a = lv["audit"]
            ax.annotate(f"{a['mismatch']}/{a['audited']}", (xi, 100 * (a["mismatch_rate"] or 0)),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.set_ylim(0, max(1.0, *(120 * (lv["audit"]["mismatch_rate"] or 0.0) for lv in audited)))
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "audit off (pass --audit)", ha="center", va="center", transform=ax.transAxes)
    ax.set(title="fidelity audit", xlabel=xlabel, ylabel="% of completed requests")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def throughput(levels: list[dict], path: Path) -> None:
    x, xlabel = _x(levels)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(x, [lv["summary"]["request_throughput"] for lv in levels], "o-", label="completed requests/s")
    if levels[0]["summary"]["goodput"] is not None:
        a.plot(x, [lv["summary"]["goodput"] for lv in levels], "s--", label="goodput (within SLO)/s")
    a.plot(x, [lv["summary"]["failed"] / lv["summary"]["wall_s"] for lv in levels], "x:", color="crimson",
           label="failed requests/s")
    a.set(title="request throughput", xlabel=xlabel, ylabel="requests/s")
    b.plot(x, [lv["summary"]["output_token_throughput"] for lv in levels], "o-")
    b.set(title="output token throughput", xlabel=xlabel, ylabel="tokens/s")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_cdf(levels: list[dict], records: list[RequestRecord], path: Path) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for lv in levels:
        done = [r for r in records if r.level == lv["label"] and r.ok]
        series = {"TTFT": [r.ttft for r in done if r.ttft is not None],
                  "TPOT": [t for r in done if (t := r.tpot) is not None],
                  "ITL": [g for r in done for g in r.itl],
                  "E2E": [r.e2e for r in done if r.e2e is not None]}
        for ax, (name, values) in zip(axes, series.items()):
            xs = sorted(v * 1000 for v in values)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=lv["label"])
            # log scale: the tails (a prefill stalling a decode) are orders of magnitude past the median
            ax.set(title=name, xlabel="ms (log scale)", xscale="log",
                   ylabel="fraction of requests" if name != "ITL" else "fraction of gaps")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(report: dict, records: list[RequestRecord], out_dir: Path) -> list[str]:
    levels = report["levels"]
    sweep(levels, out_dir / "sweep.png")
    throughput(levels, out_dir / "throughput.png")
    latency_cdf(levels, records, out_dir / "latency_cdf.png")
    return ["sweep.png", "throughput.png", "latency_cdf.png"]
