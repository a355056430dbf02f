"""The regular expressions that find vLLM's events in a message, and the unit table their numbers need.

Kept apart from the code that uses them so that `scan` reads as the order of the checks, not as a wall of
patterns; each is written against the exact text of a vLLM release (REFERENCE's log formats per version).
"""

from __future__ import annotations

import re

# --- events -----------------------------------------------------------------------

_PORT = re.compile(r"(?:\(['\"][^'\"]*['\"], (?P<p1>\d+)\)|:(?P<p2>\d{2,5})\b)")
_NOT_LOCAL = re.compile(r"(?:OSError: )?['\"]?(?P<model>[^\s'\"]+)['\"]? is not a local folder and is not a valid model identifier")
_REPO_NOT_FOUND = re.compile(r"Repository Not Found for url: https?://[^/\s]+/(?:api/models/)?(?P<model>[^/\s]+/[^/\s]+)")
_NO_CONFIG = re.compile(r"Can't load the configuration of '(?P<model>[^']+)'")
_GATED_URL = re.compile(r"gated repo for url https?://[^/\s]+/(?:api/models/)?(?P<model>[^/\s]+/[^/\s]+)")
_BAD_PARSER = re.compile(r"invalid (?P<kind>tool call|reasoning) parser: (?P<value>[^\s'\"]*)[^'\"]*")
# Later releases: `Tool parser 'x' not found.`, `Reasoning parser 'x' not found. ...`, and the TypeErrors
# `--enable-auto-tool-choice requires tool_parser:'x' which has not been registered`, `reasoning_parser_name='x' has not been registered`.
_PARSER_NOT_FOUND = re.compile(
    r"(?P<kind>Tool|Reasoning) parser '(?P<value>[^']*)' not found\.?|(?P<kind2>tool|reasoning)_parser(?:_name=|:)'(?P<value2>[^']*)'"
    r"(?: which)? has not been registered"
)
_ARGPARSE = re.compile(r"(?:^|\s)(?:vllm(?: serve)?|[\w.-]+): error: (?P<msg>.+)$")
_ARGPARSE_FLAG = re.compile(
    r"^argument (?P<flag>-[\w-]+)(?:/-[\w-]+)*: (?:invalid (?:choice|[\w ]+ value): '(?P<value>[^']*)')?"
    r"|^unrecognized arguments: (?P<words>.+)|^the following arguments are required: (?P<required>[^,\s]+)"
    r"|^ambiguous option: (?P<ambiguous>-[\w-]+)"
)
# Ports of vLLM's internal sockets: ZMQ (`zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5555')`)
# and torch.distributed's store (`DistNetworkError: The server socket has failed to listen ... port: 29500, ... EADDRINUSE`).
_INTERNAL_SOCKET = re.compile(r"ZMQError|addr=|tcp://|ipc://|DistNetworkError|EADDRINUSE|server socket has failed|TCPStore|c10d")
_SOCKET_ADDRESS = re.compile(r"(?P<address>(?:tcp|ipc)://[^\s'\")]+)")
_INTERNAL_PORT = re.compile(r"(?:port: |:)(?P<port>\d{2,5})\b")
_HF_VALIDATION = re.compile(r"Repo id must (?:be in the form|use alphanumeric chars).*?: '(?P<model>[^']+)'")
_NO_CONFIG_FILE = re.compile(r"(?P<model>\S+) does not appear to have a file named (?:config\.json|params\.json)")
_MISSING_CONFIG = re.compile(r"No such file or directory: '(?P<model>[^']+)/(?:config|params|tokenizer_config)\.json'")
_HUB_UNREACHABLE = re.compile(
    r"We couldn't connect to '[^']+' to load (?:this file|the files)(?:.*?it looks like (?P<model>\S+) is not the path)?"
    r"|(?P<entry>LocalEntryNotFoundError|OfflineModeIsEnabled)"
)
_GRAPH_BAR = re.compile(r"Capturing CUDA graph[^:]*:\s+\d+%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)")
_GRAPH_DONE = re.compile(r"Graph capturing finished in [\d.]+ secs?(?:, took (?P<gib>-?[\d.]+) GiB)?")
_WEIGHTS_TOOK = re.compile(r"Loading weights took (?P<s>[\d.]+) seconds")
_MODEL_LOADING_TOOK = re.compile(r"Model loading took (?P<gib>[\d.]+) GiB(?: memory)? and (?P<s>[\d.]+) seconds")
_V0_WEIGHTS_TOOK = re.compile(r"Loading model weights took (?P<gib>[\d.]+) GB")
_V0_BLOCKS = re.compile(r"# (?:GPU|CUDA) blocks: (?P<n>\d+)")
_V0_KV_INSUFFICIENT = re.compile(
    r"The model's max seq len \((?P<len>\d+)\) is larger than the maximum number of tokens that can be stored in KV "
    r"cache \((?P<fit>\d+)\)"
)
_SECONDS = re.compile(r"(?:took|takes|time:) (?P<s>[\d.]+) ?s\b")
_KV_AVAILABLE = re.compile(r"Available KV cache memory: (?P<gib>-?[\d.]+) GiB")
_KV_SIZE = re.compile(r"KV cache size: (?P<tokens>[\d,]+) tokens")
_MAX_CONCURRENCY = re.compile(r"Maximum concurrency for [\d,]+ tokens per request: (?P<x>[\d.]+)x")
_INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took (?P<s>[\d.]+) s")
_TASK_NAMES = re.compile(r"'([\w&]+)'")
_SERVER_ON = re.compile(r"(?:Starting vLLM (?:API )?server on|Uvicorn running on) (?P<url>[^\s)]+)")
_BANNER = re.compile(r"vLLM (?:API )?server version (?P<v>[^\s,]+)")
_LOGO_VERSION = re.compile(r"\bversion\s+(?P<v>\d+\.\d+[\w.+-]*)\s*$")
_ENGINE_VERSION = re.compile(r"Initializing a V1 LLM engine \(v(?P<v>[^)\s]+)\)")
# V0 engines (before 0.8) printed the same parts without the engine head.
_STATS_HEAD = re.compile(r"^(?:Engine (?P<engine>\d+): |(?P<n>\d+) Engines Aggregated: |(?=Avg prompt throughput))")
_SPEC = re.compile(
    r"SpecDecoding metrics: Mean acceptance length: (?P<mal>[\d.]+|nan|inf), Accepted throughput: (?P<acc_s>[\d.]+) tokens/s, "
    r"Drafted throughput: (?P<dr_s>[\d.]+) tokens/s, Accepted: (?P<acc>\d+) tokens, Drafted: (?P<dr>\d+) tokens, "
    r"Per-position acceptance rate: (?P<pos>[\d., ]*?), Avg Draft acceptance rate: (?P<rate>[\d.]+|nan)%"
)

_UNIT_GIB = {"B": 1 / 2**30, "bytes": 1 / 2**30, "KiB": 1 / 2**20, "KB": 1 / 2**20, "MiB": 1 / 1024, "MB": 1 / 1024,
             "GiB": 1.0, "GB": 1.0, "TiB": 1024.0, "TB": 1024.0}


def _f(value: str) -> float:
    return float(value)

_MODEL_WORDS = re.compile(
    "is not a local folder|Repository Not Found|load the configuration of|Repo id must|does not appear to have a file"
    "|No such file or directory: '.*json'|couldn't connect to|LocalEntryNotFound|OfflineModeIsEnabled"
)
# A container's init that could not start the image's program: docker's tini names it, podman's catatonit does not.
_INIT_EXEC = re.compile(r"(?:\[FATAL tini \(\d+\)\] exec (?P<program>\S+) failed|ERROR \(catatonit:\d+\): failed to exec pid1): (?P<reason>.+)")
_ARGUMENT_WORDS = re.compile("parser|: error: |--enable-auto-tool-choice|first positional argument|Config file must be of a yaml")
