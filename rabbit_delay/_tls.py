"""TLS for broker connections (amqps://) and the management API (https://). Pure: turns
options into an `ssl.SSLContext`; the transports hand it to their client.

Options come from the URL query (`amqps://user:pw@host:5671/vhost?cafile=/etc/ca.pem`)
or from `TLSOptions` given in code; the query wins per option. Recognised query keys:

    cafile       the CA bundle that signed the server's certificate (default: the
                 system's trust store; when given, ONLY this bundle is trusted)
    certfile     a client certificate (mutual TLS), with
    keyfile      its private key (default: in certfile; unencrypted)
    server_name  the name to verify the certificate against (default: the URL's host)

The server's certificate is ALWAYS verified (CERT_REQUIRED and host name checking):
there is no option to turn verification off, and a query that tries to (aiormq's
`no_verify_ssl`, pika's `ssl_options`) is refused with a ConfigError rather than
silently ignored. TLS options for a plain `amqp://` / `http://` URL are refused too:
they would be silently unused. See docs/security.md.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from rabbit_delay._errors import ConfigError

QUERY_KEYS = ("cafile", "certfile", "keyfile", "server_name")
# Query keys of the client libraries that would weaken or bypass our context.
REFUSED_KEYS = ("no_verify_ssl", "ssl_options", "verify", "capath", "cadata", "ssl")
TLS_SCHEMES = {"amqps": "amqp", "https": "http"}  # TLS scheme -> its plain twin


@dataclass(frozen=True, slots=True)
class TLSOptions:
    """Where the CA bundle, the client certificate and its key are (PEM files), and the
    name the server's certificate must carry. All optional: `TLSOptions()` trusts the
    system's CAs and checks the URL's host name."""

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
        """A client context that verifies the server (CERT_REQUIRED, host name checked).

        With `server_name`, every socket or BIO the context wraps is checked against that
        name, whatever host name the client passes (urllib and asyncio pass the URL's).
        Raises ConfigError naming a file that cannot be read or used.
        """
        if self.keyfile and not self.certfile:
            raise ConfigError(
                "keyfile= was given without certfile=: give both for a client certificate"
            )
        try:
            # With a cafile, only that bundle is trusted (not the system's store too).
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.cafile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"cannot read the CA file {self.cafile!r} ({exc}); give a PEM bundle of the "
                "CA that signed the broker's certificate (cafile=...)"
            ) from None
        context.check_hostname = True
        context.verify_mode = ssl.CERT_REQUIRED
        if self.certfile:
            try:
                # A passphrase callback that gives none: an encrypted key fails here
                # instead of OpenSSL prompting on the terminal of a worker process.
                context.load_cert_chain(self.certfile, self.keyfile, password=_no_passphrase)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"cannot load the client certificate {self.certfile!r} / key "
                    f"{self.keyfile!r} ({exc}); give PEM files (certfile=..., keyfile=...) "
                    "with an unencrypted key"
                ) from None
        if self.server_name:
            _pin_name(context, self.server_name)
        return context


def _no_passphrase() -> str:
    return ""


def _pin_name(context: ssl.SSLContext, name: str) -> None:
    """Make `context` verify (and send as SNI) `name` for every connection it wraps."""
    wrap_socket, wrap_bio = context.wrap_socket, context.wrap_bio

    def pinned_socket(*args: Any, **kwargs: Any) -> ssl.SSLSocket:
        kwargs["server_hostname"] = name
        return wrap_socket(*args, **kwargs)

    def pinned_bio(*args: Any, **kwargs: Any) -> ssl.SSLObject:
        kwargs["server_hostname"] = name
        return wrap_bio(*args, **kwargs)

    context.wrap_socket = pinned_socket  # type: ignore[method-assign]
    context.wrap_bio = pinned_bio  # type: ignore[method-assign]


def split_tls(url: str, options: TLSOptions | None = None) -> tuple[str, TLSOptions | None]:
    """(the URL without our TLS query keys, the TLS options to use or None for plain AMQP).

    For an `amqps://` (or `https://`) URL the options are `options` with the URL's
    query keys replacing theirs; for `amqp://` / `http://`, None.

    Raises ConfigError for a query key that would turn verification off, and for TLS
    options (in the query or `options`) with a plain URL: they would be silently unused.
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    refused = [k for k, _ in query if k in REFUSED_KEYS]
    if refused:
        raise ConfigError(
            f"URL option {refused[0]!r} is not supported: rabbit-delay always verifies the "
            "broker's certificate; give cafile=PATH for a private CA (docs/security.md)"
        )
    ours = {k: v for k, v in query if k in QUERY_KEYS}
    rest = [(k, v) for k, v in query if k not in QUERY_KEYS]
    clean = urlunsplit(parts._replace(query=urlencode(rest)))
    scheme = parts.scheme.lower()
    from_query = TLSOptions(**ours) if ours else None
    if scheme not in TLS_SCHEMES:
        # TLSOptions() with nothing set asks for nothing: the scheme decides TLS.
        given = list(ours) or ([] if options in (None, TLSOptions()) else ["TLSOptions"])
        if given:
            secure = next((s for s, plain in TLS_SCHEMES.items() if plain == scheme), "amqps")
            port = "5671" if secure == "amqps" else "15671"
            raise ConfigError(
                f"TLS options ({', '.join(given)}) for a {scheme}:// URL would be unused: use "
                f"{secure}:// (port {port} by default) for TLS"
            )
        return clean, None
    return clean, (options or TLSOptions()).merged(from_query)


# -- telling a user why a TLS handshake failed (both transports, the management API) --


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, what it wraps (args, `.exception`, `.exceptions`), its cause and context."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        wrapped = [*current.args, getattr(current, "exception", None)]
        wrapped.append(getattr(current, "reason", None))  # urllib's URLError
        members = getattr(current, "exceptions", ())
        if isinstance(members, tuple | list):
            wrapped.extend(members)
        todo.extend(w for w in wrapped if isinstance(w, BaseException))
        todo.extend(c for c in (current.__cause__, current.__context__) if c is not None)


def describe_tls_error(exc: BaseException) -> str | None:
    """One sentence saying why a TLS handshake failed and what to fix, or None when
    `exc` (or anything it wraps) is no TLS error. For connection errors of pika, aiormq
    and urllib alike (each wraps the ssl error its own way; pika sometimes only as text)."""
    chain = list(exception_chain(exc))
    for e in chain:
        if isinstance(e, ssl.SSLCertVerificationError):
            detail = getattr(e, "verify_message", None) or getattr(e, "reason", None) or str(e)
            return _verification_failed(str(detail))
        if isinstance(e, ssl.SSLError):
            return _handshake_failed(str(getattr(e, "reason", None) or e))
    for e in chain:  # an ssl error kept as text only (pika's StreamLostError)
        found = _SSL_TEXT.search(str(e))
        if found is None:
            continue
        if found["detail"]:
            return _verification_failed(found["detail"].strip())
        return _handshake_failed(found["reason"])
    return None


# "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: <detail> (_ssl.c:1006)"
_SSL_TEXT = re.compile(
    r"\[SSL: (?P<reason>[A-Z0-9_]+)\](?: certificate verify failed: (?P<detail>[^(\]\)'\"]+))?"
)


def _verification_failed(detail: str) -> str:
    return (
        f"the server's certificate failed verification ({detail}): it must be signed "
        "by the CA given with cafile= (without cafile=, one the system trusts) and "
        "issued for the host name of the URL (or the one given with server_name=); "
        "rabbit-delay never connects without verifying it"
    )


def _handshake_failed(reason: str) -> str:
    code = reason.upper()
    if "WRONG_VERSION_NUMBER" in code or "UNKNOWN_PROTOCOL" in code:
        return (
            f"the server did not answer in TLS ({reason}): is the port a TLS listener "
            "(5671 for amqps://, 15671 for https://)?"
        )
    if "CERTIFICATE_REQUIRED" in code or "BAD_CERTIFICATE" in code:
        return (
            f"the server refused the TLS handshake ({reason}): it requires a client "
            "certificate it trusts; give certfile= and keyfile="
        )
    if "UNKNOWN_CA" in code or "CERTIFICATE_UNKNOWN" in code:
        return (
            f"the server refused our client certificate ({reason}): it is not signed by a "
            "CA the server trusts (ssl_options.cacertfile on the broker)"
        )
    return f"the TLS handshake failed ({reason})"
