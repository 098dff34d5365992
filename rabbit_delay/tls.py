"""TLS for broker connections (amqps://) and the management API (https://). Pure: turns
options into an `ssl.SSLContext`; the transports hand it to their client.

Options come from the URL query (`amqps://user:pw@host:5671/vhost?cafile=/etc/ca.pem`)
or from `TLSOptions` given in code; the query wins per option. Recognised query keys:

    cafile     the CA bundle that signed the server's certificate (default: the
               system's trust store)
    certfile   a client certificate (mutual TLS), with
    keyfile    its private key (default: in certfile)
    server_name  the name to verify the certificate against (default: the URL's host)

The server's certificate is ALWAYS verified (CERT_REQUIRED and host name checking):
there is no option to turn verification off, and a query that tries to (aiormq's
`no_verify_ssl`, pika's `ssl_options`) is refused with a ConfigError rather than
silently ignored.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from rabbit_delay.errors import ConfigError

QUERY_KEYS = ("cafile", "certfile", "keyfile", "server_name")
# Query keys of the client libraries that would weaken or bypass our context.
REFUSED_KEYS = ("no_verify_ssl", "ssl_options", "verify", "capath", "cadata", "ssl")


@dataclass(frozen=True, slots=True)
class TLSOptions:
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    server_name: str | None = None

    def merged(self, other: TLSOptions | None) -> TLSOptions:
        """These options, each one `other` sets replacing ours."""
        if other is None:
            return self
        return TLSOptions(
            cafile=other.cafile or self.cafile,
            certfile=other.certfile or self.certfile,
            keyfile=other.keyfile or self.keyfile,
            server_name=other.server_name or self.server_name,
        )

    def context(self) -> ssl.SSLContext:
        """A client context that verifies the server. Raises ConfigError naming a file
        that cannot be read."""
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.cafile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"cannot read the CA file {self.cafile!r} ({exc}); give a PEM bundle of the "
                "CA that signed the broker's certificate (cafile=...)"
            ) from None
        context.check_hostname = True
        context.verify_mode = ssl.CERT_REQUIRED
        if self.keyfile and not self.certfile:
            raise ConfigError(
                "keyfile= was given without certfile=: give both for a client certificate"
            )
        if self.certfile:
            try:
                context.load_cert_chain(self.certfile, self.keyfile)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"cannot load the client certificate {self.certfile!r} / key "
                    f"{self.keyfile!r} ({exc}); give PEM files (certfile=..., keyfile=...)"
                ) from None
        return context


def split_tls(url: str, options: TLSOptions | None = None) -> tuple[str, TLSOptions | None]:
    """(the URL without our TLS query keys, the TLS options to use or None for plain AMQP).

    Raises ConfigError for a query key that would turn verification off, and for TLS
    options on a plain `amqp://` URL (they would be silently unused).
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    refused = [k for k, _ in query if k in REFUSED_KEYS]
    if refused:
        raise ConfigError(
            f"URL option {refused[0]!r} is not supported: rabbit-delay always verifies the "
            "broker's certificate; give cafile=PATH for a private CA"
        )
    ours = {k: v for k, v in query if k in QUERY_KEYS}
    rest = [(k, v) for k, v in query if k not in QUERY_KEYS]
    clean = urlunsplit(parts._replace(query=urlencode(rest)))
    tls = parts.scheme in ("amqps", "https")
    from_query = TLSOptions(**ours) if ours else None
    if not tls:
        if from_query is not None:
            raise ConfigError(
                f"TLS options ({', '.join(ours)}) on a {parts.scheme}:// URL; use amqps:// "
                "(port 5671 by default) for TLS"
            )
        return clean, None
    return clean, (options or TLSOptions()).merged(from_query)
