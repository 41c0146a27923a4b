"""The soak's verdict (what makes it fail) and its one-screen summary."""

from __future__ import annotations

from bench.soak_load import CLASSES, HUNG, WRONG


def failures(report: dict) -> list[str]:
    """Every reason the soak fails; empty when it passed."""
    out = []
    req = report["requests"]
    for cls in (WRONG, HUNG):
        if req["by_class"].get(cls):
            out.append(f"{req['by_class'][cls]} {cls} request(s)")
    if req["refused_without_retry_info"]:
        out.append(f"{req['refused_without_retry_info']} RESOURCE_EXHAUSTED refusal(s) without a RetryInfo detail")
    if not req["by_class"].get("exact"):
        out.append("no request completed exactly: the soak measured nothing")
    tolerance = report["rss"]["tolerance"]
    for name, r in report["rss"]["services"].items():
        if r["growth"] is None:
            out.append(f"{name}: too few RSS samples after the warm-up to compare")
        elif r["growth"] > tolerance:
            out.append(f"{name}: RSS grew {r['growth']:+.1%} after the warm-up ({r['warm_mib']} MiB then, "
                       f"{r['peak_mib']} at its peak, {r['end_mib']} at the end; tolerance {tolerance:.0%})")
    if report["services_exited"]:
        out.append(f"service(s) exited during the soak: {', '.join(report['services_exited'])}")
    after = report["state_after"]
    if after["drained"] is False:
        out.append(f"state not drained {after['waited_s']} s after the load: {'; '.join(_leftovers(after['state']))}")
    return out


def _leftovers(state: dict) -> list[str]:
    out = []
    for name, s in state["stages"].items():
        if isinstance(s, str):
            out.append(f"{name} unreachable ({s})")
        elif s["requests_held"] or s["kv_used_tokens"]:
            out.append(f"{name} holds {s['requests_held']} request(s), {s['kv_used_tokens']} KV tokens")
    c = state.get("coordinator")
    if isinstance(c, str):
        out.append(f"coordinator unreachable ({c})")
    elif c is not None and (c["running"] or c["waiting"]):
        out.append(f"coordinator runs {c['running']}, queues {c['waiting']}")
    return out


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def fmt(row: list[str]) -> str:
        return "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))
    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]


def summary(report: dict) -> str:
    req, tp, meta = report["requests"], report["throughput"], report["meta"]
    total = req["total"] or 1
    lines = [f"soak: {meta['concurrency']} streams for {meta['duration_s']:g} s against {meta['target']} "
             f"({meta['model']}, {meta['stages']} stages, admission cap {meta['max_concurrent'] or 'as running'}, "
             f"{meta['cancel_fraction']:.0%} cancelled, pool of {meta['pool_size']})", ""]
    rows = [[c, str(req["by_class"].get(c, 0)), f"{req['by_class'].get(c, 0) / total:.1%}"] for c in CLASSES]
    rows.append(["total", str(req["total"]), ""])
    lines += _table(["class", "requests", "share"], rows)
    lines.append(f"(cancelled: {req['cancelled_before_first_token']} before their first token, "
                 f"{req['by_class'].get('cancelled', 0) - req['cancelled_before_first_token']} mid-stream)")
    if req["errors_by_code"]:
        lines += ["", "errors by status: " + ", ".join(f"{k} {v}" for k, v in sorted(req["errors_by_code"].items()))]
    lines += ["", f"throughput over {tp['wall_s']:.0f} s: {tp['exact_per_s']:.2f} exact req/s, "
                  f"{tp['exact_output_tokens_per_s']:.0f} exact output tok/s, {tp['delivered_tokens_per_s']:.0f} "
                  f"tok/s delivered (cancelled partials included), {tp['refused_per_s']:.2f} refusals/s", ""]
    rss = report["rss"]
    if rss["services"]:
        rows = [[n, str(r["start_mib"]), str(r["warm_mib"]), str(r["end_mib"]), str(r["peak_mib"]),
                 "n/a" if r["growth"] is None else f"{r['growth']:+.1%}", str(r["samples"])]
                for n, r in rss["services"].items()]
        known = [r for r in rss["services"].values() if r["growth"] is not None]
        if known:
            total = {k: round(sum(r[k] for r in known), 1) for k in ("start_mib", "warm_mib", "end_mib")}
            rows.append(["all", str(total["start_mib"]), str(total["warm_mib"]), str(total["end_mib"]), "", "", ""])
        lines += [f"RSS (MiB) at the start, after {rss['warmup_s']:g} s of load, at the end; growth = the peak after "
                  f"the warm-up against it (tolerance {rss['tolerance']:.0%}):"]
        lines += _table(["service", "start", "warm", "end", "peak", "growth", "samples"], rows)
    else:
        lines.append("RSS: not sampled (attached to --target without --pids)")
    after = report["state_after"]
    if after["drained"] is None:
        lines += ["", "after the load: not checked (attached without --stage-addresses or --coordinator)"]
    else:
        lines += ["", f"after the load ({'drained' if after['drained'] else 'NOT drained'} in {after['waited_s']} s):"]
    for name, s in after["state"]["stages"].items():
        lines.append(f"  {name}: " + (s if isinstance(s, str) else
                                      f"requests_held {s['requests_held']}, kv_used_tokens {s['kv_used_tokens']}"))
    c = after["state"].get("coordinator")
    if c is not None:
        lines.append("  coordinator: " + (c if isinstance(c, str)
                                          else f"running {c['running']}, waiting {c['waiting']}"))
    fails = report["failures"]
    lines += ["", "PASS" if not fails else "FAIL:\n  " + "\n  ".join(fails)]
    return "\n".join(lines)
