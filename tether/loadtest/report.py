"""Report writers: report.json (everything, for machines), requests.jsonl (one line per request), report.md
(for people) and PNG plots when matplotlib is importable (the report says so when it is not).

The writers read the report as report.json has it: the dict cli.py assembles from the typed records of
tether/loadtest/results.py (their `to_json`); its shape is documented in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tether.loadtest.cluster_stats import served_step_text
from tether.loadtest.records import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2e")


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def write_requests(records: Iterable[RequestRecord], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec.to_json(), ensure_ascii=False) + "\n")


def fmt(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def slo_text(slo: dict[str, float] | None) -> str:
    if not slo:
        return "none given (no goodput)"
    return ", ".join(f"{m.upper()} ≤ {ms:g} ms" for m, ms in slo.items())


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _audit_cell(audit: dict | None) -> str:
    if audit is None:
        return "off"
    return f"{audit['exact']}/{audit['within_margin']}/**{audit['mismatch']}** ({_pct(audit['mismatch_rate'])})"


SUMMARY_HEADER = ["level", "done", "req/s", "goodput/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
                  "ITL p50/p99 ms", "E2E p50/p99 ms", "errors", "audit exact/margin/MISMATCH"]


def summary_rows(levels: list[dict]) -> list[dict[str, str]]:
    """One row per level, its cells by SUMMARY_HEADER column."""
    rows = []
    for lv in levels:
        s, lat = lv["summary"], lv["summary"]["latency_ms"]
        cells = [lv["label"], f"{s['completed']}/{s['requests']}", fmt(s["request_throughput"], 2),
                 fmt(s["goodput"], 2), fmt(s["output_token_throughput"]),
                 *(f"{fmt(lat[m]['p50'])} / {fmt(lat[m]['p99'])}" for m in METRICS),
                 ", ".join(f"{k} {v}" for k, v in s["errors_by_status"].items()) or "0",
                 _audit_cell(lv["audit"])]
        rows.append(dict(zip(SUMMARY_HEADER, cells, strict=True)))
    return rows


def _group_table(groups: dict[str, dict]) -> list[str]:
    rows = []
    for name, s in groups.items():
        lat = s["latency_ms"]
        rows.append([name, f"{s['completed']}/{s['requests']}", fmt(s["request_throughput"], 2),
                     fmt(s["output_token_throughput"]), fmt(lat["ttft"]["p50"]), fmt(lat["tpot"]["p50"]),
                     fmt(lat["e2e"]["p50"]), fmt(lat["e2e"]["p99"]), str(s["failed"])])
    return _table(["group", "done", "req/s", "out tok/s", "TTFT p50", "TPOT p50", "E2E p50", "E2E p99", "failed"], rows)


def markdown(report: dict) -> str:
    meta = report["meta"]
    out = [f"# tether bench — {meta['date']}", "",
           f"- command: `{meta['command']}`",
           f"- target: {meta['target']} ({'started by the bench' if meta['spawned'] else 'running cluster'}), "
           f"model `{meta['model']}` ({meta['model_fingerprint']}), {meta['stages'] or '?'} stage(s)",
           f"- machine: {meta['machine']['cores']} cores, torch {meta['machine']['torch']}, "
           f"Python {meta['machine']['python']}; load average {meta['load_average_start']} at start",
           f"- workload: {meta['workload']['mix']} (seed {meta['workload']['seed']}); "
           f"per level: {meta['budget']}; warm-up {meta['warmup']} request(s)",
           f"- SLO: {slo_text(meta['slo'])}", ""]
    mismatches = sum(lv["audit"]["mismatch"] for lv in report["levels"] if lv["audit"])
    if mismatches:
        out += [f"> **{mismatches} MISMATCH(ES) FOUND BY THE AUDIT**: answers the model would not give to "
                "their request. This is a correctness bug; details below.", ""]
    out += ["## Summary", "", *_table(SUMMARY_HEADER, [list(r.values()) for r in summary_rows(report["levels"])]), ""]
    out += _capacity_md(report.get("capacity"))
    out += _engine_summary_md(report)
    for lv in report["levels"]:
        s = lv["summary"]
        out += [f"## {lv['label']}", "",
                f"{s['requests']} requests sent at {fmt(s['send_rate'], 2)}/s, last one done after "
                f"{fmt(s['wall_s'])} s; {fmt(s['input_token_throughput'])} prompt tokens/s; load average "
                f"{lv['load_average'][0]:.2f} before, {lv['load_average'][1]:.2f} after.", ""]
        lat = s["latency_ms"]
        out += _table(["metric (ms)", "count", "mean", "p50", "p90", "p99"],
                      [[m.upper(), str(lat[m]["count"]), fmt(lat[m]["mean"]), fmt(lat[m]["p50"]),
                        fmt(lat[m]["p90"]), fmt(lat[m]["p99"])] for m in METRICS])
        out += ["", "By workload:", "", *_group_table(lv["by_workload"]), ""]
        for tag, groups in lv["by_tag"].items():
            out += [f"By intent tag `{tag}`:", "", *_group_table(groups), ""]
        out += _engine_level_md(lv)
        if lv["audit"] and lv["audit"]["mismatches"]:
            out += ["MISMATCHES:", ""] + [f"- request {m['index']} ({m['workload']}, seed {m['seed']}, "
                                          f"{m['params']}): {m['detail']} — prompt `{m['prompt']}`"
                                          for m in lv["audit"]["mismatches"]] + [""]
    out += _compare_md(report.get("prefix_cache_compare"))
    out += _baselines_md(report.get("baselines"))
    out += ["## Chaos", "", *_chaos_md(report["chaos"]), ""]
    out += ["## Plots", ""]
    out += [f"![{p}]({p})" for p in report["plots"]] or [report["plots_note"]]
    return "\n".join(out) + "\n"


def _capacity_md(cap: dict | None) -> list[str]:
    if not cap:
        return []
    best = cap["capacity_rate"]
    head = (f"**{fmt(best, 2)} req/s** within the SLO with zero audit mismatches: {fmt(cap['per_pipeline'], 2)} "
            f"req/s per pipeline ({cap['pipelines']} pipeline(s)); a level meets it when none of its requests "
            f"failed, none mismatched and at least {cap['min_good']:.0%} met every bound."
            if best is not None else "No rate tried met the SLO.")
    rows = [[f"{lv['rate']:g}/s", "meets" if lv["meets"] else "misses", lv["why"]] for lv in cap["levels"]]
    return ["## Capacity", "", head, "", *_table(["rate", "SLO", "why"], rows), ""]


def frac(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def _blocks(d: dict) -> str:
    """KV blocks used / cached / total at the end of a level."""
    cells = [d.get(f"kv_blocks_{k}_end") for k in ("used", "cached", "total")]
    return "–" if cells[2] in (None, 0) else "/".join(fmt(c) for c in cells)


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "0"


def fold_children(procs: dict[str, dict]) -> dict[str, float | None]:
    """Busy fraction per service with its worker processes (NAME/child-PID) added in; None if any is unknown."""
    out: dict[str, float | None] = {}
    for name, p in procs.items():
        parent = name.split("/")[0]
        f = p["busy_fraction"]
        if parent in out:
            out[parent] = None if out[parent] is None or f is None else out[parent] + f
        else:
            out[parent] = f
    return out


ENGINE_HEADER = ["level", "prefix hit rate", "hit tokens", "computed ÷ prompt", "prefill ÷ prompt (est.)",
                 "preemptions", "NO_CAPACITY coordinator / stages", "rejections (coordinator)", "stage busy", "KV blocks end used/cached/total",
                 "CPU busy: bench", "CPU busy: services"]


def engine_rows(levels: list[dict]) -> list[dict[str, str]]:
    """One row per level that measured its engine, its cells by ENGINE_HEADER column: the coordinator's
    figures, the stages' busy fractions and the processes' CPU busy fractions."""
    rows = []
    for lv in levels:
        e, cpu = lv.get("engine"), lv.get("cpu")
        if e is None and cpu is None:
            continue
        c = (e or {}).get("coordinator") or {}
        stages = [s for s in (e or {}).get("stages", []) if s]
        # A slot a stage rejects is counted there and again by the coordinator that rebuilds it: kept apart.
        at_stages = sum(s.get("rejections", {}).get("NO_CAPACITY", 0) for s in stages)
        no_capacity = f"{fmt(c.get('rejections', {}).get('NO_CAPACITY', 0) if c else None)} / {at_stages}"
        procs = (cpu or {}).get("processes", {})
        services = [f"{n} {frac(f)}" for n, f in fold_children(procs).items() if n != "bench"]
        cells = [lv["label"], frac(c.get("prefix_hit_rate")), fmt(c.get("prefix_hit_tokens")),
                 frac(c.get("computed_per_prompt_token")), frac(c.get("prefill_per_prompt_token_est")),
                 fmt(c.get("preemptions")), no_capacity if e else "–",
                 _counts(c.get("rejections", {})) if c else "–",
                 ", ".join(frac(s["busy_fraction"]) for s in stages) or "–",
                 _blocks(c) if c else "–",
                 frac(procs.get("bench", {}).get("busy_fraction")), ", ".join(services) or "–"]
        rows.append(dict(zip(ENGINE_HEADER, cells, strict=True)))
    return rows


def _engine_summary_md(report: dict) -> list[str]:
    rows = engine_rows(report["levels"])
    if not rows:
        return []
    return ["## Engine", "",
            "From the coordinator's and stages' Stats before and after each level (a slot a stage rejects is "
            "counted there and again at the coordinator: NO_CAPACITY shows both), and each process's CPU time ÷ the level's wall time (1.00 = one core; "
            "`bench` is this client). A figure whose denominator is 0 shows –.", "",
            *_table(ENGINE_HEADER, [list(r.values()) for r in rows]), ""]


def _engine_level_md(lv: dict) -> list[str]:
    e, cpu = lv.get("engine"), lv.get("cpu")
    out: list[str] = []
    if e is not None:
        c = e.get("coordinator")
        if c:
            out += [f"Engine: prefix cache {'on' if c.get('prefix_cache_end') else 'off (or not reported)'}; "
                    f"{fmt(c['prefix_hits'])} hits of {fmt(c['prefix_queries'])} queries "
                    f"({frac(c['prefix_hit_rate'])}), {fmt(c['prefix_hit_tokens'])} hit tokens, "
                    f"{fmt(c['prefix_misses'])} misses; {fmt(c['computed_tokens'])} tokens computed for "
                    f"{fmt(c['prompt_tokens'])} prompt tokens ({fmt(e.get('client_prompt_tokens'))} by the "
                    f"receipts), {fmt(c['tokens_generated'])} generated; {fmt(c['preemptions'])} preemption(s); "
                    f"rejections {_counts(c['rejections'])}; KV blocks used/cached/total at the end {_blocks(c)}; "
                    f"step {fmt(c.get('step_seconds_end'), 4)} s.", ""]
        stages = [s for s in e.get("stages", []) if s]
        if stages:
            out += _table(["stage", "busy", "steps", "prefix hits/queries", "hit tokens", "evictions",
                           "rejections", "KV blocks end", "KV tokens end"],
                          [[s["address"], frac(s["busy_fraction"]), fmt(s["steps"]),
                            f"{fmt(s['prefix_hits'])}/{fmt(s['prefix_queries'])}", fmt(s["prefix_hit_tokens"]),
                            fmt(s["prefix_evictions"]), _counts(s["rejections"]), _blocks(s),
                            f"{fmt(s['kv_used_tokens_end'])}/{fmt(s['kv_capacity_tokens_end'])}"] for s in stages])
            out += [""]
            if e.get("step"):
                out += [f"Served step: {served_step_text(e['step'])} (hops, the coordinator's turn).", ""]
        if e.get("errors"):
            out += ["Stats not read: " + "; ".join(e["errors"]), ""]
    if cpu is not None:
        out += _table(["process", "CPU s", "busy (CPU ÷ wall)", "RSS MiB at end"],
                      [[n, fmt(p["cpu_s"], 2), frac(p["busy_fraction"]), fmt(p["rss_mib_end"])]
                       for n, p in cpu["processes"].items()])
        out += ["", f"Over {fmt(cpu['wall_s'], 2)} s of wall time; `bench` is this client process.", ""]
    return out


def _compare_md(cmp: dict | None) -> list[str]:
    if cmp is None:
        return []
    rows = [[r["level"], f"{r['completed_off']}/{r['completed_on']}", fmt(r["ttft_p50_ms_off"]),
             fmt(r["ttft_p50_ms_on"]), f"**{frac(r['ttft_p50_ratio'])}**", frac(r["e2e_p50_ratio"]),
             f"{fmt(r['output_tok_s_off'])} / {fmt(r['output_tok_s_on'])}",
             f"{frac(r['hit_rate_off'])} / {frac(r['hit_rate_on'])}",
             f"{frac(r['computed_per_prompt_off'])} / {frac(r['computed_per_prompt_on'])}"] for r in cmp["rows"]]
    out = ["## Prefix cache: without vs with", "",
           "The same levels and requests on two clusters up at once, one started with `--no-prefix-cache`, one "
           "with the cache; each level ran on one then the other. Target: TTFT p50 with ÷ without ≤ "
           f"{cmp['ttft_ratio_target']:g} on multi-turn with shared system prompts.", "",
           *_table(["level", "done off/on", "TTFT p50 off ms", "TTFT p50 on ms", "TTFT p50 on ÷ off",
                    "E2E p50 on ÷ off", "out tok/s off / on", "hit rate off / on", "computed ÷ prompt off / on"],
                   rows), ""]
    if any(lv["repeats"] > 1 for lv in cmp.get("levels", [])):
        out += ["Medians over the repeats:", "",
                *_table(["level", "repeats", "TTFT p50 on ÷ off", "E2E p50 on ÷ off", "hit rate on",
                         "computed ÷ prompt off / on"],
                        [[lv["level"], str(lv["repeats"]), f"**{frac(lv['ttft_p50_ratio'])}**",
                          frac(lv["e2e_p50_ratio"]), frac(lv["hit_rate_on"]),
                          f"{frac(lv['computed_per_prompt_off'])} / {frac(lv['computed_per_prompt_on'])}"]
                         for lv in cmp["levels"]]), ""]
    return out


def _baselines_md(b: dict | None) -> list[str]:
    if b is None:
        return ["## Baselines", "", "Not run (pass `--baselines`).", ""]
    rows = []
    llama_threads = b.get("llama_cpp_threads", 0)
    for name, what in (("served", "tether, served over gRPC (closed loop, concurrency = batch size)"),
                       ("engine", "raw in-process engine (continuous batching, no gRPC)"),
                       ("hf", "transformers generate, static batching"),
                       ("hf_cb", "transformers generate_batch, continuous batching"),
                       ("llama_cpp", f"llama.cpp (llama-cpp-python's server, the GGUF, {llama_threads} "
                                     "thread(s); serializes requests), over its OpenAI API at concurrency = "
                                     "batch size")):
        side = b.get(name, {})
        tok_s = fmt(side["output_token_throughput"]) if side.get("output_token_throughput") else side.get("error", "–")
        if side.get("output_token_throughput") and side.get("error"):   # measured, but not every request completed
            tok_s += f" ({side['error']})"
        rows.append([name, what, tok_s, fmt(side.get("ttft_p50_ms"), 0), fmt(side.get("tpot_p50_ms"), 0),
                     ", ".join(fmt(x) for x in side.get("runs", []))])
    command = ([f"The llama.cpp server: `{b['llama_cpp_command']}`.", ""] if b.get("llama_cpp_command") else [])
    return ["## Baselines", "",
            f"{b['completed']} requests of the same workload (the prompts, seeds and output budgets the server "
            f"used), batch size {b['batch_size']}; the in-process baselines run {b['threads']} torch thread(s), "
            f"each of the cluster's {b['stages']} stage processes {b['stage_threads']}; median of {b['repeats']} "
            f"interleaved run(s); each ratio is the median of the per-run ratios. TTFT and TPOT (p50, median "
            f"over the runs) are of the sides served through a load client; llama.cpp's include its queue "
            f"(one request at a time).", "",
            *_table(["side", "what", "output tok/s (median)", "TTFT p50 ms", "TPOT p50 ms", "runs"], rows), "",
            *command,
            f"tether / engine = **{ratio_text(b['ratios'].get('vs_engine'))}**, "
            f"tether / transformers = **{ratio_text(b['ratios'].get('vs_hf'))}**, "
            f"tether / transformers CB = **{ratio_text(b['ratios'].get('vs_hf_cb'))}**, "
            f"tether / llama.cpp = **{ratio_text(b['ratios'].get('vs_llama_cpp'))}**", ""]


def ratio_text(r: float | None) -> str:
    return "–" if r is None else f"{r:.2f}×"


CHAOS_FIGURES = ("injected", "detected", "recovered", "failed explicitly", "wrong answers")


NOT_RUN = "not run"


def chaos_side(cell: dict | None) -> list[str]:
    """The five CHAOS_FIGURES of one side of a chaos row (NOT_RUN first when it did not run)."""
    if cell is None:
        return [NOT_RUN] + ["–"] * 4
    wrong = f"{cell['wrong_answers']} of {cell['completed']}"
    stages, coordinator = sum(cell["detected_at_stages"].values()), sum(cell["detected_at_coordinator"].values())
    detected = f"{cell['detected']} ({stages}+{coordinator})" if stages and coordinator else str(cell["detected"])
    return [str(cell["injected"]), detected, str(cell["recovered"]), str(cell["failed"]),
            f"**{wrong}**" if cell["wrong_answers"] else wrong]


def chaos_rows(rows: list[dict]) -> list[list[str]]:
    """Per fault kind: the five figures with the stamp checks on, then the five with them off."""
    return [[r["kind"], *chaos_side(r["on"]), *chaos_side(r["off"])] for r in rows]


def _chaos_details(side: str, cell: dict) -> str:
    def counts(d: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"
    text = (f"checks {side}: {cell['completed']}/{cell['requests']} done ({cell['exact']} exact, "
            f"{cell['within_margin']} within margin, {cell['wrong_answers']} MISMATCH); "
            f"injected {counts(cell['injected_by_kind'])}; "
            f"rejected at the stages {counts(cell['detected_at_stages'])}; at the coordinator "
            f"{counts(cell['detected_at_coordinator'])}; {cell['rebuilds']} rebuild(s), {cell['resumes']} resume(s), "
            f"{cell['pipeline_reconnects']} reconnect(s); failed {counts(cell['failed_by_status'])}")
    if cell.get("stage_exits"):
        text += (f"; {cell['stage_crashes']} stage crash(es), each restarted by the bench"
                 + (f" ({cell['failed_restarts']} relaunch(es) died before starting and were retried)"
                    if cell.get("failed_restarts") else ""))
    return text


def _chaos_md(chaos: dict) -> list[str]:
    if not chaos["requested"]:
        return ["Not requested (`--chaos` with `--spawn`, or against a running cluster started with `--faults`: "
                "`--chaos --coordinator HOST:PORT`)."]
    if chaos["mode"] == "spawn":
        plan = chaos["plan"]
        intro = (f"Each fault kind ran alone on a freshly started cluster: stages `--faults KIND=RATE,seed="
                 f"{plan['seed']}`, coordinator `{' '.join(chaos['coordinator_flags'])}`; then the "
                 f"same with `{chaos['unsafe_flag']}` (experiment only) on every stage and the coordinator. "
                 f"Load per run: {chaos['load']['budget']} at {chaos['load']['level']}, the same requests in every "
                 f"run, no warm-up.")
    else:
        intro = f"Against the running cluster (coordinator {chaos['coordinator']}): {chaos['note']}."
    header = ["fault kind"] + [f"{side}: {f}" for side in ("ON", "OFF") for f in CHAOS_FIGURES]
    t = chaos["totals"]
    out = [intro, "", *_table(header, chaos_rows(chaos["rows"])), "",
           f"Wrong answers: **{t['wrong_answers_checks_on']}** with stamp checks on, "
           f"**{t['wrong_answers_checks_off']}** with them off.", "",
           "injected: faults the injectors applied (Stats `faults_injected`; a crash as the stage exit the bench "
           "saw); detected: rejections counted by the stages plus those counted by the coordinator, in brackets "
           "when both counted some (a slot a stage rejects is counted there and again at the coordinator that "
           "rebuilds it, so this counts detections, not distinct faults); recovered: requests finished after a "
           "rebuild or resume; failed explicitly: requests that ended in a gRPC error; wrong answers: completed "
           "requests the audit flags as MISMATCH (one per request, however many of its tokens are wrong), of the "
           "completed ones.", ""]
    for row in chaos["rows"]:
        rates = chaos.get("plan", {}).get("rates", {})
        name = f"`{row['kind']}`" + (f" (rate {rates[row['kind']]:g})" if row["kind"] in rates else "")
        out += [f"- {name}: " + "; ".join(_chaos_details(side, row[side]) for side in ("on", "off") if row[side])]
    return out


def write_plots(report: dict, records: list[RequestRecord], out_dir: Path) -> tuple[list[str], str]:
    """Draw the plots into out_dir; (file names, note). Without matplotlib: no files and a note saying so."""
    try:
        import matplotlib
    except ImportError:
        return [], ("No plots: matplotlib is not installed (`pip install -e '.[bench]'`); "
                    "report.json and this page hold every figure.")
    matplotlib.use("Agg")   # files only: never needs a display
    from tether.loadtest import plots
    return plots.draw(report, records, out_dir), ""


def write_all(report: dict, records: list[RequestRecord], out_dir: Path) -> list[Path]:
    """Every report file into out_dir (created); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"], report["plots_note"] = write_plots(report, records, out_dir)
    write_json(report, out_dir / "report.json")
    write_requests(records, out_dir / "requests.jsonl")
    (out_dir / "report.md").write_text(markdown(report), encoding="utf-8")
    return [out_dir / n for n in ("report.json", "requests.jsonl", "report.md", *report["plots"])]
