"""Is the tracking server (or its S3 store) down? For an exception, and by a quick probe.

Only "down" errors are spooled and retried later; any other error (a bad value, a deleted run)
would fail the same way on every replay, so it is not treated as an outage.

MlflowClient retries a refused connection for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES=7 with
exponential back-off), and the only knob is a process-wide environment variable. So a tracker
asks ``/health`` first, with a short timeout, and spools straight away when nobody answers; the
long retry happens only when the server dies between the probe and the call.
"""

from __future__ import annotations

# Exception class names (anywhere in the class's MRO) that mean "could not reach it", from
# requests, urllib3, botocore and the standard library. Matched by name so that this module
# imports none of them.
_UNAVAILABLE = frozenset({
    "ConnectionError",  # builtin and requests'
    "ConnectTimeout", "ReadTimeout", "Timeout", "TimeoutError",  # requests, builtin
    "RetryError", "MaxRetryError", "NewConnectionError", "ProtocolError",  # retries exhausted
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",  # botocore (S3)
    "ConnectionClosedError",
})
# MlflowException error codes for a server that answered but cannot serve now.
_UNAVAILABLE_CODES = frozenset({"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"})
PROBE_TIMEOUT_S = 3.0


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps: MlflowException re-raises requests' errors with the
    original only as context) says the server could not be reached."""
    for link in _chain(exc):
        if any(cls.__name__ in _UNAVAILABLE for cls in type(link).__mro__):
            return True
        if getattr(link, "error_code", None) in _UNAVAILABLE_CODES:
            return True
    return False


def reachable(tracking_uri: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server answers at all (any HTTP status counts: auth or a proxy's 404 is still
    a server that will answer the real call). Local (file/sqlite) stores are always reachable."""
    if not tracking_uri.startswith(("http://", "https://")):
        return True
    import requests

    try:
        requests.get(tracking_uri.rstrip("/") + "/health", timeout=timeout)
    except requests.RequestException:
        return False
    return True
