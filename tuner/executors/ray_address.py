"""A Ray cluster's address as the driver uses it: parsing `host:port` (IPv6 in brackets) and checking,
within seconds, that Ray's GCS answers there, and takes this process's token, before `ray.init`,
which retries for minutes."""

from __future__ import annotations

import os
import socket

GCS_PORT = 6379  # `ray start --head`'s default; the address a driver on a cluster node joins
PROBE_TIMEOUT_S = 5.0
# A GCS method every Ray 2.x GCS serves (the raylets' own liveness check). A GCS answers it, or
# refuses it for want of the cluster's token; any other gRPC server (the Ray Client server on
# 10001, a raylet) answers UNIMPLEMENTED, and a non-gRPC service (the dashboard on 8265, a redis)
# fails the HTTP/2 handshake.
_GCS_METHOD = "/ray.rpc.NodeInfoGcsService/CheckAlive"
_NOT_GCS_HINT = "is this the GCS port (6379)?"
_FIX = (
    "start one with `ray start --head`, fix the address, or unset RAY_ADDRESS to run trials on a "
    "local Ray runtime"
)


_TOKEN_FIX = (
    "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on the "
    "head node prints it), or copy it to ~/.ray/auth_token"
)


class ClusterAddressError(ConnectionError):
    """The cluster address cannot be used: nothing, or no Ray GCS, answers there, or it is a Ray
    Client address (`ray://`)."""


def split_address(address: str, default_port: int = GCS_PORT) -> tuple[str, int] | None:
    """(host, port) of `host[:port]` or `[v6-host][:port]`; None for what only Ray resolves
    ("auto", "local") or what is no address at all."""
    text = address.strip()
    if not text or "://" in text or text in ("auto", "local"):
        return None
    if text.startswith("["):  # [::1]:6379 or [::1]
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] or str(default_port)
    elif text.count(":") > 1:  # a bare IPv6 address: there is no port to split off
        host, port = text, str(default_port)
    else:
        host, _, port = text.partition(":")
        port = port or str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def join_address(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets (what gRPC and Ray parse)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def refuse_ray_client(address: str, source: str) -> None:
    """A `ray://` address is Ray Client's: its driver runs remotely and `ray._private` state (the
    nodes' resources, what the executor places trials by) is not there."""
    if address.strip().lower().startswith("ray://"):
        raise ClusterAddressError(
            f"{source}={address}: Ray Client addresses (ray://) cannot run trials: the driver must "
            f"run on a cluster node; use the GCS address host:{GCS_PORT} (on the head node, "
            f"`ray start --head` prints it)"
        )


def check_cluster(
    address: str, source: str, timeout_s: float = PROBE_TIMEOUT_S, joining: bool = False
) -> None:
    """Raise ClusterAddressError unless Ray's GCS answers at `address` within `timeout_s`.
    `joining`: this process calls ray.init next, so where the GCS asks for Ray's token, it must
    take the one this process would send (not so for `/readyz`: the API's process joins nothing).

    Addresses only Ray resolves ("auto") pass unchecked; a `ray://` one is refused."""
    refuse_ray_client(address, source)
    where = split_address(address)
    if where is None:
        return
    try:
        _connect(*where, timeout_s)
    except OSError as err:
        raise ClusterAddressError(
            f"{source}={address}: no Ray cluster answers there ({err.strerror or err}); {_FIX}"
        ) from None
    target = join_address(*where)
    code = _ask_gcs(target, timeout_s)
    why = _not_gcs(code, timeout_s)
    if why:
        raise ClusterAddressError(f"{source}={address}: no Ray cluster answers there ({why}); {_FIX}")
    why = _token_refused(target, timeout_s) if joining and code == "UNAUTHENTICATED" else None
    if why:
        raise ClusterAddressError(
            f"{source}={address}: a Ray cluster answers there but would refuse this process: {why}"
        )


def _connect(host: str, port: int, timeout_s: float) -> None:
    """A TCP connection to the first of `host`'s addresses that takes one, in its own family."""
    last: OSError | None = None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise OSError(err.errno, f"cannot resolve {host!r}: {err.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.settimeout(timeout_s)
                s.connect(sockaddr)
                return
        except OSError as err:
            last = err
    raise last or OSError(f"no address for {host!r}")


def _ask_gcs(target: str, timeout_s: float, metadata: tuple = ()) -> str | None:
    """The gRPC status name of one CheckAlive call to `target` ("OK" when it answers), or None when
    it cannot be asked (no grpc module, or TLS, which this plain-text probe cannot speak)."""
    try:
        import grpc
    except ImportError:
        return None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    # As Ray's own channels (RAY_grpc_enable_http_proxy, off by default): through an http_proxy
    # of the environment, a live GCS failed the probe and the cluster was refused.
    proxy = os.environ.get("RAY_grpc_enable_http_proxy", "0").lower() in ("1", "true")  # noqa: SIM112 - Ray's name
    channel = grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", int(proxy))])
    try:
        call = channel.unary_unary(_GCS_METHOD, request_serializer=bytes, response_deserializer=bytes)
        call(b"", timeout=timeout_s, metadata=metadata)
        return "OK"
    except grpc.RpcError as err:
        return err.code().name
    finally:
        channel.close()


def _not_gcs(code: str | None, timeout_s: float) -> str | None:
    """Why what answered `_ask_gcs` with `code` is not Ray's GCS, or None when it is (or when it
    cannot be told). A GCS of token auth refuses a call without the token: it is one."""
    if code in (None, "OK", "UNAUTHENTICATED"):
        return None
    if code == "UNIMPLEMENTED":
        return f"a gRPC server that is not Ray's GCS answers; {_NOT_GCS_HINT}"
    if code == "DEADLINE_EXCEEDED":
        return f"it accepts connections but gave no GCS answer within {timeout_s:g} s; {_NOT_GCS_HINT}"
    return f"it accepts connections but does not speak Ray's GCS protocol; {_NOT_GCS_HINT}"


def _token_refused(target: str, timeout_s: float) -> str | None:
    """Why the GCS at `target`, which asks for Ray's token, would refuse ray.init from this process,
    or None when it takes the token Ray would send (its own loader: RAY_AUTH_MODE=token, then
    RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token). Without this, ray.init raised an
    AuthenticationError (a traceback from every command) or gave up after ~20 s "failed to connect"."""
    try:  # Ray's own view (a private module, as Ray's gRPC clients use it), so never out of step
        from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
    except ImportError:
        return None
    if get_authentication_mode() != AuthenticationMode.TOKEN:
        return f"the cluster asks for Ray's token, and this process does not use token authentication: {_TOKEN_FIX}"
    loader = AuthenticationTokenLoader.instance()
    try:
        header = loader.get_token_for_http_header() if loader.has_token() else None
    except Exception:  # noqa: BLE001 - Ray raises its AuthenticationError where it finds no token
        header = None
    if not header:
        return f"the cluster asks for Ray's token, and this process has none: {_TOKEN_FIX}"
    if _ask_gcs(target, timeout_s, tuple(header.items())) == "UNAUTHENTICATED":
        return f"the cluster refused this process's token, which is not the cluster's: {_TOKEN_FIX}"
    return None
