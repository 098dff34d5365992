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


def management_endpoints(amqp_url: str, explicit: str | None = None) -> list[ManagementEndpoint]:
    """Where the management HTTP API may be, in the order to try, with the AMQP URL's
    credentials (an explicit URL's own credentials win).

    `explicit` (or RABBIT_DELAY_MANAGEMENT_URL) alone when given. Otherwise, on an AMQP
    port other than the standard one, first that port + 10000 (Docker mappings such as
    5673 -> 15673 follow it), then the standard 15672 (amqps: 15671). Only one that
    proves to serve the same broker may be used (`management.checked`).
    """
    parts = urlsplit(amqp_url)
    user = unquote(parts.username or "guest")
    password = unquote(parts.password or "guest")
    vhost = vhost_of(amqp_url)
    explicit = explicit or os.environ.get(MANAGEMENT_URL_ENV)
    if explicit:
        m = urlsplit(explicit)
        if m.username:
            user, password = unquote(m.username), unquote(m.password or "")
        netloc = m.hostname or "127.0.0.1"
        if m.port:
            netloc += f":{m.port}"
        base = urlunsplit((m.scheme or "http", netloc, m.path.rstrip("/"), "", ""))
        return [ManagementEndpoint(base, user, password, vhost)]
    tls = parts.scheme == "amqps"
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if tls else "http"
    standard_amqp, standard_http = (5671, 15671) if tls else (5672, 15672)
    ports = [standard_http]
    try:
        amqp_port = parts.port or standard_amqp
    except ValueError:  # not a number: the AMQP connection will say so
        amqp_port = standard_amqp
    if amqp_port != standard_amqp and amqp_port + 10000 <= 65535:
        ports.insert(0, amqp_port + 10000)
    return [ManagementEndpoint(f"{scheme}://{host}:{p}", user, password, vhost) for p in ports]


def management_endpoint(amqp_url: str, explicit: str | None = None) -> ManagementEndpoint:
    """The first of `management_endpoints`: where the API is most likely to be."""
    return management_endpoints(amqp_url, explicit)[0]
