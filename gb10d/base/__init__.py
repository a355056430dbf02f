"""The words every part of gb10d speaks: the config (schema, loading, located errors), the error tree and exit
statuses, the syslog levels, spans and sizes as operators read them (units), what an instance holds alone, vLLM's command line and environment, container image
references, the Hugging Face cache's layout and the request that proves a model serves.

Pure data and pure functions, the bottom layer: imports nothing of gb10d outside gb10d.base, and no I/O library.
"""
