"""`rabbit-delay asyncapi [FILE]`: the AsyncAPI 3.0 document of a topology, as JSON on
stdout or in a file (the rules: rabbit_delay._ops.asyncapi.rules). Connects to nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

import rabbit_delay._cli.options as opt
from rabbit_delay._urls import URL_ENV

OutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        help="Write the document to this file instead of stdout.",
        show_default=False,
        metavar="PATH",
    ),
]


def asyncapi_command(
    file: opt.TopologyArg = None,
    topology_file: opt.TopologyOpt = None,
    output: OutputOpt = None,
    url: opt.UrlOpt = None,
    as_json: opt.JsonOpt = False,
) -> None:
    """Print the AsyncAPI 3.0 document (JSON) of the topology: a channel per tier
    exchange (and shard), cascade entry exchange, plugin exchange and business queue, with
    AMQP 0-9-1 bindings and the arguments `declare` gives them, the rd-* headers as a
    schema, and publish and consume operations. The broker URLs (--url or
    $RABBIT_DELAY_URL, if given) become its servers, without credentials. Connects to
    nothing."""
    from rabbit_delay._ops.asyncapi.rules import document

    with opt.errors_to_exit():
        topology = opt.resolve_topology(file, topology_file)
        urls = opt.url_for(url) if url or os.environ.get(URL_ENV, "").strip() else ()
        doc = document(topology, urls)
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    if output is None:
        opt.out.file.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        opt.fail(f"cannot write {output}: {exc.strerror or exc}")
    summary = {
        "output": str(output),
        "channels": len(doc["channels"]),
        "operations": len(doc["operations"]),
    }
    if as_json:
        opt.print_json(summary)
        return
    opt.out.print(
        f"wrote {output}: AsyncAPI {doc['asyncapi']}, {summary['channels']} channels, "
        f"{summary['operations']} operations",
        markup=False,
    )


__all__ = ["asyncapi_command"]
