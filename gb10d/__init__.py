"""gb10d: a systemd-managed supervisor for vLLM on NVIDIA GB10 machines."""

__version__ = "0.1.0"
