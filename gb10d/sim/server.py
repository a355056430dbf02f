"""The simulated `vllm serve` API-server process, from argv to exit status.

It prints what vLLM's API server prints, binds the port early without
listening, forks the EngineCore, waits for it, then serves HTTP and writes
the periodic stats lines. Signals only queue a fact; the main thread acts
on it (REFERENCE §6 for what vLLM does on SIGTERM and on engine death).
Only the main thread takes SIGTERM and SIGINT: the serving threads start
with both blocked (see `_signals_to_main_thread`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Iterator, NoReturn, Sequence

from . import hub, texts
from .args import DEFAULT_MODEL, non_default_args, parse_serve_args, resolved_utilization
from .engine import run_engine
from .model import ModelFacts, describe_model
from .output import STDERR, Console
from .settings import SettingsError, SimSettings, from_environ

if TYPE_CHECKING:
    from .coreclient import EngineClient  # imported when serving begins, as the routes are

API_BOOT_S = 4.0
CONFIG_S = 2.0
SERVE_SETUP_S = 1.0
ENGINE_DEATH_GRACE_S = 5.0
ENGINE_STOP_WAIT_S = 1.0
STARTUP_POLL_S = 10.0  # STARTUP_POLL_PERIOD_MS

_LOGO = (
    "",
    "       \u2588     \u2588     \u2588\u2584   \u2584\u2588",
    " \u2584\u2584 \u2584\u2588 \u2588     \u2588     \u2588 \u2580\u2584\u2580 \u2588  version {version}",
    "  \u2588\u2584\u2588\u2580 \u2588     \u2588     \u2588     \u2588  model   {model}",
    "   \u2580\u2580  \u2580\u2580\u2580\u2580\u2580 \u2580\u2580\u2580\u2580\u2580 \u2580     \u2580",
    "",
)


_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


@contextlib.contextmanager
def _signals_to_main_thread() -> Iterator[None]:
    """Threads started inside never take SIGTERM or SIGINT; the main thread does.

    The kernel may hand a process-directed signal to any thread that has
    it unblocked, and a thread being created (glibc unblocks signals in
    pthread_create) readily takes one. CPython then runs the Python handler
    only when the main thread next executes bytecode, and a main thread
    blocked in `queue.get()` never does: the SIGTERM that should stop the
    server would be lost. Threads inherit the mask of the thread that
    starts them, so the HTTP server's per-request threads are covered too.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


class _Terminated(Exception):
    """SIGTERM or SIGINT arrived while the engine was still starting."""


def _exit_by_sigint() -> NoReturn:
    """Leave as an uncaught KeyboardInterrupt does: killed by SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)


class ApiServer:
    """One run of the API-server process."""

    def __init__(self, settings: SimSettings, args: argparse.Namespace) -> None:
        self.settings = settings
        self.args = args
        self.console = Console(settings.style, "APIServer")
        self.model: ModelFacts = describe_model(args.model, args.max_model_len, settings.shards, args.runner, args.convert)
        self.engine_pid: int | None = None
        self.conn: socket.socket | None = None
        self.client: EngineClient | None = None  # once serving
        self.events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.stopping = threading.Event()
        # Held while a stats line is written, so none follows the shutdown lines.
        self._stats_lock = threading.Lock()
        level = (args.uvicorn_log_level or "info").lower()
        self.uvicorn_info = level in ("info", "debug", "trace")

    # --- helpers -----------------------------------------------------------------

    def log(self, src: str, message: str, level: str = "INFO", name: str | None = None) -> None:
        self.console.log(level, src, message, name=name)

    def uvicorn(self, message: str) -> None:
        if self.uvicorn_info:
            self.console.uvicorn(message)

    def die(self, traceback_text: str, status: int = 1) -> NoReturn:
        """An uncaught exception in the API server: traceback on stderr, exit status 1."""
        self.console.write(STDERR, traceback_text + "\n")
        self._kill_engine()
        os._exit(status)

    def _kill_engine(self) -> None:
        if self.engine_pid is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(self.engine_pid, sig)
            except ProcessLookupError:
                break
        self._reap()

    def _reap(self) -> None:
        """Wait for the EngineCore's exit, so no zombie stays in the group."""
        if self.engine_pid is None:
            return
        try:
            os.waitpid(self.engine_pid, 0)
        except ChildProcessError:
            pass
        self.engine_pid = None

    # --- startup -----------------------------------------------------------------

    def run(self) -> NoReturn:
        signal.signal(signal.SIGTERM, self._terminate_during_init)
        signal.signal(signal.SIGINT, self._terminate_during_init)
        try:
            sock, kv_tokens = self.start()
        except _Terminated:
            self._kill_engine()
            self.console.write(STDERR, texts.traceback_text(texts.API_FRAMES["terminated"], "KeyboardInterrupt: terminated") + "\n")
            _exit_by_sigint()
        self.serve(sock, kv_tokens)

    def _terminate_during_init(self, signum: int, frame: object) -> None:
        raise _Terminated()

    def start(self) -> tuple[socket.socket, int]:
        """Everything up to the EngineCore's ready message: the bound socket and the KV cache size."""
        args, settings = self.args, self.settings
        self.settings.sleep(API_BOOT_S)
        early = "MainProcess" if not settings.style.wrapper_tag else None
        if settings.logo:
            logo = "\n".join(_LOGO).format(version=settings.version, model=args.model)
            self.log("entrypoints/utils/api_utils.py:339", logo, name=early)
        else:
            self.log("entrypoints/utils/api_utils.py:339", f"vLLM server version {settings.version}, serving model {args.model}", name=early)
        self.log("entrypoints/utils/api_utils.py:273", f"non-default args: {non_default_args(args, settings.minor)}", name=early)
        self.validate_parsers()
        sock = self.bind()
        if settings.scenario.model_not_found:
            self.settings.sleep(CONFIG_S)
            self.die(texts.model_not_found(args.model))
        if hub.config_missing(settings, args):
            if hub.refused_offline(settings):
                self.settings.sleep(CONFIG_S)
                self.die(texts.model_not_found(args.model))
            hub.download_config(self.console, settings)
        self.settings.sleep(CONFIG_S)
        self.log("config/model.py:611", f"Resolved architecture: {self.model.architecture}")
        self.log("config/model.py:1745", f"Using max model len {self.model.max_model_len}")
        if self.args.enable_sleep_mode:
            self.log("config/model.py:549", "Enabling cumem allocator because sleep mode requires it.")
        self.log("core/sched/scheduler.py:239", f"Chunked prefill is enabled with max_num_batched_tokens={args.max_num_batched_tokens or 8192}.")
        self.log("config/vllm.py:999", "Asynchronous scheduling is enabled.")
        if args.enforce_eager:
            self.log("config/vllm.py:1055", "Enforce eager set, disabling torch.compile and CUDAGraphs. This is equivalent to setting -cc.mode=none -cc.cudagraph_mode=none", "WARNING")
        self.log("config/kernel.py:270", "Final IR op priority after setting platform defaults: IrOpPriorityConfig(rms_norm=['native'], fused_add_rms_norm=['native'])")
        if args.enforce_eager:
            self.log("config/vllm.py:1273", "Cudagraph is disabled under eager mode")
        self.spawn_engine(sock)
        return sock, self.wait_for_engine()

    def validate_parsers(self) -> None:
        """validate_api_server_args(): tool and reasoning parser names, before the port is bound."""
        args, forced = self.args, self.settings.scenario.bad_parser
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            self.die(texts.traceback_text(texts.API_FRAMES["bad_parser"], texts.AUTO_TOOL_CHOICE_NEEDS_PARSER))
        if args.enable_auto_tool_choice and (forced or args.tool_call_parser not in texts.TOOL_PARSERS):
            self.die(texts.traceback_text(texts.API_FRAMES["bad_parser"], texts.bad_tool_parser(args.tool_call_parser)))
        if args.reasoning_parser and (forced or args.reasoning_parser not in texts.REASONING_PARSERS):
            self.die(texts.traceback_text(texts.API_FRAMES["bad_parser"], texts.bad_reasoning_parser(args.reasoning_parser)))
        if forced:
            self.die(texts.traceback_text(texts.API_FRAMES["bad_parser"], texts.AUTO_TOOL_CHOICE_NEEDS_PARSER))

    def bind(self) -> socket.socket:
        """create_server_socket(): SO_REUSEADDR (and SO_REUSEPORT before 0.25), bound, not listening."""
        host = self.args.host
        family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.settings.minor < 25:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host or ("::" if family == socket.AF_INET6 else "0.0.0.0"), int(self.args.port)))
        except OSError as exc:
            final = texts.PORT_IN_USE if exc.errno == errno.EADDRINUSE else f"OSError: [Errno {exc.errno}] {exc.strerror}"
            self.die(texts.traceback_text(texts.API_FRAMES["port_in_use"], final))
        return sock

    def spawn_engine(self, sock: socket.socket) -> None:
        """Fork the EngineCore; it shares our process group and has no parent-death signal."""
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            sock.close()
            parent_end.close()
            run_engine(self.settings, self.args, self.model, child_end)
        child_end.close()
        self.engine_pid = pid
        self.conn = parent_end

    def wait_for_engine(self) -> int:
        """wait_for_engine_startup(): the ready message, or the engine's death."""
        assert self.conn is not None
        poll_s = self.settings.delay(STARTUP_POLL_S) or None
        buffer = b""
        while b"\n" not in buffer:
            if not select.select([self.conn], [], [], poll_s)[0]:
                self.log("v1/engine/utils.py:1098", "Waiting for 1 local, 0 remote core engine proc(s) to start.", "DEBUG")
                continue
            chunk = self.conn.recv(65536)
            if not chunk:
                self._reap()
                self.die(texts.traceback_text(texts.API_FRAMES["engine_failed"], texts.engine_init_failed()))
            buffer += chunk
        # The engine sends nothing after `ready` until it is given requests.
        return int(json.loads(buffer.partition(b"\n")[0])["kv_tokens"])

    # --- serving -----------------------------------------------------------------

    def serve(self, sock: socket.socket, kv_tokens: int) -> NoReturn:
        """The serving phase: routes, uvicorn's lines, listen(), then act on queued events."""
        from .api import ROUTES, Handler, ServeConfig, SimHTTPServer
        from .coreclient import EngineClient
        from .devapi import DEV_ROUTES
        from .pooling import routes

        args, settings = self.args, self.settings
        assert self.conn is not None
        signal.signal(signal.SIGTERM, lambda signum, frame: self.events.put("stop"))
        signal.signal(signal.SIGINT, lambda signum, frame: self.events.put("stop"))
        spec = args.speculative_config if isinstance(args.speculative_config, dict) else None
        spec_k = int(spec.get("num_speculative_tokens", 1) or 1) if spec else None
        client = EngineClient(self.conn, settings.speed, kv_tokens, spec_k, lambda: self.events.put("engine_dead"))
        self.client = client
        keys = tuple(args.api_key or ()) or ((settings.api_key_env,) if settings.api_key_env else ())
        served = tuple(args.served_model_name or [args.model])
        config = ServeConfig(
            served_names=served, root=args.model, max_model_len=self.model.max_model_len, version=settings.version,
            minor=settings.minor, api_keys=keys, access_log=self.uvicorn_info and not args.disable_uvicorn_access_log,
            utilization=resolved_utilization(args, settings.minor), tasks=self.model.tasks,
            dev_mode=settings.env.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0"), max_queued=getattr(args, "max_num_queued_reqs", None),
        )
        self.settings.sleep(SERVE_SETUP_S)
        self.log("entrypoints/openai/api_server.py:579", f"Supported tasks: {list(self.model.tasks)}")
        self.log("entrypoints/chat_utils/hf.py:548", "Detected the chat template content format to be 'string'. You can set `--chat-template-content-format` to override this.")
        scheme = "https" if args.ssl_certfile else "http"
        host = args.host or "0.0.0.0"
        shown_host = f"[{host}]" if ":" in host else host
        self.log("entrypoints/openai/api_server.py:583", f"Starting vLLM server on {scheme}://{shown_host}:{args.port}")
        if config.dev_mode:
            self.log("entrypoints/serve/__init__.py:36", "SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!", "WARNING")
        self.log("entrypoints/launcher.py:37", "Available routes are:")
        for route, methods in routes(ROUTES, self.model.tasks) + (DEV_ROUTES if config.dev_mode else []):
            self.log("entrypoints/launcher.py:46", f"Route: {route}, Methods: {methods}")
        server = SimHTTPServer(sock, Handler, config, client, self.console)
        self.uvicorn(f"Started server process [{os.getpid()}]")
        self.uvicorn("Waiting for application startup.")
        self.uvicorn("Application startup complete.")
        server.server_activate()
        # The stats lines count from before the first request can be served, as vLLM's logger does:
        # a baseline taken later would leave out what a client asked for at once.
        baseline = client.snapshot()
        with _signals_to_main_thread():
            threading.Thread(target=server.serve_forever, args=(0.05,), name="http", daemon=True).start()
            client.start()
            if not args.disable_log_stats and settings.speed > 0:
                threading.Thread(target=self._stats_loop, args=(client, spec_k, baseline), name="stats", daemon=True).start()
        while True:
            event = self.events.get()
            if event == "stop":
                self.shutdown(server)
            if event == "engine_dead":
                self.engine_died(server)

    def shutdown(self, server: object) -> NoReturn:
        """SIGTERM while serving: vLLM's [shutdown] lines, the engine stopped, exit 0."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with self._stats_lock:
            self.stopping.set()
        self.log("entrypoints/launcher.py:100", "[shutdown] API server: shutdown triggered")
        timeout = self.args.shutdown_timeout
        self.log("entrypoints/launcher.py:116", f"[shutdown] API server: stopping engine client mode={'abort' if not timeout else 'drain'} timeout={timeout}s")
        if not timeout:
            from .api import SimHTTPServer

            assert isinstance(server, SimHTTPServer)
            server.aborting.set()
        if timeout and self.client is not None:
            # --shutdown-timeout: the requests in flight are finished (and still streamed) for up to that long.
            deadline = time.monotonic() + timeout
            while self.client.running() and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.engine_pid is not None:
            self.log("v1/engine/core_client.py:652", f"[shutdown] MPClient: start timeout={self.args.shutdown_timeout}s")
            self.log("v1/engine/core_client.py:654", "[shutdown] MPClient: stopping engine manager")
            self._stop_engine()
            self.log("v1/engine/core_client.py:656", "[shutdown] MPClient: engine manager stopped")
            self.log("v1/engine/core_client.py:657", "[shutdown] MPClient: cleaning up background resources")
            self.log("v1/engine/core_client.py:659", "[shutdown] MPClient: complete")
        self.log("entrypoints/launcher.py:125", "[shutdown] API server: engine client stopped")
        self.log("entrypoints/launcher.py:128", "[shutdown] API server: signalling HTTP server shutdown")
        self.log("entrypoints/launcher.py:149", "[shutdown] API server: shutting down FastAPI HTTP server")
        self._close_http(server, finished=False)
        os._exit(0)

    def _stop_engine(self) -> None:
        """terminate(), then the recursive SIGKILL once the (zero) shutdown timeout has passed."""
        pid = self.engine_pid
        assert pid is not None
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.log("v1/utils.py:607", "[shutdown] Process manager: force killing remaining processes count=1", "WARNING")
        deadline = time.monotonic() + ENGINE_STOP_WAIT_S
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            fd = None
        if fd is not None:
            select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            os.close(fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap()

    def _close_http(self, server: object, finished: bool) -> None:
        from .api import SimHTTPServer

        assert isinstance(server, SimHTTPServer)
        self.uvicorn("Shutting down")
        server.shutdown()
        server.socket.close()
        server.wait_for_unanswered()
        self.uvicorn("Waiting for application shutdown.")
        self.uvicorn("Application shutdown complete.")
        if finished:
            self.uvicorn(f"Finished server process [{os.getpid()}]")

    def engine_died(self, server: object) -> NoReturn:
        """The EngineCore vanished: /health turns 503 now, the server stops about 5 s later, exit 0."""
        from .api import SimHTTPServer

        assert isinstance(server, SimHTTPServer)
        server.engine_dead = True
        with self._stats_lock:
            self.stopping.set()
        self._reap()
        self.log("v1/engine/core_client.py:699", "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup", "WARNING")
        self.log("v1/engine/core_client.py:652", "[shutdown] MPClient: start timeout=default")
        self.log("v1/engine/core_client.py:654", "[shutdown] MPClient: stopping engine manager")
        self.log("v1/engine/core_client.py:656", "[shutdown] MPClient: engine manager stopped")
        self.log("v1/engine/core_client.py:657", "[shutdown] MPClient: cleaning up background resources")
        self.log("v1/engine/core_client.py:659", "[shutdown] MPClient: complete")
        self.log("v1/engine/async_llm.py:704", "AsyncLLM output_handler failed.\n" + texts.ENGINE_DEAD_TRACEBACK, "ERROR")
        if self.settings.keep_alive_on_engine_death:
            while self.events.get() != "stop":
                pass
        else:
            # watchdog_loop notices within about 5 s; a SIGTERM meanwhile only hurries it.
            try:
                self.events.get(timeout=self.settings.delay(ENGINE_DEATH_GRACE_S))
            except queue.Empty:
                pass
        self._close_http(server, finished=True)
        os._exit(0)

    def _stats_loop(self, client: object, spec_k: int | None, baseline: dict[str, float]) -> None:
        """LoggingStatLogger: one line per interval, DEBUG while idle; SpecDecoding right after."""
        from .coreclient import EngineClient

        assert isinstance(client, EngineClient)
        interval = self.settings.stats_interval_s
        wall = self.settings.delay(interval)
        previous = baseline
        idle_before = True
        while not self.stopping.wait(wall):
            now = client.snapshot()
            prompt = (now["prompt"] - previous["prompt"]) / interval
            generation = (now["generation"] - previous["generation"]) / interval
            idle = prompt == 0 and generation == 0
            level = "DEBUG" if idle and idle_before else "INFO"
            idle_before = idle
            parts = [
                f"Avg prompt throughput: {prompt:.1f} tokens/s",
                f"Avg generation throughput: {generation:.1f} tokens/s",
                f"Running: {client.running()} reqs",
                "Waiting: 0 reqs",
                f"GPU KV cache usage: {client.kv_usage() * 100:.1f}%",
            ]
            queries, hits = now["queries"], now["hits"]
            if self.settings.minor < 31 or now["requests"] > 0:
                parts.append(f"Prefix cache hit rate: {(hits / queries * 100) if queries else 0.0:.1f}%")
            drafts = now["drafts"] - previous["drafts"]
            with self._stats_lock:
                if self.stopping.is_set():
                    return
                self.log("v1/metrics/loggers.py:271", "Engine 000: " + ", ".join(parts), level)
                if spec_k and drafts > 0:
                    self.log("v1/spec_decode/metrics.py:215", self._spec_line(now, previous, drafts, spec_k, interval), level)
            previous = now

    @staticmethod
    def _spec_line(now: dict[str, float], previous: dict[str, float], drafts: float, k: int, interval: float) -> str:
        accepted = now["accepted"] - previous["accepted"]
        drafted = now["draft_tokens"] - previous["draft_tokens"]
        per_pos = ", ".join(f"{(now.get(f'pos{p}', 0) - previous.get(f'pos{p}', 0)) / drafts:.3f}" for p in range(k))
        rate = f"{accepted / drafted * 100:.1f}" if drafted else "nan"
        return (
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {accepted / interval:.2f} tokens/s, Drafted throughput: {drafted / interval:.2f} tokens/s, "
            f"Accepted: {int(accepted)} tokens, Drafted: {int(drafted)} tokens, "
            f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: {rate}%"
        )


def serve_main(words: Sequence[str]) -> int:
    """`python -m gb10d.sim serve MODEL [flags]`."""
    try:
        settings = from_environ()
    except SettingsError as exc:
        print(f"gb10d.sim: {exc}", file=sys.stderr)
        return 2
    args = parse_serve_args(words, settings.minor)
    if args.model_tag is None and args.model == DEFAULT_MODEL and args.served_model_name and not args.config:
        # Raised by the serve subcommand before vLLM tags its streams.
        print(texts.traceback_text(texts.API_FRAMES["serve_args"], texts.MODEL_NOT_POSITIONAL), file=sys.stderr)
        return 1
    ApiServer(settings, args).run()

