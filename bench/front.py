"""`gb10d front` side by side with nginx as a reverse proxy, both before the same `gb10d run` over the stand-in.

Run: `python -m bench.front` (about three minutes), or as part of `python -m bench`; writes bench/results/front.json and prints a Markdown table.

In one run, in interleaved rounds so that both see the same machine: streams straight to the stand-in (the
baseline), through the front, and through Debian's nginx (one worker, `proxy_buffering off`, HTTP/1.1 upstream
with `keepalive 64`: idle connections kept for the next request, as the front does). Every request is a new client connection, a streamed
completion; the client is asyncio with raw sockets, the same code for all three.

- First byte: the time from sending the request to the first SSE event, with 64 streams at once; the added
  latency is each path's median (and p99) minus the baseline's.
- Throughput: SSE events per second with 256 streams at once, against the baseline's.
- The front's RSS (VmRSS) sampled while the 256 streams are open, and the CPU time per request of the front and
  of nginx's worker in both.
- Idle connections: 1,000 and then 10,000 client connections opened to the front, then to nginx, and held without
  a request (as a client between requests, or a slow one); the proxy's RSS with 1,000 and with 10,000 open; the
  first request after the burst, and, while the 10,000 are held, whole streamed requests on new connections
  through the proxy and straight to the stand-in, one after another. The bench raises its own open-file limit;
  the front raises its own.
- A reload that restarts vLLM (gpu_memory_utilization changed, SIGHUP): a request every 50 ms straight to the
  stand-in and another through the front, side by side; the refusals and errors each saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import tomli_w

from gb10d.daemon.lab import free_port
from gb10d.front.door import raise_open_files
from gb10d.front.lab import FrontChild
from gb10d.machine.procs import cpu_seconds, rss_kib
from gb10d.machine.statefile import read_state

from .lab import Deployment, Gb10d, Workspace, standalone, wait_until

RESULTS = Path(__file__).resolve().parent / "results" / "front.json"
# Idle client connections held at once, and the count at which RSS is read on the way there.
IDLE = 10_000
RSS_AT = 1_000
# Whole requests timed, one after another, on each path while the idle connections are held.
ANSWERS = 30
NGINX_CONF = """
worker_processes 1;
worker_rlimit_nofile {files};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections {connections}; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream instance {{
        server 127.0.0.1:{upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://instance;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def _request(tokens: int) -> bytes:
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": tokens, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    return head.encode() + body


async def _stream(port: int, request: bytes) -> tuple[float, int]:
    """(seconds to the first SSE event, events received) of one streamed completion on a new connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = time.perf_counter()
    writer.write(request)
    seen = b""
    first: float | None = None
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        seen += chunk
        if first is None and b"data: " in seen:
            first = time.perf_counter() - sent
        if b"data: [DONE]" in seen[-64:]:
            break
    writer.close()
    if first is None or b" 200 " not in seen[:20]:
        raise RuntimeError(f"port {port} answered {seen[:300]!r}")
    return first, seen.count(b"data: ")


async def _batch(port: int, streams: int, tokens: int) -> tuple[list[float], float]:
    """`streams` streams at once: their first-byte times and the events per second of the whole batch."""
    request = _request(tokens)
    started = time.perf_counter()
    results = await asyncio.gather(*(_stream(port, request) for _ in range(streams)))
    wall = time.perf_counter() - started
    return [first for first, _ in results], sum(events for _, events in results) / wall


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def _nginx(directory: Path, upstream: int, open_files: int) -> tuple[subprocess.Popen[bytes], int] | None:
    """Debian's nginx as a reverse proxy to `upstream`, on a port of its own; None when nginx is not installed."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        return None
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=directory, port=port, upstream=upstream, files=open_files, connections=open_files - 64))
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(directory), "-g", "daemon off;"], start_new_session=True)
    return proc, port


def _nginx_worker(master: int) -> int:
    """The pid of nginx's one worker (the process that holds the connections)."""
    children = Path(f"/proc/{master}/task/{master}/children")
    if wait_until(lambda: bool(children.read_text().split()), 10, 0.05) is None:
        raise RuntimeError("nginx started no worker")
    return int(children.read_text().split()[0])


def _accepted(pid: int, port: int) -> int:
    """How many connections to `port` the process `pid` has accepted: its socket descriptors that the kernel lists as
    established on that local port (a connection still in the accept queue has no descriptor yet)."""
    local = f":{port:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[1].endswith(local) and fields[3] == "01":
                    inodes.add(fields[9])
    count = 0
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            target = os.readlink(f"{fds}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            count += 1
    return count


def _closed_by_peer(socks: list[socket.socket]) -> int:
    """How many of the held connections the server has closed or answered (readable, or hung up)."""
    poller = select.poll()
    for sock in socks:
        poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return len(poller.poll(0))


async def _answer_times(ports: dict[str, int], count: int) -> dict[str, list[float]]:
    """Seconds from connect to the last event of a whole 8-token stream, `count` per path, the paths taking turns."""
    request = _request(8)
    out: dict[str, list[float]] = {name: [] for name in ports}
    for _ in range(count):
        for name, port in ports.items():
            started = time.perf_counter()
            await _stream(port, request)
            out[name].append(time.perf_counter() - started)
    return out


def _ms_summary(values: list[float]) -> dict[str, float]:
    return {"median": 1000 * statistics.median(values), "max": 1000 * max(values), "n": len(values)}


def _idle_connections(name: str, port: int, pids: list[int], direct: int, count: int) -> dict[str, Any]:
    """Hold `count` idle connections to the proxy at `port` (pids[0] accepts them; RSS is the sum over `pids`),
    then time whole requests through it and straight to the stand-in while they are held."""
    socks: list[socket.socket] = []
    out: dict[str, Any] = {"held": count, "rss_mib_before": sum(rss_kib(pid) or 0 for pid in pids) / 1024}
    started = time.monotonic()

    def hold(target: int) -> float:
        """Open connections up to `target`, wait until the proxy has accepted them all; its RSS (MiB) then."""
        while len(socks) < target:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        if wait_until(lambda: _accepted(pids[0], port) >= target, 60, 0.2) is None:
            raise RuntimeError(f"{name} accepted {_accepted(pids[0], port)} of {target} connections")
        return sum(rss_kib(pid) or 0 for pid in pids) / 1024

    before = asyncio.run(_answer_times({"direct": direct, name: port}, ANSWERS))
    out["answer_ms_none_held"] = {path: _ms_summary(values) for path, values in before.items()}
    try:
        out[f"rss_mib_at_{RSS_AT}"] = hold(RSS_AT)
        out["rss_mib_held"] = hold(count)
        out["open_s"] = time.monotonic() - started
        # The kernel hands over a connection before the proxy has set it up: this first request waits for the rest
        # of the burst, the timed ones after it see the connections held.
        out["first_after_burst_ms"] = 1000 * asyncio.run(_answer_times({name: port}, 1))[name][0]
        times = asyncio.run(_answer_times({"direct": direct, name: port}, ANSWERS))
        out["answer_ms"] = {path: _ms_summary(values) for path, values in times.items()}
        out["closed_by_server"] = _closed_by_peer(socks)
        out["held_s"] = time.monotonic() - started
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: _accepted(pids[0], port) == 0, 60, 0.2)
    return out


def _ports_answer(ports: list[int]) -> bool:
    async def each() -> None:
        await asyncio.gather(*(_stream(p, _request(1)) for p in ports))

    try:
        asyncio.run(each())
    except (OSError, RuntimeError):
        return False
    return True


def _latency_and_throughput(paths: dict[str, int], rounds: int, front_pid: int, proxies: dict[str, int]) -> dict[str, Any]:
    """First bytes at 64 streams, events per second at 256, and the CPU each proxy (`proxies`: name to the pid that
    serves) spent per request in each: the measure a loaded machine moves least."""
    first: dict[str, list[float]] = {name: [] for name in paths}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    cpu = {name: {"64x8": 0.0, "256x64": 0.0} for name in proxies}
    rss_peak = 0
    sampling = True

    def sample() -> None:
        nonlocal rss_peak
        while sampling:
            rss_peak = max(rss_peak, rss_kib(front_pid) or 0)
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for _ in range(rounds):
        for name, port in paths.items():
            before = cpu_seconds(proxies[name]) if name in proxies else 0.0
            times, _ = asyncio.run(_batch(port, 64, 8))
            first[name].extend(times)
            between = cpu_seconds(proxies[name]) if name in proxies else 0.0
            _, rate = asyncio.run(_batch(port, 256, 64))
            rates[name].append(rate)
            if name in proxies:
                cpu[name]["64x8"] += between - before
                cpu[name]["256x64"] += cpu_seconds(proxies[name]) - between
    sampling = False
    sampler.join()
    base = first["direct"]
    out: dict[str, Any] = {"first_byte_ms": {}, "events_per_s": {}, "front_rss_mib": rss_peak / 1024}
    out["cpu_ms_per_request"] = {name: {"64x8": 1000 * c["64x8"] / (64 * rounds), "256x64": 1000 * c["256x64"] / (256 * rounds)} for name, c in cpu.items()}
    for name in paths:
        out["first_byte_ms"][name] = {"median": 1000 * statistics.median(first[name]), "p99": 1000 * _p99(first[name]), "n": len(first[name])}
        out["events_per_s"][name] = statistics.median(rates[name])
        if name != "direct":
            out["first_byte_ms"][name]["added_median"] = 1000 * (statistics.median(first[name]) - statistics.median(base))
            out["first_byte_ms"][name]["added_p99"] = 1000 * (_p99(first[name]) - _p99(base))
            out["events_per_s"][f"{name}_of_direct"] = out["events_per_s"][name] / out["events_per_s"]["direct"]
    return out


async def _every_50ms(port: int, until: threading.Event, tally: dict[str, int]) -> None:
    request = _request(2)
    while not until.is_set():
        next_at = time.perf_counter() + 0.05
        try:
            await _stream(port, request)
            tally["ok"] += 1
        except ConnectionRefusedError:
            tally["refused"] += 1
        except (OSError, RuntimeError):
            tally["failed"] += 1
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))


def _reload_gap(deployment: Deployment, gb10d: Gb10d, front_port: int) -> dict[str, Any]:
    """A request every 50 ms straight and through the front while a reload restarts vLLM."""
    tallies = {name: {"ok": 0, "refused": 0, "failed": 0} for name in ("direct", "front")}
    done = threading.Event()
    before = read_state(deployment.dir / "state.json")
    assert before is not None
    data = deployment.data()
    data["vllm"]["gpu_memory_utilization"] = round(deployment.utilization - 0.05, 2)
    deployment.config.write_text(tomli_w.dumps(data))

    async def both() -> None:
        await asyncio.gather(_every_50ms(deployment.port, done, tallies["direct"]), _every_50ms(front_port, done, tallies["front"]))

    runner = threading.Thread(target=asyncio.run, args=(both(),))
    runner.start()
    time.sleep(0.5)
    started = time.monotonic()
    os.kill(gb10d.pid, signal.SIGHUP)

    def restarted() -> bool:
        now = read_state(deployment.dir / "state.json")
        return now is not None and now.vllm_pid != before.vllm_pid and now.state is not None and now.state.value == "serving"

    wait_until(restarted, 120, 0.05)
    restart_s = time.monotonic() - started
    time.sleep(0.5)
    done.set()
    runner.join()
    return {"restart_s": restart_s, **{f"{name}_{k}": v for name, tally in tallies.items() for k, v in tally.items()}}


def run(ws: Workspace, quick: bool) -> dict[str, Any]:
    # The bench holds IDLE client sockets at once, past the usual soft limit of 1,024.
    open_files = raise_open_files()
    idle = min(IDLE, open_files - 512)
    load_at_start = os.getloadavg()
    directory = ws.scratch("front")
    deployment = Deployment(directory, ws.venv, sim_env={"GB10D_SIM_SPEED": "0.002"}, utilization=0.5)
    (directory / "instances").mkdir()
    (directory / "instances" / "tiny.toml").write_text(deployment.config.read_text())
    front_port = free_port()
    (directory / "front.toml").write_text(
        f'[front]\nlisten = "127.0.0.1:{front_port}"\nmetrics_listen = ""\ninstances_dir = "{directory / "instances"}"\n'
        f'state_file = "{directory / "front-state.json"}"\n'  # not the machine's /run/gb10d-front
    )
    with Gb10d(deployment) as gb10d, FrontChild(directory / "front.toml") as front:
        gb10d.wait_ready()
        front.wait_line("serving tiny on")
        nginx = _nginx(directory / "nginx", deployment.port, open_files)
        try:
            paths = {"direct": deployment.port, "front": front_port}
            if nginx is not None:
                paths["nginx"] = nginx[1]
            if wait_until(lambda: _ports_answer(list(paths.values())), 30, 0.1) is None:
                raise RuntimeError("a path never answered")
            proxies = {"front": front.proc.pid}
            if nginx is not None:
                proxies["nginx"] = _nginx_worker(nginx[0].pid)
            result = _latency_and_throughput(paths, 3 if quick else 10, front.proc.pid, proxies)
            result["idle"] = {"front": _idle_connections("front", front_port, [front.proc.pid], deployment.port, idle)}
            if nginx is not None:
                result["idle"]["nginx"] = _idle_connections("nginx", nginx[1], [proxies["nginx"], nginx[0].pid], deployment.port, idle)
        finally:
            if nginx is not None:
                nginx[0].terminate()
                nginx[0].wait(10)
        result["reload"] = _reload_gap(deployment, gb10d, front_port)
    result["machine"] = {"nproc": os.cpu_count(), "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()}
    result["goals"] = goals(result)
    return result


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 40's goals for the front, each with the front's figure, nginx's beside it (same run), and whether the
    front met it."""
    fb, ev, idle = result["first_byte_ms"], result["events_per_s"], result["idle"]
    front, nginx = fb["front"], fb.get("nginx")
    rows: list[dict[str, Any]] = []

    def goal(name: str, target: str, ours: float, theirs: float | None, met: bool, unit: str) -> None:
        rows.append({"goal": name, "target": target, "front": f"{ours:.2f} {unit}".strip(),
                     "nginx": "-" if theirs is None else f"{theirs:.2f} {unit}".strip(), "met": bool(met)})

    goal("first byte added at 64 streams, median", "<= 2 ms", front["added_median"], nginx and nginx["added_median"], front["added_median"] <= 2, "ms")
    goal("first byte added at 64 streams, p99", "<= 10 ms", front["added_p99"], nginx and nginx["added_p99"], front["added_p99"] <= 10, "ms")
    if nginx is not None:
        for which in ("median", "p99"):
            ours, theirs = front[f"added_{which}"], nginx[f"added_{which}"]
            # nginx's added latency can come out negative (it keeps its upstream connections, the baseline does
            # not): then "within 2x" is read as no more than nginx's own.
            goal(f"first byte added, {which}, against nginx's", "<= 2x nginx's", ours, theirs, ours <= max(2 * theirs, theirs), "ms")
    share = ev["front_of_direct"]
    goal("throughput at 256 streams, of direct", ">= 97%", 100 * share, ev.get("nginx_of_direct", 0) * 100 if nginx else None, share >= 0.97, "%")
    held = idle["front"]
    answer = held["answer_ms"]["front"]
    theirs_idle = idle.get("nginx")
    goal(f"a request with {held['held']:,} idle connections held, median", "< 50 ms", answer["median"],
         theirs_idle and theirs_idle["answer_ms"]["nginx"]["median"], answer["median"] < 50 and held["closed_by_server"] == 0, "ms")
    goal(f"the same, slowest of {answer['n']}", "< 50 ms", answer["max"], theirs_idle and theirs_idle["answer_ms"]["nginx"]["max"],
         answer["max"] < 50 and held["closed_by_server"] == 0, "ms")
    rss = held[f"rss_mib_at_{RSS_AT}"]
    goal(f"RSS with {RSS_AT:,} connections open", "<= 80 MB", rss * 1.048576, theirs_idle and theirs_idle[f"rss_mib_at_{RSS_AT}"] * 1.048576,
         rss * 2**20 <= 80e6, "MB")
    return rows


def markdown(result: dict[str, Any]) -> str:
    fb, ev, rl = result["first_byte_ms"], result["events_per_s"], result["reload"]
    names = [name for name in ("direct", "front", "nginx") if name in fb]
    load = result["machine"]
    lines = [
        f"{load['nproc']} CPUs, load average {load['load_avg_at_start'][0]:.1f} at the start and {load['load_avg_at_end'][0]:.1f} at the end.",
        "",
        "| goal | target | front | nginx | met |",
        "|---|---|---|---|---|",
        *(f"| {g['goal']} | {g['target']} | {g['front']} | {g['nginx']} | {'yes' if g['met'] else '**no**'} |" for g in result["goals"]),
        "",
        "| path | first byte median (ms) | p99 (ms) | added median (ms) | added p99 (ms) | events/s at 256 streams | of direct |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        row = fb[name]
        added = (f"{row['added_median']:.2f}", f"{row['added_p99']:.2f}") if name != "direct" else ("", "")
        share = f"{ev[f'{name}_of_direct']:.0%}" if name != "direct" else ""
        lines.append(f"| {name} | {row['median']:.2f} | {row['p99']:.2f} | {added[0]} | {added[1]} | {ev[name]:.0f} | {share} |")
    cpu = result["cpu_ms_per_request"]
    lines += [
        "",
        "CPU per request (ms, user and system, of the process that serves): "
        + "; ".join(f"{name} {c['64x8']:.2f} at 64 streams of 8 events, {c['256x64']:.2f} at 256 of 64" for name, c in cpu.items()) + ".",
        "",
        f"Front RSS with 256 streams open: {result['front_rss_mib']:.1f} MiB.",
        "",
        "| idle connections held by | RSS before (MiB) | with 1,000 (MiB) | with all (MiB) | opened in (s) | first request after (ms) | then through it: median / slowest (ms) | straight meanwhile (ms) | before, none held: through / straight (ms) | closed by it |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, held in result["idle"].items():
        ours, direct = held["answer_ms"][name], held["answer_ms"]["direct"]
        none_held = held["answer_ms_none_held"]
        lines.append(
            f"| {name} ({held['held']:,}) | {held['rss_mib_before']:.1f} | {held[f'rss_mib_at_{RSS_AT}']:.1f} | {held['rss_mib_held']:.1f} | "
            f"{held['open_s']:.1f} | {held['first_after_burst_ms']:.1f} | {ours['median']:.1f} / {ours['max']:.1f} | {direct['median']:.1f} / {direct['max']:.1f} | "
            f"{none_held[name]['median']:.1f} / {none_held['direct']['median']:.1f} | {held['closed_by_server']} |"
        )
    lines += [
        "",
        f"Reload that restarts vLLM ({rl['restart_s']:.1f} s until it served again), a request every 50 ms on each path: "
        f"straight to vLLM {rl['direct_ok']} answered, {rl['direct_refused']} refused, {rl['direct_failed']} failed; "
        f"through the front {rl['front_ok']} answered, {rl['front_refused']} refused, {rl['front_failed']} failed.",
    ]
    return "\n".join(lines)


def main() -> int:
    return standalone(run, markdown, RESULTS, sys.argv)


if __name__ == "__main__":
    sys.exit(main())
