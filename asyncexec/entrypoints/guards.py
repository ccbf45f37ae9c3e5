"""HTTP guards in front of the OpenAI routes, as ASGI middleware.

`HostGuard` refuses a Host header the server does not answer to (421), so that a web page that rebinds
its own DNS name to 127.0.0.1 cannot drive a local server. `APIKeyGuard` requires
`Authorization: Bearer <key>` on the API routes (`/v1/*`, `/tokenize`, `/detokenize`) and answers 401
in OpenAI's error shape otherwise; `/health`, `/metrics` and `/version` stay open. The key is compared
in constant time (`hmac.compare_digest`), so response timing does not leak how much of a guess was right.
"""

from __future__ import annotations

import hmac
import re

import msgspec
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncexec.entrypoints.protocol import error_body

__all__ = [
    "APIKeyGuard",
    "HostGuard",
    "loopback_hosts",
    "parse_allowed_hosts",
    "parse_allowed_origins",
]

# Routes that need the API key; the rest (health, metrics, version) are for probes and scrapers.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class APIKeyGuard:
    """ASGI middleware answering 401 to an API request without `Authorization: Bearer <api_key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if not (
                scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.expected)
            ):
                message = "Incorrect or missing API key: send `Authorization: Bearer <key>`"
                body = msgspec.json.encode(error_body(401, message, "invalid_request_error"))
                headers = {"WWW-Authenticate": "Bearer"}
                await Response(body, 401, headers, media_type="application/json")(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ----- the Host header ----------------------------------------------------------------------------------


def _host_name(host: str) -> str:
    """`host` without its port, lower-cased, IPv6 in brackets: `[::1]:8000` -> `[::1]`, `A.b.` -> `a.b`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    elif ":" in host:  # a bare IPv6 address, as given to --host or --allowed-hosts
        host = f"[{host}]"
    return host.rstrip(".")


def loopback_hosts(bound: str | None = None) -> list[str]:
    """The default `allowed_hosts`: the loopback names, and the address the server binds."""
    names = ["localhost", "127.0.0.1", "[::1]"]
    if bound and _host_name(bound) not in names:
        names.append(_host_name(bound))
    return names


def parse_allowed_hosts(value: str) -> list[str]:
    """`--allowed-hosts`: comma-separated host names or addresses (a port is ignored), or `*`."""
    hosts = [h.strip() for h in value.split(",") if h.strip()]
    if not hosts:
        raise ValueError("--allowed-hosts needs at least one host name, or *")
    for h in hosts:
        if "/" in h or " " in h:
            raise ValueError(f"--allowed-hosts takes host names such as example.com, not {h!r}")
    return hosts


def parse_allowed_origins(value: str) -> list[str]:
    """`--allowed-origins`: comma-separated origins such as `https://app.example.com:8443`, or `*`."""
    origins = [o.strip().rstrip("/") for o in value.split(",") if o.strip()]
    if not origins:
        raise ValueError("--allowed-origins needs at least one origin, or *")
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise ValueError(f"--allowed-origins takes origins such as https://example.com, not {o!r}")
    return origins


class HostGuard:
    """ASGI middleware answering 421 to a request whose Host names none of `allowed` (`*` allows all)."""

    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app = app
        self.allowed = frozenset(_host_name(h) for h in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            host = _host_name(Headers(scope=scope).get("host", ""))
            if host not in self.allowed:
                message = f"this server does not answer to the Host {host!r} (see --allowed-hosts)"
                body = msgspec.json.encode(error_body(421, message, "invalid_request_error"))
                await Response(body, 421, media_type="application/json")(scope, receive, send)
                return
        await self.app(scope, receive, send)
