"""Watch a Ray cluster's node table for gb10d: one JSON line on stdout each time it changes.

gb10d itself has no Ray; this script is run by the Python of the venv that
has Ray and vLLM (`python -I raywatch.py HEAD:PORT`), and imports nothing
from gb10d. It asks the head's GCS for its node table once a second, the
same table `ray status` reads, and prints

    {"nodes": [{"id": ..., "ip": ..., "alive": true, "head": true, "gpus": 1.0, "death": "", "started": 1764748800.0}, ...]}

or, while the GCS cannot be reached, {"error": "..."}; a line only when it
differs from the previous one, so an idle cluster costs gb10d nothing.
"""

from __future__ import annotations

import importlib
import json
import socket
import sys
import time
from typing import Any

INTERVAL_S = 1.0
TIMEOUT_S = 5


def _node(info: Any) -> dict[str, object]:
    death = info.death_info.reason_message if info.HasField("death_info") else ""
    return {
        "id": info.node_id.hex() if isinstance(info.node_id, bytes) else str(info.node_id),
        "ip": info.node_manager_address,
        "alive": info.state == 0,  # GcsNodeInfo.ALIVE
        "head": bool(info.is_head_node),
        "gpus": float(info.resources_total.get("GPU", 0.0)),
        "death": death,
        "started": info.start_time_ms / 1000,
    }


def _emit(report: dict[str, object], last: str) -> str:
    line = json.dumps(report, sort_keys=True)
    if line != last:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    return line


def main(address: str) -> int:
    try:
        # Ray's private API, stable in Ray 2.4x-2.6x. Looked up at run time so that
        # mypy gives the same answer whichever Ray (or none) is installed beside it.
        GcsClient = importlib.import_module("ray._raylet").GcsClient
    except ImportError as exc:
        _emit({"error": f"this Python cannot import Ray ({exc}); cluster.ray must be the ray of vLLM's venv"}, "")
        return 2
    last, client = "", None
    host, _, port = address.rpartition(":")
    while True:
        try:
            if client is None:
                # Ray's client blocks for tens of seconds, silently, when the GCS is not up yet: knock first.
                socket.create_connection((host, int(port)), timeout=TIMEOUT_S).close()
                client = GcsClient(address=address)
            table = client.get_all_node_info(timeout=TIMEOUT_S)
            report: dict[str, object] = {"nodes": sorted((_node(info) for info in table.values()), key=lambda n: str(n["id"]))}
        except Exception as exc:
            client = None  # a head that started again is a new cluster: connect afresh
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            report = {"error": f"Ray's GCS at {address} does not answer ({reason})"}
        last = _emit(report, last)
        time.sleep(INTERVAL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
