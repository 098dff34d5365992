"""Broker URLs: defaults, lists of several brokers, redaction, the management API
address. Pure."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from rabbit_delay._errors import ConfigError
from rabbit_delay._tls import TLSOptions, split_tls

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
URL_ENV = "RABBIT_DELAY_URL"
MANAGEMENT_URL_ENV = "RABBIT_DELAY_MANAGEMENT_URL"
# Like urlsplit: the user ends at the first ':', the password at the LAST '@' of the
# authority, so an unencoded '@' in either is still covered.
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/\s]*):(?P<pw>[^/\s]*)@")


SCHEMES = ("amqp", "amqps")
# Several URLs in one string: separated by commas and/or whitespace (a comma inside a
# URL, e.g. in a password, is written %2C).
_SEPARATORS = re.compile(r"\s*,\s*|\s+")


def broker_urls(explicit: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The broker URLs to try, in order: `explicit` (one URL, several in one string
    separated by commas or whitespace, or a sequence of either), else $RABBIT_DELAY_URL
    (same syntax), else the local broker.

    Raises ConfigError for an empty entry (e.g. "a,,b" or a trailing comma), a scheme
    other than amqp:// or amqps://, or a port that is not a number (the password is
    never shown).
    """
    given: Sequence[str]
    if isinstance(explicit, str):
        given = [explicit] if explicit.strip() else []
    else:
        given = list(explicit or ())
    source = "the broker URL"
    if not given:
        env = os.environ.get(URL_ENV, "")
        if not env.strip():
            return (DEFAULT_URL,)
        given, source = [env], f"${URL_ENV}"
    urls: list[str] = []
    for entry in given:
        if not isinstance(entry, str):
            raise ConfigError(f"{source}: expected URL strings, got {type(entry).__name__}")
        pieces = _SEPARATORS.split(entry.strip())
        if any(not p for p in pieces):
            raise ConfigError(
                f"{source} {redact(entry)!r} has an empty entry: separate several URLs with "
                "single commas, e.g. amqp://h1:5672/,amqp://h2:5672/"
            )
        urls.extend(pieces)
    for url in urls:
        check_url(url, source)
    return tuple(urls)


def check_url(url: str, source: str = "the broker URL") -> None:
    """Raise ConfigError unless `url` is an amqp:// or amqps:// URL with a numeric port."""
    shown = redact(url)
    try:
        parts = urlsplit(url)
        _ = parts.port
    except ValueError as exc:
        raise ConfigError(f"{source}: {shown!r} is not a valid URL ({redact(str(exc))})") from None
    if parts.scheme.lower() not in SCHEMES or not url.lower().startswith(f"{parts.scheme}://"):
        raise ConfigError(
            # the example is not written as a URL with a password: redact() would hide it
            f"{source}: {shown!r} is not a broker URL: only amqp:// and amqps:// are "
            "accepted; write amqp://HOST:5672/VHOST with USER:PASSWORD@ before the host "
            "(amqps:// and port 5671 for TLS)"
        )


def broker_url(explicit: str | Sequence[str] | None = None) -> str:
    """The first of `broker_urls(explicit)`: where a single connection goes first."""
    return broker_urls(explicit)[0]


def redact(text: str) -> str:
    """Replace the password of every URL in `text` with ***; safe on any log line."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)


@dataclass(frozen=True, slots=True)
class ManagementEndpoint:
    base: str  # e.g. http://127.0.0.1:15672
    username: str
    password: str
    vhost: str
    # https: the CA / client certificate of the AMQP URL, or the management URL's own
    # query (rabbit_delay._tls); None for http.
    tls: TLSOptions | None = None
    # Named by the user (--management-url, $RABBIT_DELAY_MANAGEMENT_URL), not derived from
    # the AMQP URL: a refused login there is an error, not a wrong guess (management.checked).
    explicit: bool = False

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
        # https: the AMQP URL's CA and client certificate, unless its own query names others
        inherited = split_tls(amqp_url)[1] if m.scheme == "https" else None
        _, options = split_tls(base + (f"?{m.query}" if m.query else ""), inherited)
        return [ManagementEndpoint(base, user, password, vhost, options, explicit=True)]
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
    _, amqp_tls = split_tls(amqp_url)
    return [
        ManagementEndpoint(f"{scheme}://{host}:{p}", user, password, vhost, amqp_tls) for p in ports
    ]


def management_endpoint(amqp_url: str, explicit: str | None = None) -> ManagementEndpoint:
    """The first of `management_endpoints`: where the API is most likely to be."""
    return management_endpoints(amqp_url, explicit)[0]
