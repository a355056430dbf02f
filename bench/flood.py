"""A child that prints vLLM-like output as fast as it can, then exits: the load for the forwarding benchmark.

It stands where `vllm` would (gb10d runs it as `[vllm] executable`, so it is
called as `flood serve MODEL --host ...` and ignores those words) and writes
a realistic mix: 0.23-era tagged records of every level, stats lines,
uvicorn access lines, a Python warning, shard-bar states with `\\r` redraws
and a CUDA-graph bar whose redraws share one physical line, as tqdm writes
them. The last line is a marker the bench waits for. The child's own start
and end (CLOCK_MONOTONIC, shared with the bench) go to the file named by
`GB10D_FLOOD_REPORT`, so the bench can tell how long the child spent writing.

`GB10D_FLOOD_LINES` sets the number of physical lines; `GB10D_FLOOD_MODE` is
`chunks` (64 KiB writes: the most a consumer can be asked to take) or
`lines` (one write() per line, as vLLM's unbuffered logging does).
"""

from __future__ import annotations

import json
import os
import sys
import time

END_MARKER = b"FLOOD-END"
CHUNK_BYTES = 1 << 16


def _block() -> list[bytes]:
    """One cycle of output, 100 physical lines, as vLLM 0.23 writes them to a pipe."""
    api, core = "(APIServer pid=2700) ", "(EngineCore pid=2835) "
    lines: list[bytes] = []
    for i in range(6):
        lines.append(f"{api}INFO 12-02 14:08:{i:02d} [loggers.py:257] Engine 000: Avg prompt throughput: {812.4 + i:.1f} tokens/s, "
                     f"Avg generation throughput: 21.6 tokens/s, Running: 2 reqs, Waiting: 0 reqs, GPU KV cache usage: 7.9%, "
                     f"Prefix cache hit rate: 38.2%")
        for j in range(8):
            lines.append(f'{api}INFO:     127.0.0.1:{51000 + 8 * i + j} - "POST /v1/chat/completions HTTP/1.1" 200 OK')
        lines.append(f"{api}INFO 12-02 14:08:{i:02d} [chat_utils.py:560] Detected the chat template content format to be 'string'. "
                     "You can set `--chat-template-content-format` to override this.")
    lines.append(f"{api}WARNING 12-02 14:08:07 [system_utils.py:299] Found ulimit of 20000 and failed to automatically increase "
                 "with error current limit exceeds maximum limit.")
    lines.append(f"{core}ERROR 12-02 14:08:07 [core.py:872] Request abc123 aborted: client disconnected")
    lines.append("/usr/lib/python3.12/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: leaked semaphore")
    lines.append("  warnings.warn('resource_tracker: There appear to be %d '")
    lines.append(f"{core}INFO 12-02 14:08:08 [gpu_model_runner.py:3391] Model loading took 2.05 GiB memory and 0.742127 seconds")
    lines.append(f"{core}INFO 12-02 14:08:08 [backends.py:1148] Dynamo bytecode transform time: 3.84 s")
    shards = 8
    for n in range(shards + 1):
        pct = 100 * n // shards
        lines.append(f"{core}\rLoading safetensors checkpoint shards: {pct:3d}% Completed | {n}/{shards} [00:{n:02d}<00:{shards - n:02d}, "
                     f" 1.02s/it]")
    lines.append(core.rstrip())
    redraws = "".join(f"\rCapturing CUDA graphs (PIECEWISE): {p:3d}%|{'█' * (p // 10):<10}| {p // 2}/51 [00:00<00:01, 44.32it/s]"
                      for p in range(0, 101, 5))
    lines.append(core + redraws)
    lines.append(f"{core}INFO 12-02 14:08:09 [gpu_model_runner.py:4621] Graph capturing finished in 5 secs, took 0.47 GiB")
    while len(lines) < 100:
        k = len(lines)
        lines.append(f"{api}DEBUG 12-02 14:08:10 [scheduler.py:{k}] Scheduled batch {k}: 3 running, 0 waiting, 128 tokens")
    return [line.encode() + b"\n" for line in lines]


def _render(count: int) -> list[bytes]:
    """Exactly `count` physical lines: whole blocks, part of one, then the marker line."""
    block = _block()
    body = count - 1
    out = block * (body // len(block)) + block[: body % len(block)]
    out.append(b"(APIServer pid=2700) INFO 12-02 14:08:11 [flood.py:1] " + END_MARKER + b"\n")
    return out


def main() -> int:
    count = int(os.environ.get("GB10D_FLOOD_LINES", "100000"))
    mode = os.environ.get("GB10D_FLOOD_MODE", "chunks")
    lines = _render(count)
    if mode == "chunks":
        data = b"".join(lines)
        pieces = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    else:
        pieces = lines
    fd = sys.stdout.fileno()
    start = time.monotonic()
    for piece in pieces:
        view = memoryview(piece)
        while view:
            view = view[os.write(fd, view):]
    end = time.monotonic()
    report = os.environ.get("GB10D_FLOOD_REPORT")
    if report:
        # Atomically: the bench may look for the file the moment the last line arrives.
        tmp = report + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"start": start, "end": end, "lines": count, "bytes": sum(map(len, lines))}, f)
        os.replace(tmp, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
