"""A throwaway PKI for the TLS tests, made with the `openssl` command line.

Two CAs: `ca` signs the broker's certificate (127.0.0.1 and localhost), a certificate
for another host name, and a client certificate; `other_ca` signs a certificate for the
right host, which a client trusting only `ca` must refuse. Keys are EC (P-256): quick to
make. Valid for two days; everything lives in one directory.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_NAMES = ("DNS:localhost", "IP:127.0.0.1")


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(
        ["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def _key(path: Path) -> None:
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path.name,
        cwd=path.parent,
    )  # fmt: skip


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    _key(key)
    _openssl(
        "req", "-x509", "-new", "-key", key.name, "-days", "2", "-subj", f"/CN=rabbit-delay {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-addext", "subjectKeyIdentifier=hash",
        "-out", cert.name,
        cwd=directory,
    )  # fmt: skip
    return cert, key


def _leaf(
    directory: Path, name: str, ca: tuple[Path, Path], *, sans: tuple[str, ...], usage: str
) -> tuple[Path, Path]:
    key, cert, csr = directory / f"{name}.key", directory / f"{name}.pem", directory / f"{name}.csr"
    _key(key)
    _openssl(
        "req", "-new", "-key", key.name, "-subj", f"/CN={name}", "-out", csr.name, cwd=directory
    )
    ext = directory / f"{name}.ext"
    lines = [
        "basicConstraints=CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
        "subjectKeyIdentifier=hash",
        "authorityKeyIdentifier=keyid",
    ]
    if sans:
        lines.append("subjectAltName=" + ",".join(sans))
    ext.write_text("\n".join(lines) + "\n")
    _openssl(
        "x509", "-req", "-in", csr.name, "-CA", ca[0].name, "-CAkey", ca[1].name,
        "-set_serial", str(secrets.randbelow(2**63) + 1), "-days", "2",
        "-extfile", ext.name, "-out", cert.name,
        cwd=directory,
    )  # fmt: skip
    return cert, key


@dataclass(frozen=True)
class Pki:
    directory: Path
    ca: Path  # the CA that signed `server` and `client`
    other_ca: Path  # a CA that signed nothing the broker presents
    server: Path  # for localhost / 127.0.0.1, signed by `ca`
    server_key: Path
    wrong_host: Path  # signed by `ca`, for another host name
    wrong_host_key: Path
    other_ca_server: Path  # for localhost / 127.0.0.1, signed by `other_ca`
    other_ca_server_key: Path
    client: Path  # client certificate (mutual TLS), signed by `ca`
    client_key: Path
    client_key_encrypted: Path  # the same key under a passphrase
    foreign_client: Path  # a client certificate signed by `other_ca`
    foreign_client_key: Path

    def copy_to(self, directory: Path) -> Pki:
        """The same files in `directory` (e.g. inside a broker's root)."""
        directory.mkdir(parents=True, exist_ok=True)
        moved: dict[str, Path] = {}
        for field, path in vars(self).items():
            if field == "directory":
                continue
            shutil.copy(path, directory / path.name)
            (directory / path.name).chmod(0o644)  # test keys, read by the node's own uid
            moved[field] = directory / path.name
        return Pki(directory=directory, **moved)

    def relocated(self, root: str) -> Pki:
        """The paths as seen from inside a chroot at `root` ("" for none)."""
        if not root:
            return self
        strip = len(root.rstrip("/"))
        return Pki(**{k: Path(str(v)[strip:]) for k, v in vars(self).items()})


def make_pki(directory: Path) -> Pki:
    """Every certificate the TLS tests use, made in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "ca")
    other = _ca(directory, "other-ca")
    server = _leaf(directory, "server", ca, sans=SERVER_NAMES, usage="serverAuth")
    wrong = _leaf(directory, "wrong-host", ca, sans=("DNS:wrong.example",), usage="serverAuth")
    foreign = _leaf(directory, "foreign-server", other, sans=SERVER_NAMES, usage="serverAuth")
    client = _leaf(directory, "rd-client", ca, sans=(), usage="clientAuth")
    foreign_client = _leaf(directory, "foreign-client", other, sans=(), usage="clientAuth")
    encrypted = directory / "rd-client-encrypted.key"
    _openssl(
        "pkey", "-in", client[1].name, "-aes256", "-passout", "pass:secret", "-out", encrypted.name,
        cwd=directory,
    )  # fmt: skip
    return Pki(
        directory=directory,
        ca=ca[0],
        other_ca=other[0],
        server=server[0],
        server_key=server[1],
        wrong_host=wrong[0],
        wrong_host_key=wrong[1],
        other_ca_server=foreign[0],
        other_ca_server_key=foreign[1],
        client=client[0],
        client_key=client[1],
        client_key_encrypted=encrypted,
        foreign_client=foreign_client[0],
        foreign_client_key=foreign_client[1],
    )
