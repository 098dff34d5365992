"""Broker URLs: defaults, redaction, the management API address. Pure."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit, urlunsplit

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
URL_ENV = "RABBIT_DELAY_URL"
MANAGEMENT_URL_ENV = "RABBIT_DELAY_MANAGEMENT_URL"
# Like urlsplit: the user ends at the first ':', the password at the LAST '@' of the
# authority, so an unencoded '@' in either is still covered.
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/\s]*):(?P<pw>[^/\s]*)@")


def broker_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get(URL_ENV) or DEFAULT_URL


def redact(text: str) -> str:
    """Replace the password of every URL in `text` with ***; safe on any log line."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)


@dataclass(frozen=True, slots=True)
class ManagementEndpoint:
    base: str  # e.g. http://127.0.0.1:15672
    username: str
    password: str
    vhost: str

    def __repr__(self) -> str:  # never show the password, even in a traceback
        return (
            f"ManagementEndpoint(base={self.base!r}, username={self.username!r}, "
            f"vhost={self.vhost!r})"
        )

    def url(self, path: str) -> str:
        return f"{self.base}/api/{path}"

    @property
    def vhost_quoted(self) -> str:
        return quote(self.vhost, safe="")


def vhost_of(url: str) -> str:
    path = urlsplit(url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def management_endpoint(amqp_url: str, explicit: str | None = None) -> ManagementEndpoint:
    """Where the management HTTP API should be, with the AMQP URL's credentials.

    amqp -> http on 15672, amqps -> https on 15671, unless `explicit` (or
    RABBIT_DELAY_MANAGEMENT_URL) names another base URL.
    """
    parts = urlsplit(amqp_url)
    user = unquote(parts.username or "guest")
    password = unquote(parts.password or "guest")
    explicit = explicit or os.environ.get(MANAGEMENT_URL_ENV)
    if explicit:
        m = urlsplit(explicit)
        if m.username:
            user, password = unquote(m.username), unquote(m.password or "")
        netloc = m.hostname or "127.0.0.1"
        if m.port:
            netloc += f":{m.port}"
        base = urlunsplit((m.scheme or "http", netloc, m.path.rstrip("/"), "", ""))
    else:
        tls = parts.scheme == "amqps"
        host = parts.hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        base = f"{'https' if tls else 'http'}://{host}:{15671 if tls else 15672}"
    return ManagementEndpoint(base, user, password, vhost_of(amqp_url))
