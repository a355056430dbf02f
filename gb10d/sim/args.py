"""`vllm serve`'s command line, parsed as vLLM's FlexibleArgumentParser parses it.

Only the flags matter that gb10d or a GB10 start script may pass; all of them
are declared in vLLM's order (frontend first, then engine arguments) so that
`non-default args: {...}` comes out in vLLM's order. An unknown flag ends the
run with argparse's usage error and exit status 2, before any log line, as
in vLLM.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Callable, Sequence

USAGE = "vllm serve [model_tag] [options]"
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def human_int(text: str) -> int:
    """vLLM's human_readable_int: `32k` = 32000, `32K` = 32768, `-1`/`auto` = -1."""
    if text in ("-1", "auto"):
        return -1
    match = _HUMAN_INT.fullmatch(text)
    if match:
        number, suffix = match.groups()
        base = 1024 if suffix.isupper() else 1000
        power = "kmgt".index(suffix.lower()) + 1
        if suffix.isupper() and "." in number:
            raise argparse.ArgumentTypeError(f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use {number}{suffix.lower()} instead?")
        return int(float(number) * base**power)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid human readable int value: {text!r}") from None


def json_value(text: str) -> Any:
    """A JSON argument (e.g. --speculative-config '{"method":"mtp",...}')."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON: {exc}") from None


STR, INT, FLOAT, BOOL, LIST, JSON, HINT = "str", "int", "float", "bool", "list", "json", "hint"

# (flag, kind, default, extra options) in vLLM's declaration order.
_FRONTEND: list[tuple[str, str, Any, dict[str, Any]]] = [
    ("host", STR, None, {}),
    ("port", INT, 8000, {}),
    ("uds", STR, None, {}),
    ("uvicorn-log-level", STR, "info", {"choices": ["critical", "debug", "error", "info", "trace", "warning"]}),
    ("disable-uvicorn-access-log", BOOL, False, {}),
    ("allow-credentials", BOOL, False, {}),
    ("allowed-origins", LIST, ["*"], {}),
    ("allowed-methods", LIST, ["*"], {}),
    ("allowed-headers", LIST, ["*"], {}),
    ("api-key", LIST, None, {}),
    ("lora-modules", LIST, None, {}),
    ("chat-template", STR, None, {}),
    ("chat-template-content-format", STR, "auto", {}),
    ("trust-request-chat-template", BOOL, False, {}),
    ("response-role", STR, "assistant", {}),
    ("ssl-keyfile", STR, None, {}),
    ("ssl-certfile", STR, None, {}),
    ("ssl-ca-certs", STR, None, {}),
    ("enable-ssl-refresh", BOOL, False, {}),
    ("root-path", STR, None, {}),
    ("middleware", LIST, [], {}),
    ("return-tokens-as-token-ids", BOOL, False, {}),
    ("disable-frontend-multiprocessing", BOOL, False, {}),
    ("enable-request-id-headers", BOOL, False, {}),
    ("enable-auto-tool-choice", BOOL, False, {}),
    ("exclude-tools-when-tool-choice-none", BOOL, False, {}),
    ("tool-call-parser", STR, None, {}),
    ("tool-parser-plugin", STR, "", {}),
    ("tool-server", STR, None, {}),
    ("log-config-file", STR, None, {}),
    ("max-log-len", INT, None, {}),
    ("disable-fastapi-docs", BOOL, False, {}),
    ("enable-prompt-tokens-details", BOOL, False, {}),
    ("enable-server-load-tracking", BOOL, False, {}),
    ("enable-force-include-usage", BOOL, False, {}),
    ("enable-tokenizer-info-endpoint", BOOL, False, {}),
    ("enable-log-outputs", BOOL, False, {}),
    ("log-error-stack", BOOL, False, {}),
    ("shutdown-timeout", INT, 0, {}),
    ("headless", BOOL, False, {}),
    ("api-server-count", INT, 1, {"aliases": ["-asc"]}),
    ("config", STR, None, {}),
]

_ENGINE: list[tuple[str, str, Any, dict[str, Any]]] = [
    ("model", STR, DEFAULT_MODEL, {}),
    ("runner", STR, "auto", {}),
    ("convert", STR, "auto", {}),
    ("tokenizer", STR, None, {}),
    ("tokenizer-mode", STR, "auto", {}),
    ("trust-remote-code", BOOL, False, {}),
    ("dtype", STR, "auto", {}),
    ("seed", INT, 0, {}),
    ("hf-config-path", STR, None, {}),
    ("revision", STR, None, {}),
    ("code-revision", STR, None, {}),
    ("tokenizer-revision", STR, None, {}),
    ("max-model-len", HINT, None, {}),
    ("quantization", STR, None, {"aliases": ["-q"]}),
    ("enforce-eager", BOOL, False, {}),
    ("max-logprobs", INT, 20, {}),
    ("disable-sliding-window", BOOL, False, {}),
    ("disable-cascade-attn", BOOL, False, {}),
    ("skip-tokenizer-init", BOOL, False, {}),
    ("enable-prompt-embeds", BOOL, False, {}),
    ("served-model-name", LIST, None, {}),
    ("hf-token", STR, None, {}),
    ("hf-overrides", JSON, {}, {}),
    ("generation-config", STR, "auto", {}),
    ("override-generation-config", JSON, {}, {}),
    ("enable-sleep-mode", BOOL, False, {}),
    ("model-impl", STR, "auto", {}),
    ("language-model-only", BOOL, False, {}),
    ("load-format", STR, "auto", {}),
    ("download-dir", STR, None, {}),
    ("safetensors-load-strategy", STR, None, {}),
    ("model-loader-extra-config", JSON, {}, {}),
    ("ignore-patterns", LIST, None, {}),
    ("use-tqdm-on-load", BOOL, True, {}),
    ("attention-backend", STR, None, {}),
    ("reasoning-parser", STR, "", {}),
    ("distributed-executor-backend", STR, None, {}),
    ("pipeline-parallel-size", INT, 1, {"aliases": ["-pp"]}),
    ("tensor-parallel-size", INT, 1, {"aliases": ["-tp"]}),
    ("data-parallel-size", INT, 1, {"aliases": ["-dp"]}),
    ("enable-expert-parallel", BOOL, False, {"aliases": ["-ep"]}),
    ("max-parallel-loading-workers", INT, None, {}),
    ("disable-custom-all-reduce", BOOL, False, {}),
    ("block-size", INT, None, {}),
    ("gpu-memory-utilization", FLOAT, 0.92, {}),
    ("kv-cache-memory-bytes", HINT, None, {}),
    ("enable-extensible-kv-cache", BOOL, None, {"since": 34}),
    ("swap-space", FLOAT, 4, {}),
    ("kv-cache-dtype", STR, "auto", {"choices": ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"]}),
    ("num-gpu-blocks-override", INT, None, {}),
    ("enable-prefix-caching", BOOL, None, {}),
    ("cpu-offload-gb", FLOAT, 0, {}),
    ("calculate-kv-scales", BOOL, False, {}),
    ("mamba-cache-dtype", STR, "auto", {"choices": ["auto", "float32", "float16", "bfloat16"]}),
    ("mamba-ssm-cache-dtype", STR, "auto", {"choices": ["auto", "float32", "float16", "bfloat16"]}),
    ("limit-mm-per-prompt", JSON, {}, {}),
    ("mm-processor-kwargs", JSON, None, {}),
    ("mm-processor-cache-gb", FLOAT, 4, {}),
    ("max-num-batched-tokens", HINT, None, {}),
    ("max-num-queued-reqs", INT, None, {"since": 34}),
    ("max-num-seqs", INT, None, {}),
    ("enable-chunked-prefill", BOOL, None, {}),
    ("scheduling-policy", STR, "fcfs", {}),
    ("async-scheduling", BOOL, None, {}),
    ("speculative-config", JSON, None, {}),
    ("kv-transfer-config", JSON, None, {}),
    ("compilation-config", JSON, {}, {"aliases": ["-cc", "-O"]}),
    ("additional-config", JSON, {}, {}),
    ("disable-log-stats", BOOL, False, {}),
    ("enable-log-requests", BOOL, False, {}),
    ("max-cudagraph-capture-size", INT, None, {}),
    ("enable-flashinfer-autotune", BOOL, None, {}),
]

_TYPES: dict[str, Callable[[str], Any]] = {STR: str, INT: int, FLOAT: float, JSON: json_value, HINT: human_int}
_LOAD_STRATEGIES = ["eager", "lazy", "prefetch", "torchao"]


class ServeArgumentParser(argparse.ArgumentParser):
    """argparse with vLLM's usage line and its `_`-to-`-` and `--a.b v` spellings."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        words = list(sys.argv[2:] if args is None else args)
        plain, dotted = _split_dotted(words)
        parsed = super().parse_args(plain, namespace)
        for name, (key, value) in dotted:
            dest = name.replace("-", "_")
            current = getattr(parsed, dest, None)
            merged = dict(current) if isinstance(current, dict) else {}
            merged[key] = _json_or_text(value)
            setattr(parsed, dest, merged)
        return parsed


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _split_dotted(words: list[str]) -> tuple[list[str], list[tuple[str, tuple[str, str]]]]:
    """Underscores to dashes in flag names; pull out `--speculative-config.method mtp` forms."""
    plain: list[str] = []
    dotted: list[tuple[str, tuple[str, str]]] = []
    index = 0
    while index < len(words):
        word = words[index]
        if word.startswith("--") and len(word) > 2:
            name, eq, value = word[2:].partition("=")
            name, dot, key = name.partition(".")
            name = name.replace("_", "-")
            if dot:
                base = name
                if not eq and index + 1 < len(words):
                    index += 1
                    value = words[index]
                dotted.append((base, (key, value)))
                index += 1
                continue
            word = f"--{name}{eq}{value}"
        plain.append(word)
        index += 1
    return plain, dotted


def build_parser(minor: int) -> ServeArgumentParser:
    """The `vllm serve` parser of the simulated version (0.24+ restrict the load strategy)."""
    parser = ServeArgumentParser(prog="vllm serve", usage=USAGE, add_help=True, allow_abbrev=False)
    parser.add_argument("model_tag", nargs="?", default=None)
    for flag, kind, default, extra in _FRONTEND + _ENGINE:
        if minor < extra.get("since", 0):
            continue
        names = [f"--{flag}", *extra.get("aliases", [])]
        options: dict[str, Any] = {"default": default, "dest": flag.replace("-", "_")}
        if flag == "gpu-memory-utilization" and minor >= 34:
            # 0.34: unset means "resolve it" (1.0 with the extensible KV cache), and a device-neutral alias.
            names.append("--device-memory-utilization")
            options["default"] = None
        if "choices" in extra:
            options["choices"] = extra["choices"]
        if flag == "safetensors-load-strategy" and minor >= 24:
            options["choices"] = _LOAD_STRATEGIES
        if kind == BOOL:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **options)
        elif kind == LIST:
            parser.add_argument(*names, nargs="+", **options)
        else:
            parser.add_argument(*names, type=_TYPES[kind], **options)
    return parser


def parse_serve_args(words: Sequence[str], minor: int) -> argparse.Namespace:
    """Parse the words after `serve`; argparse exits 2 with a usage error on bad input."""
    parser = build_parser(minor)
    args: argparse.Namespace = parser.parse_args(list(words))
    if args.model_tag is not None:
        args.model = args.model_tag
    return args


def extensible_kv_cache(args: argparse.Namespace, minor: int) -> bool:
    """0.34's `_resolve_extensible_kv_cache` on CUDA: on unless turned off, or a fixed KV size (bytes, blocks) overrides it."""
    if minor < 34:
        return False
    asked = getattr(args, "enable_extensible_kv_cache", None)
    if asked is not None:
        return bool(asked)
    return args.kv_cache_memory_bytes is None and args.num_gpu_blocks_override is None


def resolved_utilization(args: argparse.Namespace, minor: int) -> float:
    """0.34's `resolved_gpu_memory_utilization`: the flag, else 1.0 with the extensible KV cache, else 0.92."""
    if args.gpu_memory_utilization is not None:
        return float(args.gpu_memory_utilization)
    return 1.0 if extensible_kv_cache(args, minor) else 0.92


def non_default_args(args: argparse.Namespace, minor: int) -> dict[str, Any]:
    """What vLLM logs as `non-default args`, in declaration order."""
    defaults = vars(build_parser(minor).parse_args([]))
    shown: dict[str, Any] = {}
    for name, value in vars(args).items():
        if name == "model" and args.model_tag is not None:
            shown[name] = value
        elif defaults.get(name) != value:
            shown[name] = value
    return shown
