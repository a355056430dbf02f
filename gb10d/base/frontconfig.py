"""`[front]`: the table of `gb10d front`, the one endpoint before every instance, and its API keys' form.

Apart from the instance's schema because it belongs to another program: the
front reads it from its own config, and an instance's config accepts it and
ignores it, so one file may carry both.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator

from .configtable import Table, absolute

API_KEY_FORM = (
    "each key must be at least 16 characters without spaces (e.g. from `openssl rand -hex 24`), optionally followed by "
    'the models it may use: "KEY qwen llama"'
)


def api_key_problem(entry: str) -> bool:
    """Whether an api_keys entry is malformed (its key too short); the message, API_KEY_FORM, never repeats the key."""
    words = entry.split()
    return not words or len(words[0]) < 16


class FrontSection(Table):
    """`[front]`: the one public endpoint (`gb10d front`) before every gb10d instance of the machine.

    Read from the front's own config (/etc/gb10d.toml); in an instance's config it is accepted and ignored, so one
    file may carry both."""

    listen: str = "0.0.0.0:8000"
    # The instance configs, one *.toml per `gb10d@NAME`; their [vllm] host and port are the internal addresses.
    instances_dir: Path = Field(default=Path("/etc/gb10d"), strict=False)
    # How long a request waits for its model's instance to start or recover before it gets 503 with Retry-After;
    # unset: what the instance's own start may take (its startup.ready_timeout_s).
    hold_timeout_s: float | None = Field(default=None, gt=0)
    # Requests held per model at once; one more gets 503 at once.
    queue_limit: int = Field(default=256, ge=1)
    # A request body over this gets 413: vLLM's image and audio inputs fit far below it.
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # Prometheus metrics per model (requests, held, hold time, rejected); "" disables them.
    metrics_listen: str = "127.0.0.1:9500"
    # Each model's state and held requests, rewritten as they change, for `gb10d status --all`.
    state_file: Path = Field(default=Path("/run/gb10d-front/state.json"), strict=False)
    # Keys a client must send (`Authorization: Bearer KEY` or `x-api-key: KEY`); none: every client is let in.
    # "KEY qwen llama": a key that may use only those models.
    api_keys: list[str] = Field(default_factory=list)
    # More keys, one entry a line in the same form (# comments), kept out of the config: root:gb10d, mode 0640.
    api_keys_file: Path | None = Field(default=None, strict=False)
    # Client connections at once (more are made room for by closing idle ones, else answered 503); the front
    # lowers it to what its open-file limit allows.
    max_connections: int = Field(default=16384, ge=16)
    # A connection that sends no request head for this long, between requests or at its start, is closed.
    idle_timeout_s: float = Field(default=60.0, gt=0)
    # A request body whose next bytes take longer than this gets 408.
    body_timeout_s: float = Field(default=60.0, gt=0)
    # A client that takes no byte of its answer for this long is dropped.
    send_timeout_s: float = Field(default=60.0, gt=0)
    # vLLM's address must accept a connection within this, else it counts as refusing (the request waits, retried).
    connect_timeout_s: float = Field(default=5.0, gt=0)
    # vLLM must send its response head within this once a request is passed (a long answer that is not streamed
    # sends its head only at the end).
    upstream_head_timeout_s: float = Field(default=1800.0, gt=0)
    # Connections to each instance at once: held requests are released into them, never all onto vLLM at once.
    upstream_connections: int = Field(default=512, ge=1)
    # The request bodies the front holds in memory at once (held or being passed on); past it a request gets 503.
    max_held_body_bytes: int = Field(default=1024 * 1024 * 1024, ge=1024 * 1024)
    # SIGTERM (a stop, a restart, an upgrade): how long streams in flight and held requests are given to finish.
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # Pages of these origins may call the endpoint from a browser (CORS); "*" for any. None by default.
    cors_origins: list[str] = Field(default_factory=list)
    # vLLM routes the front passes although they are not inference routes (e.g. "/v1/load_lora_adapter").
    open_routes: list[str] = Field(default_factory=list)

    absolute_dir = field_validator("instances_dir", "api_keys_file", "state_file")(absolute)

    @field_validator("api_keys")
    @classmethod
    def _keys_long_enough(cls, value: list[str]) -> list[str]:
        if any(api_key_problem(entry) for entry in value):
            raise ValueError(API_KEY_FORM)
        return value

    @field_validator("listen", "metrics_listen")
    @classmethod
    def _listen_form(cls, value: str, info: ValidationInfo) -> str:
        if value == "" and info.field_name == "metrics_listen":
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not (0 < int(port) < 65536) or not host:
            example = '"0.0.0.0:8000" or "127.0.0.1:8000"' if info.field_name == "listen" else '"127.0.0.1:9500", or "" to disable'
            raise ValueError(f"must be \"HOST:PORT\" such as {example} (got {value!r})")
        return value

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) to bind."""
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of the metrics listener, or None when disabled."""
        if not self.metrics_listen:
            return None
        host, _, port = self.metrics_listen.rpartition(":")
        return host.strip("[]"), int(port)


def on_loopback(host: str) -> bool:
    """Whether only this machine reaches a listener on `host` (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost resolves to whatever the network says


def open_to_everyone(front: FrontSection) -> str | None:
    """Why a front that listens beyond loopback without API keys is worth a warning (anyone who reaches its port uses
    every model), or None. A warning, not an error: a firewall or a trusted network may be the guard."""
    host, port = front.address
    if on_loopback(host) or front.api_keys or front.api_keys_file is not None:
        return None
    return (
        f"is {front.listen!r}, beyond loopback, and neither front.api_keys nor front.api_keys_file is set: anyone who reaches "
        f"port {port} can use every model; set api_keys (each key e.g. from `openssl rand -hex 24`), or listen on "
        f"127.0.0.1:{port} behind a proxy that authenticates"
    )


def socket_differs(front: FrontSection, socket_listens: list[str]) -> str | None:
    """Why front.listen misleads when gb10d-front.socket listens elsewhere (under systemd the socket's address is the
    one served; front.listen only when the front runs without it), or None when they agree or there is no socket."""
    if not socket_listens:
        return None
    _, port = front.address
    ports = {entry.rpartition(":")[2] for entry in socket_listens}
    if ports == {str(port)}:
        return None
    return (
        f"is {front.listen!r}, but gb10d-front.socket listens on {', '.join(socket_listens)}: under systemd the front serves "
        "the socket's address; change it with `systemctl edit gb10d-front.socket` (ListenStream=), or set front.listen to match"
    )
