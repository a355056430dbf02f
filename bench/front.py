"""`gb10d front` side by side with nginx as a reverse proxy, both before the same `gb10d run` over the stand-in.

Run: `python -m bench.front` (about two minutes); writes bench/results/front.json and prints a Markdown table.

In one run, in interleaved rounds so that both see the same machine: streams straight to the stand-in (the
baseline), through the front, and through Debian's nginx (one worker, `proxy_buffering off`, HTTP/1.1 upstream
with `keepalive 64`: idle connections kept for the next request, as the front does). Every request is a new client connection, a streamed
completion; the client is asyncio with raw sockets, the same code for all three.

- First byte: the time from sending the request to the first SSE event, with 64 streams at once; the added
  latency is each path's median (and p99) minus the baseline's.
- Throughput: SSE events per second with 256 streams at once, against the baseline's.
- The front's RSS (VmRSS) sampled while the 256 streams are open.
- A reload that restarts vLLM (gpu_memory_utilization changed, SIGHUP): a request every 50 ms straight to the
  stand-in and another through the front, side by side; the refusals and errors each saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import tomli_w

from gb10d.front.lab import FrontChild
from gb10d.daemon.lab import free_port
from gb10d.machine.statefile import read_state

from .lab import standalone, Deployment, Gb10d, Workspace, wait_until

RESULTS = Path(__file__).resolve().parent / "results" / "front.json"
NGINX_CONF = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
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


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def _nginx(directory: Path, upstream: int) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=directory, port=port, upstream=upstream))
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(directory), "-g", "daemon off;"], start_new_session=True)
    return proc, port


def _ports_answer(ports: list[int]) -> bool:
    async def each() -> None:
        await asyncio.gather(*(_stream(p, _request(1)) for p in ports))

    try:
        asyncio.run(each())
    except (OSError, RuntimeError):
        return False
    return True


def _latency_and_throughput(paths: dict[str, int], rounds: int, front_pid: int) -> dict[str, Any]:
    first: dict[str, list[float]] = {name: [] for name in paths}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    rss_peak = 0
    sampling = True

    def sample() -> None:
        nonlocal rss_peak
        while sampling:
            rss_peak = max(rss_peak, _rss_kib(front_pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for _ in range(rounds):
        for name, port in paths.items():
            times, _ = asyncio.run(_batch(port, 64, 8))
            first[name].extend(times)
            _, rate = asyncio.run(_batch(port, 256, 64))
            rates[name].append(rate)
    sampling = False
    sampler.join()
    base = first["direct"]
    out: dict[str, Any] = {"first_byte_ms": {}, "events_per_s": {}, "front_rss_mib": rss_peak / 1024}
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
        nginx, nginx_port = _nginx(directory / "nginx", deployment.port)
        try:
            paths = {"direct": deployment.port, "front": front_port, "nginx": nginx_port}
            if wait_until(lambda: _ports_answer(list(paths.values())), 30, 0.1) is None:
                raise RuntimeError("a path never answered")
            result = _latency_and_throughput(paths, 3 if quick else 10, front.proc.pid)
        finally:
            nginx.terminate()
            nginx.wait(10)
        result["reload"] = _reload_gap(deployment, gb10d, front_port)
    return result


def markdown(result: dict[str, Any]) -> str:
    fb, ev, rl = result["first_byte_ms"], result["events_per_s"], result["reload"]
    lines = [
        "| path | first byte median (ms) | p99 (ms) | added median (ms) | added p99 (ms) | events/s at 256 streams | of direct |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("direct", "front", "nginx"):
        row = fb[name]
        added = (f"{row['added_median']:.2f}", f"{row['added_p99']:.2f}") if name != "direct" else ("", "")
        share = f"{ev[f'{name}_of_direct']:.0%}" if name != "direct" else ""
        lines.append(f"| {name} | {row['median']:.2f} | {row['p99']:.2f} | {added[0]} | {added[1]} | {ev[name]:.0f} | {share} |")
    lines += [
        "",
        f"Front RSS with 256 streams open: {result['front_rss_mib']:.1f} MiB.",
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
