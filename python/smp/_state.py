"""The process's runtime once smp.init has joined the job: one place that the package's modules read it from."""

_runtime = None


def set_runtime(runtime):
    global _runtime
    _runtime = runtime


def runtime_or_none():
    return _runtime


def runtime():
    """The runtime of smp.init."""
    if _runtime is None:
        raise RuntimeError("smp.init(config) has not been called in this process")
    return _runtime
