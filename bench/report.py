"""The results as Markdown tables, the machine they ran on, and the bounds the quick run enforces.

`checks` holds the regression bounds (readiness and forwarding, each
relative to a baseline measured in the same run, plus generous absolute
floors); `goals` holds the issue's targets, reported as met or not but
never failing the run, since a shared machine cannot promise them.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from . import front, swap

# Regression bounds of the quick run (stated in docs/BENCHMARKS.md).
READY_MAX_MEDIAN_S = 0.5
FORWARD_MIN_LINES_PER_S = 5_000
FORWARD_MIN_VS_PYTHON = 0.05


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPUs, CPU model, memory, Python, kernel."""
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "mem_total_gib": round(total_kib / 2**20, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_avg_at_start": os.getloadavg(),
    }


def git_commit(root: Path) -> str | None:
    """The commit the bench ran on, if it runs from a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return out.stdout.strip() or None


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The quick run's regression bounds, each with the measured value and whether it held."""
    out: list[dict[str, Any]] = []

    def check(name: str, value: float | None, bound: str, ok: bool) -> None:
        out.append({"check": name, "value": value, "bound": bound, "ok": bool(ok)})

    r = results.get("readiness")
    if r:
        g = r["gb10d"]["median"]
        poll = r["baselines"]["poll 1 s (llama-swap)"]["measured"]["median"]
        check("readiness median (s)", g, f"< {READY_MAX_MEDIAN_S}", g is not None and g < READY_MAX_MEDIAN_S)
        check("readiness median vs 1 s poll median (s)", g, f"< {poll:.3f}" if poll is not None else "no poll result",
              g is not None and poll is not None and g < poll)
    f = results.get("forwarding")
    if f:
        mode = "lines" if "lines" in f["modes"] else "chunks"
        m = f["modes"][mode]
        g, p = m["gb10d"]["lines_per_s"]["median"], m["gb10d_vs_python"]["median"]
        check(f"forwarding lines/s ({mode})", g, f">= {FORWARD_MIN_LINES_PER_S}", g >= FORWARD_MIN_LINES_PER_S)
        check(f"forwarding vs plain Python forwarder ({mode})", p, f">= {FORWARD_MIN_VS_PYTHON}", p >= FORWARD_MIN_VS_PYTHON)
    return out


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals, met or not."""
    out: list[dict[str, Any]] = []

    def goal(name: str, value: Any, target: str, met: bool) -> None:
        out.append({"goal": name, "value": value, "target": target, "met": bool(met)})

    r = results.get("readiness")
    if r:
        g = r["gb10d"]["median"]
        goal("readiness latency median", _ms(g), "< 50 ms", g < 0.05)
        ratio = r["baselines"]["poll 1 s (llama-swap)"]["ratio_to_gb10d"]
        goal("readiness vs 1 s poll", f"{ratio:.1f}x", ">= 20x", ratio >= 20)
    m = results.get("recovery")
    if m:
        t = m["totals"]
        worst_c, worst_d = t["gb10d without preflight"]["max_failed_starts"], t["gb10d with preflight"]["max_failed_starts"]
        goal("failed starts without preflight (worst cell)", worst_c, "<= 1", worst_c <= 1)
        goal("failed starts with preflight (worst cell)", worst_d, "0", worst_d == 0)
    s = results.get("stall")
    if s:
        over = s["over_timeout_s"]["max"]
        goal("stall detected after timeout (worst)", f"+{over:.2f} s", "<= +2 s", over <= 2)
        goal("false alarms on slow loads", s["false_alarms"], "0", s["false_alarms"] == 0)
    f = results.get("forwarding")
    if f:
        for mode, m in f["modes"].items():
            g = m["gb10d"]["lines_per_s"]["median"]
            goal(f"forwarding ({mode})", f"{g:,.0f} lines/s", ">= 100,000 lines/s", g >= 100_000)
            if mode == "lines":  # see the table: only the line-by-line writer has a meaningful ratio
                slow = m["gb10d"]["child_slowdown"]["median"]
                goal(f"child never blocked ({mode})", f"{slow:.1f}x its /dev/null write time", "<= 3x", slow <= 3)
    p = results.get("footprint")
    if p:
        sc = p["scaled"]
        goal("RSS while serving", f"{sc['peak_rss_kib'] / 1024:.1f} MiB peak", "< 60 MB", sc["peak_rss_kib"] * 1024 < 60e6)
        idle = sc["idle"]["cpu_s_per_hour"]
        goal("CPU per hour idle (scaled)", f"{idle:.2f} s", "< 1 s", idle < 1)
        if "real_time_idle" in p:
            rt = p["real_time_idle"]["cpu_s_per_hour"]
            goal("CPU per hour idle (real time)", f"{rt:.2f} s", "< 1 s", rt < 1)
    fr = results.get("front")
    if fr:
        for g in fr["goals"]:
            goal(f"front: {g['goal']}", f"{g['front']} (nginx {g['nginx']})", g["target"], g["met"])
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _s(seconds: float | None, digits: int = 2) -> str:
    return "-" if seconds is None else f"{seconds:.{digits}f} s"


def _spread_ms(s: dict[str, Any]) -> str:
    if not s.get("n"):
        return "-"
    return f"{_ms(s['median'])} | {_ms(s['p25'])}–{_ms(s['p75'])} | {_ms(s['min'])}–{_ms(s['max'])} | {s['n']}"


def _spread_s(s: dict[str, Any]) -> str:
    if not s.get("n"):
        return "-"
    return f"{_s(s['median'])} | {_s(s['p25'])}–{_s(s['p75'])} | {_s(s['min'])}–{_s(s['max'])} | {s['n']}"


def markdown(results: dict[str, Any]) -> str:
    """Every table of the run, in the order of the issue."""
    m = results["machine"]
    parts = [
        f"Run: {results['mode']}, commit {results.get('commit') or 'unknown'}, {results['wall_s']:.0f} s in all.  ",
        f"Machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['mem_total_gib']} GiB memory, Python {m['python']}, "
        f"Linux {m['kernel']}, load average {m['load_avg_at_start'][0]:.2f} at the start.",
        "",
    ]
    if goals(results):
        parts += ["### Goals", "", "| goal | measured | target | met |", "|---|---|---|---|"]
        parts += [f"| {g['goal']} | {g['value']} | {g['target']} | {'yes' if g['met'] else '**no**'} |" for g in goals(results)]
        parts.append("")
    if results.get("checks"):
        parts += ["### Regression bounds (enforced by every run, `--quick` in CI)", "", "| check | measured | bound | held |", "|---|---|---|---|"]
        for c in results["checks"]:
            value = f"{c['value']:,.3f}" if isinstance(c["value"], float) else str(c["value"])
            parts.append(f"| {c['check']} | {value} | {c['bound']} | {'yes' if c['ok'] else '**no**'} |")
        parts.append("")
    r = results.get("readiness")
    if r:
        parts += [
            "### 1. Readiness latency (after `Application startup complete.`)", "",
            f"gb10d: {r['repeats']} starts. Pollers: {r['poll_starts']} starts of the stand-in alone, {r['pollers_per_loop']} loops per "
            f"interval with evenly spread phases. Stand-in at GB10D_SIM_SPEED {r['sim_speed']}.", "",
            "| loop | median | p25–p75 | min–max | n | vs gb10d | model median |", "|---|---|---|---|---|---|---|",
            f"| gb10d READY=1 (warmup = false) | {_spread_ms(r['gb10d'])} | 1x | - |",
        ]
        if r["gb10d_own_ms"].get("n"):
            own = r["gb10d_own_ms"]
            parts.append(f"| gb10d's own journal figure | {own['median']:.0f} ms | - | {own['min']:.0f}–{own['max']:.0f} ms | {own['n']} | - | - |")
        if "warmup" in r:
            parts.append(f"| gb10d READY=1 (warmup = true) | {_spread_ms(r['warmup']['gb10d'])} | - | - |")
        if "floor" in r:
            parts.append(f"| tight 5 ms loop on /v1/models (floor of the stand-in) | {_spread_ms(r['floor'])} | - | - |")
        for name, b in r["baselines"].items():
            parts.append(f"| {name}, GET {b['path']} | {_spread_ms(b['measured'])} | {b['ratio_to_gb10d']:.1f}x | {_ms(b['model_median_s'])} |")
        parts.append("")
    rec = results.get("recovery")
    if rec:
        parts += [
            "### 2. Free-memory recovery", "",
            f"MemTotal {rec['total_gib']} GiB; stand-in at GB10D_SIM_SPEED {rec['sim_speed']}. Time to ready is over the cells short of memory.", "",
            "| strategy | failed starts (worst cell) | failed starts (all cells) | cells never ready | time to ready: median | min–max |",
            "|---|---|---|---|---|---|",
        ]
        for name, t in rec["totals"].items():
            tr = t["ready_s_when_short"]
            parts.append(f"| {name} | {t['max_failed_starts']} | {t['total_failed_starts']} | {t['never_ready']} | "
                         f"{_s(tr['median'])} | {_s(tr['min'])}–{_s(tr['max'])} |")
        parts += ["", "Failed starts per cell (a / b / c / d as above; `x` = never ready):", "",
                  "| free GiB \\ requested | " + " | ".join(f"{u:.2f}" for u in sorted({c['requested'] for c in rec['cells']})) + " |",
                  "|---|" + "---|" * len({c['requested'] for c in rec['cells']})]
        for free in sorted({c["free_gib"] for c in rec["cells"]}):
            row = [c for c in rec["cells"] if c["free_gib"] == free]
            cells = []
            for c in sorted(row, key=lambda c: c["requested"]):
                cells.append(" / ".join(f"{c[n]['failed_starts']}{'x' if c[n]['ready_s'] is None else ''}" for n in rec["totals"]))
            parts.append(f"| {free:g} | " + " | ".join(cells) + " |")
        parts.append("")
    st = results.get("stall")
    if st:
        parts += [
            "### 3. Stall detection", "",
            f"stall_timeout_s {st['stall_timeout_s']:g} s wall = {st['stall_timeout_sim_s']:g} simulated s (GB10D_SIM_SPEED {st['sim_speed']}).", "",
            "| measure | median | p25–p75 | min–max | n |", "|---|---|---|---|---|",
            f"| last shard line to stall_detected | {_spread_s(st['latency_s'])} |",
            f"| beyond stall_timeout_s | {_spread_s(st['over_timeout_s'])} |",
            "", f"Retry after the stall served: {sum(s['recovered'] for s in st['stalls'])} of {len(st['stalls'])}.", "",
            "| per shard (simulated) | per shard (wall) | READY=1 | false alarms |", "|---|---|---|---|",
        ]
        parts += [f"| {s['shard_sim_s']:g} s | {s['shard_wall_s']:.2f} s | {'yes' if s['ready'] else 'no'} | {s['false_alarms']} |" for s in st["slow_loads"]]
        parts.append("")
    fw = results.get("forwarding")
    if fw:
        parts += [
            "### 4. Log forwarding", "",
            f"{fw['lines']:,} physical lines per run, {fw['repeats']} runs per consumer. \"per CPU-s\" is lines per CPU-second of "
            "the forwarder itself (gb10d's from its first line of output on), the measure a loaded machine hardly moves; "
            "\"vs plain Python\" is the plain forwarder's CPU time over gb10d's, per run, median.", "",
            "| child writes | consumer | lines/s: median | min–max | vs cat | per CPU-s | vs plain Python | child's write time: median | vs /dev/null |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        names = {"gb10d": "gb10d", "cat": "cat", "python": "plain Python forwarder"}
        for mode, m in fw["modes"].items():
            writes = m["child_write_s"]
            for name in ("gb10d", "cat", "python"):
                s = m[name]["lines_per_s"]
                vs_cat = f"{s['median'] / m['cat']['lines_per_s']['median']:.3f}x" if name != "cat" else "1x"
                vs_python = f"{m['gb10d_vs_python']['median']:.3f}x" if name == "gb10d" else "1x" if name == "python" else "-"
                # 64 KiB chunks to /dev/null take microseconds: a ratio to that says nothing.
                slow = m[name]["child_slowdown"]["median"] if m[name]["child_slowdown"] and mode == "lines" else None
                cpu = m.get(f"{name}_cpu_s", {}).get("median")
                per_cpu = f"{fw['lines'] / cpu:,.0f}" if cpu else "-"
                parts.append(f"| {mode} | {names[name]} | {s['median']:,.0f} | {s['min']:,.0f}–{s['max']:,.0f} | {vs_cat} | {per_cpu} | {vs_python} | "
                             f"{_s(writes[name]['median'], 3)} | {'-' if slow is None else f'{slow:,.1f}x'} |")
            parts.append(f"| {mode} | /dev/null (child alone) | - | - | - | - | - | {_s(writes['devnull']['median'], 4)} | - |")
            if "components_in_process" in m:
                c = m["components_in_process"]["lines_per_s"]
                parts.append(f"| {mode} | gb10d's components in-process (no loop) | {c['median']:,.0f} | {c['min']:,.0f}–{c['max']:,.0f} | - | - | - | - | - |")
        if "backlog" in fw:
            b = fw["backlog"]
            parts += ["", f"After a {b['lines']:,}-line flood (64 KiB writes), gb10d was still busy with the parsed events for "
                      f"{b['busy_after_last_line_s']:.1f} s after the last line went out."]
        parts.append("")
    fp = results.get("footprint")
    if fp:
        sc = fp["scaled"]
        parts += [
            "### 5. Footprint while serving", "",
            f"Scaled periods: every interval x{sc['scale']}; CPU per simulated hour.", "",
            "| period | wall | simulated | CPU | CPU per hour | traffic |", "|---|---|---|---|---|---|",
        ]
        for name in ("idle", "busy"):
            p = sc[name]
            traffic = f"{p['requests']} requests, {p['scrapes']} scrapes, {p['lines_forwarded']} lines" if name == "busy" else "-"
            parts.append(f"| {name} (scaled) | {p['wall_s']:.0f} s | {p['simulated_s']:.0f} s | {p['cpu_s'] * 1000:.1f} ms | {p['cpu_s_per_hour']:.2f} s | {traffic} |")
        if "real_time_idle" in fp:
            rt = fp["real_time_idle"]
            parts.append(f"| idle (real time, default intervals) | {rt['wall_s']:.0f} s | - | {rt['cpu_s'] * 1000:.1f} ms | {rt['cpu_s_per_hour']:.2f} s | - |")
        parts += ["", f"RSS {sc['rss_kib'] / 1024:.1f} MiB at the end, {sc['peak_rss_kib'] / 1024:.1f} MiB peak (VmHWM).", ""]
    sd = results.get("shutdown")
    if sd:
        parts += [
            "### 6. Shutdown (SIGTERM to nothing left)", "",
            "| what | median | p25–p75 | min–max | n |", "|---|---|---|---|---|",
            f"| gb10d: SIGTERM to gb10d exited and vLLM's group gone | {_spread_s(sd['gb10d'])} |",
            f"| of which: vLLM's group gone | {_spread_s(sd['gb10d_vllm_gone'])} |",
            f"| stand-in alone: SIGTERM to its group gone | {_spread_s(sd['vllm_alone'])} |",
            "",
        ]
    ct = results.get("container")
    if ct:
        parts += [
            "### 7. vLLM in a container, next to the venv", "",
            f"{ct['repeats']} starts each, alternating; stand-in at GB10D_SIM_SPEED {ct['sim_speed']}, `startup.warmup = false`.", "",
            "| runs from | measure | median | p25–p75 | min–max | n |", "|---|---|---|---|---|---|",
        ]
        measures = (("ready_s", "readiness latency (startup line to READY=1)", _spread_ms),
                    ("to_first_line_s", "gb10d start to vLLM's first line", _spread_s),
                    ("stop_s", "SIGTERM to gb10d exited, nothing left", _spread_s))
        for label, way in ct["ways"].items():
            parts += [f"| {label} | {what} | {show(way[key])} |" for key, what, show in measures]
        parts += ["", *(f"Not measured: {kind}: {why}." for kind, why in ct["skipped"].items())] if ct["skipped"] else []
        parts.append("")
    if results.get("front"):
        parts += ["### 8. The front beside nginx", "", front.markdown(results["front"]), ""]
    if results.get("swap"):
        parts += ["### 9. A model swap: park by stop and start, against sleep and wake", "", swap.markdown(results["swap"]), ""]
    return "\n".join(parts)
