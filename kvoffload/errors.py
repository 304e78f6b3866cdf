"""The one root of kvoffload's own errors: what a user or operator must change (configuration), a
store that cannot work, a cache layout kvoffload cannot serve. The CLI reports a `KVOffloadError` in
one line (exit status 2); any other exception is a bug and shows its traceback. The configuration and
layout errors are also `ValueError`s, as vLLM and callers of the earlier releases catch them so."""


class KVOffloadError(Exception):
    """Anything kvoffload refuses with a message that says what to change."""


class ConfigError(KVOffloadError, ValueError):
    """A configuration value that cannot work: a URL, an option, a connector setting, a file."""


class StoreError(KVOffloadError):
    """A store refused an operation (not a run-time read/write fault: those are counted misses)."""


class LayoutError(KVOffloadError, ValueError):
    """A KV cache layout kvoffload cannot offload (an unknown spec, views that disagree)."""


# What a user must change (a KVOffloadError: configuration, store, layout), reported in one line with exit
# status 2 by the CLI and by verify's child processes; anything else is a bug: a traceback. The OS errors
# are about files named on the command line (--prompts, --model, --out).
INPUT_ERRORS = (KVOffloadError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
