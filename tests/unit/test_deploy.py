"""The deployment files (deploy/, docs/deploy.md) say what they promise.

There is no Docker engine or Kubernetes here, and PyYAML is not a dependency: the
manifest is read with the small block-YAML reader below (mappings, sequences, plain and
quoted scalars: what deploy/k8s/worker.yaml uses), the Dockerfile and the systemd unit
line by line. `systemd-analyze verify` checks the unit where systemd is installed (the
structural checks run everywhere). The app the images run is imported and its
consumers checked against the shipped topology. docs/deploy.md shows the files
verbatim: a test keeps them equal.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rabbit_delay import App
from rabbit_delay._durations import parse_ms

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFEST = DEPLOY / "k8s" / "worker.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
UNIT = DEPLOY / "systemd" / "rabbit-delay-worker.service"
DOC = REPO / "docs" / "deploy.md"


# -- a reader for the block YAML the manifest is written in ---------------------------


def _scalar(text: str) -> Any:
    if text[:1] in "\"'":
        assert text[-1] == text[0], f"unterminated string: {text}"
        return text[1:-1]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"true": True, "false": False, "null": None}.get(text, text)


def _block(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[Any, int]:
    if lines[i][1].startswith("- "):
        items: list[Any] = []
        while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
            rest = lines[i][1][2:]
            if ":" not in rest or rest[:1] in "\"'":
                items.append(_scalar(rest))
                i += 1
                continue
            lines[i] = (indent + 2, rest)  # the item's first key, then its other keys
            item, i = _block(lines, i, indent + 2)
            items.append(item)
        return items, i
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent and not lines[i][1].startswith("- "):
        key, _, rest = lines[i][1].partition(":")
        assert key not in mapping, f"duplicate key {key!r}"
        rest = rest.strip()
        i += 1
        if rest:
            mapping[key] = _scalar(rest)
        elif i < len(lines) and lines[i][0] > indent:
            mapping[key], i = _block(lines, i, lines[i][0])
        else:
            mapping[key] = None
    return mapping, i


def read_yaml(text: str) -> list[Any]:
    """Every document of a block-YAML stream (`---` separated)."""
    documents: list[Any] = []
    for chunk in re.split(r"^---$", text, flags=re.MULTILINE):
        lines = [
            (len(raw) - len(raw.lstrip(" ")), raw.strip())
            for raw in chunk.splitlines()
            if raw.strip() and not raw.strip().startswith("#")
        ]
        if lines:
            value, end = _block(lines, 0, lines[0][0])
            assert end == len(lines), f"unparsed from line {lines[end]}"
            documents.append(value)
    return documents


def test_the_reader_reads_what_it_claims() -> None:
    text = 'a: 1\nb:\n  - name: x\n    port: 9\n  - "y"\nc:\n  d: "true"\n  e: true\n---\nf: g\n'
    assert read_yaml(text) == [
        {"a": 1, "b": [{"name": "x", "port": 9}, "y"], "c": {"d": "true", "e": True}},
        {"f": "g"},
    ]


# -- what every deployment shares -------------------------------------------------------


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_app_the_images_run_consumes_every_queue_of_its_topology(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RABBIT_DELAY_TOPOLOGY", str(REPO / "topology" / "orders.toml"))
    sys.path.insert(0, str(DEPLOY / "app"))
    try:
        import myapp  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(DEPLOY / "app"))
    app: App = myapp.app
    assert isinstance(app, App)
    consumed = {c.queue for c in app.select(None)}
    assert consumed == set(app.topology.queues)


# -- Kubernetes ----------------------------------------------------------------------------


def test_the_deployment_probes_and_grace_period() -> None:
    secret, deployment = read_yaml(MANIFEST.read_text(encoding="utf-8"))
    assert (secret["kind"], deployment["kind"]) == ("Secret", "Deployment")
    assert "RABBIT_DELAY_URL" in secret["stringData"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = container["args"]
    assert args[0] == "myapp:app"
    port = int(option(args, "--metrics-port"))
    [named] = container["ports"]
    assert named["containerPort"] == port
    probes = {kind: container[kind]["httpGet"] for kind in ("livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert {p["port"] for p in probes.values()} == {named["name"]}
    shutdown_s = parse_ms(option(args, "--shutdown-timeout")) / 1000
    assert pod["terminationGracePeriodSeconds"] > shutdown_s
    # the URL, password included, comes from the Secret, never from the manifest's args
    assert container["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    assert not any("amqp" in str(a) for a in args)
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert pod["securityContext"]["runAsNonRoot"] is True


# -- Docker --------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    rows = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            instruction, _, rest = line.strip().partition(" ")
            rows.append((instruction.upper(), rest.strip()))
    return rows


def test_the_dockerfile_builds_a_non_root_worker_with_a_healthcheck() -> None:
    rows = dockerfile()
    assert rows[0] == ("FROM", "python:3.12-slim")
    get = {instruction: rest for instruction, rest in rows}  # the last of each
    assert get["USER"] not in ("root", "0")
    assert any(i == "RUN" and "pip install ." in rest for i, rest in rows)
    assert shlex.split(get["ENTRYPOINT"].replace(",", " ").strip("[]")) == [
        "rabbit-delay",
        "worker",
    ]
    cmd = [a.strip(' "') for a in get["CMD"].strip("[]").split(",")]
    port = option(cmd, "--metrics-port")
    assert get["EXPOSE"] == port
    assert f"http://127.0.0.1:{port}/healthz" in get["HEALTHCHECK"]
    assert get["STOPSIGNAL"] == "SIGTERM"
    for instruction, rest in rows:  # everything copied exists in the repository
        if instruction == "COPY":
            *sources, _target = rest.split()
            for source in sources:
                assert (REPO / source).exists(), source


# -- systemd -------------------------------------------------------------------------------


def unit() -> dict[str, str]:
    keys: dict[str, str] = {}
    for line in UNIT.read_text(encoding="utf-8").splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            keys[key.strip()] = value.strip()
    return keys


def test_the_systemd_unit_stops_gracefully_and_restarts_on_failure() -> None:
    keys = unit()
    assert keys["Restart"] == "on-failure"
    assert keys["KillSignal"] == "SIGTERM"
    assert keys["EnvironmentFile"].startswith("/etc/")
    args = shlex.split(keys["ExecStart"])
    assert args[1:3] == ["worker", "myapp:app"]
    assert not any("amqp" in a for a in args)  # the URL is in the EnvironmentFile
    shutdown_ms = parse_ms(option(args, "--shutdown-timeout"))
    assert parse_ms(keys["TimeoutStopSec"]) > shutdown_ms
    assert keys["User"] != "root"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    """The unit as shipped, with its paths pointed at this machine (verify checks that
    the binary exists and the user is known)."""
    script = Path(sys.executable).with_name("rabbit-delay")
    text = UNIT.read_text(encoding="utf-8")
    text = text.replace("/srv/myapp/.venv/bin/rabbit-delay", str(script))
    text = text.replace("/srv/myapp", str(tmp_path))
    text = re.sub(r"^(User|Group)=.*$", r"\1=root", text, flags=re.MULTILINE)
    text = text.replace("EnvironmentFile=/etc/", "EnvironmentFile=-/etc/")
    copy = tmp_path / UNIT.name
    copy.write_text(text, encoding="utf-8")
    done = subprocess.run(
        ["systemd-analyze", "verify", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert UNIT.name not in done.stderr, done.stderr  # no warning about this unit


# -- the page shows the files as they are ---------------------------------------------------


@pytest.mark.parametrize("path", [DOCKERFILE, MANIFEST, UNIT], ids=lambda p: p.name)
def test_docs_deploy_shows_each_file_verbatim(path: Path) -> None:
    page = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- fragment -->\n```[a-z]*\n(.*?)```", page, flags=re.DOTALL)
    assert path.read_text(encoding="utf-8") in blocks, f"docs/deploy.md: {path.name} differs"
