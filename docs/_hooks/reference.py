"""The docs site's generated pages, made at build time from the code (mkdocs.yml `hooks`).

A page asks for a generated part with a marker on a line of its own:

    <!-- generated: cli -->

and `on_page_markdown` replaces it with what the code says now: the CLI reference (the
typer app), the topology file (the pydantic models), the error tree (`rabbit_delay._errors`),
the headers (`rabbit_delay._headers`) and the changelog (CHANGELOG.md). Nothing generated
is committed, so nothing can drift; an unknown marker, a topology field without a
description or a link to a repository file that does not exist is a warning, which
`mkdocs build --strict` turns into a failure.

The generators are plain functions of the code (tests/unit/test_docs_reference.py calls
them): no MkDocs import is needed to use them.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import logging
import re
import types
import typing
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKER = re.compile(r"^<!-- generated: (?P<name>[a-z-]+) -->$", re.MULTILINE)
log = logging.getLogger("mkdocs.hooks.reference")


# -- the CLI --------------------------------------------------------------------------------


def cli_reference() -> str:
    """Every command of `rabbit-delay` (groups recursively), its help, usage, arguments
    and options, as `rabbit-delay COMMAND --help` shows them (hidden options excepted)."""
    import typer.main

    from rabbit_delay._cli.app import app

    root = typer.main.get_command(app)
    root_ctx = root.context_class(root, info_name="rabbit-delay")
    out: list[str] = []
    out += _command_section(root, root_ctx, "rabbit-delay", level=2)
    for path, command, ctx in _walk_commands(root, root_ctx, "rabbit-delay"):
        out += _command_section(command, ctx, path, level=1 + path.count(" "))
    return "\n".join(out).rstrip() + "\n"


def _walk_commands(group: Any, ctx: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or getattr(command, "hidden", False):
            continue
        sub_ctx = type(ctx)(command, info_name=name, parent=ctx)
        yield f"{path} {name}", command, sub_ctx
        if hasattr(command, "list_commands"):
            yield from _walk_commands(command, sub_ctx, f"{path} {name}")


def _command_section(command: Any, ctx: Any, path: str, level: int) -> list[str]:
    lines = [f"{'#' * min(level, 4)} `{path}`", ""]
    help_text = inspect.cleandoc(command.help or "")
    if help_text:
        lines += [_escape_md(help_text), ""]
    usage = command.get_usage(ctx).strip()
    lines += ["```text", usage, "```", ""]
    if hasattr(command, "list_commands"):
        subs = [n for n in command.list_commands(ctx) if not command.get_command(ctx, n).hidden]
        if subs:
            lines += ["Commands: " + ", ".join(f"`{path} {n}`" for n in subs) + ".", ""]
    params = [p for p in command.params if not getattr(p, "hidden", False)]
    arguments = [p for p in params if p.param_type_name == "argument"]
    options = [p for p in params if p.param_type_name != "argument"]
    if path == "rabbit-delay" or not hasattr(command, "list_commands"):
        options = [*options, _HELP]
    for title, group in (("Arguments", arguments), ("Options", options)):
        if not group:
            continue
        lines += [f"**{title}**", ""]
        for param in group:
            if param is _HELP:
                lines.append("- `--help`: Show this message and exit.")
                continue
            record = param.get_help_record(ctx)
            name, text = record if record else (param.name, "")
            lines.append(f"- `{name}`: {_escape_md(text)}" if text else f"- `{name}`")
        lines.append("")
    return lines


_HELP = object()


def _escape_md(text: str) -> str:
    """Help text as Markdown text: the angle brackets of a metavar are not HTML, and a
    paragraph break stays one."""
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("*", r"\*")


# -- the topology file ----------------------------------------------------------------------


def topology_reference() -> str:
    """Every table and key of a topology file, from the pydantic models of
    `rabbit_delay._topology.model`: its TOML type, default, limits and description."""
    from rabbit_delay._topology import model

    out: list[str] = []
    for table, cls, note in _tables(model.Topology, "", model):
        heading = f"`[{table}]`" if table else "Top level"
        out += [f"## {heading}", ""]
        doc = _class_doc(cls)
        if doc:
            out += [doc, ""]
        if note:
            out += [note, ""]
        rows = list(_field_rows(cls, model))
        if not rows:
            out += ["This table takes no keys: its presence is the setting.", ""]
            continue
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        out += [f"| `{k}` | {t} | {d} | {desc} |" for k, t, d, desc in rows]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def missing_topology_descriptions() -> list[str]:
    """Fields of the topology models without a description (a Field description, an
    attribute docstring, or a comment on or right above the field's line)."""
    from rabbit_delay._topology import model

    missing = []
    for table, cls, _ in _tables(model.Topology, "", model):
        notes = _field_notes(cls)
        for name, info in cls.model_fields.items():
            if not (info.description or notes.get(name)):
                missing.append(f"{table or '(top level)'}.{name}")
    return missing


def _tables(cls: Any, prefix: str, model: Any) -> Iterator[tuple[str, Any, str]]:
    """(TOML table, model, note) depth first: the model's own table, then those of its
    fields that are models (or a mapping of names to models)."""
    yield prefix, cls, ""
    for name, info in cls.model_fields.items():
        inner, mapping = _model_of(info.annotation)
        if inner is None:
            continue
        key = f"{prefix}.{name}" if prefix else name
        if mapping:
            yield from _tables(inner, f'{key}."NAME"', model)
        else:
            yield from _tables(inner, key, model)


def _model_of(annotation: Any) -> tuple[Any, bool]:
    from pydantic import BaseModel

    tp = _strip(annotation)
    mapping = False
    if typing.get_origin(tp) is dict:
        tp = _strip(typing.get_args(tp)[1])
        mapping = True
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp, mapping
    return None, False


def _strip(tp: Any) -> Any:
    """`X` of `Annotated[X, ...]` and of `X | None`."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _class_doc(cls: Any) -> str:
    doc = inspect.getdoc(cls) or ""
    return _prose(doc)


def _prose(text: str) -> str:
    """A docstring or comment as Markdown prose: paragraphs kept, lines joined."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    return "\n\n".join(paragraphs)


def _field_rows(cls: Any, model: Any) -> Iterator[tuple[str, str, str, str]]:
    notes = _field_notes(cls)
    for name, info in cls.model_fields.items():
        description = info.description or notes.get(name, "")
        yield (
            name,
            _type_of(info, model),
            _default_of(info, model),
            _cell(description) or "",
        )


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", r"\|")


def _field_notes(cls: Any) -> dict[str, str]:
    """Descriptions written beside the fields of `cls` in its source: an attribute
    docstring under the field, else a comment at the end of its line or on the lines
    right above it."""
    from rabbit_delay._topology import model

    # Not inspect.getfile(cls): a public model says it is `rabbit_delay.Topology`.
    source = Path(model.__file__).read_text(encoding="utf-8")
    lines = source.splitlines()
    classes = [
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__
    ]
    body = classes[0].body if classes else []
    notes: dict[str, str] = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        following = body[i + 1] if i + 1 < len(body) else None
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            notes[name] = _prose(following.value.value)
            continue
        line = lines[node.lineno - 1]
        comment = _comment_of(line)
        above: list[str] = []
        j = node.lineno - 2
        while j >= 0 and lines[j].strip().startswith("#"):
            above.insert(0, lines[j].strip().lstrip("#").strip())
            j -= 1
        text = " ".join([*above, comment] if comment else above)
        if text:
            notes[name] = text
    return notes


def _note(lines: list[str], lineno: int) -> str:
    """The comment at the end of line `lineno` (1-based), else the comment lines right
    above it."""
    comment = _comment_of(lines[lineno - 1])
    if comment:
        return comment
    above: list[str] = []
    j = lineno - 2
    while j >= 0 and lines[j].strip().startswith("#"):
        above.insert(0, lines[j].strip().lstrip("#").strip())
        j -= 1
    return " ".join(above)


def _comment_of(line: str) -> str:
    """The comment at the end of a line of code (not a `#` inside a string)."""
    in_string: str | None = None
    for i, ch in enumerate(line):
        if in_string:
            if ch == in_string and line[i - 1] != "\\":
                in_string = None
        elif ch in "\"'":
            in_string = ch
        elif ch == "#":
            return line[i + 1 :].strip()
    return ""


def _type_of(info: Any, model: Any) -> str:
    return _describe_type(info.annotation, list(info.metadata), model)


def _describe_type(tp: Any, metadata: list[Any], model: Any) -> str:
    from pydantic import BaseModel, BeforeValidator

    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        inner, *meta = typing.get_args(tp)
        return _describe_type(inner, [*meta, *metadata], model)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _describe_type(args[0], metadata, model)
    validators = [m.func for m in metadata if isinstance(m, BeforeValidator)]
    limits = _limits(metadata)
    if any(v in (model._tier_ms, model._any_ms) for v in validators):
        base = 'duration (`"500ms"`, `"90s"`, `"5m"`, `"2h"`, `"1d"`, `"1h30m"`)'
        if model._tier_ms in validators:
            base += ", at most 49d17h2m47s295ms (RabbitMQ's TTL limit)"
        return base + limits
    if origin is dict:
        key_t, value_t = typing.get_args(tp)
        inner, _ = _model_of(value_t)
        value = (
            "a table (below)"
            if inner is not None
            else _describe_type(value_t, [], model).replace("|", r"\|")
        )
        key = _describe_type(key_t, [], model)
        return f"table of {key} = {value}" + limits
    if origin is tuple:
        (item, *_rest) = typing.get_args(tp)
        return f"array of {_describe_type(item, [], model)}" + limits
    if origin is typing.Literal:
        return " or ".join(f'`"{a}"`' for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, Enum):
        return " or ".join(f'`"{m.value}"`' for m in tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "table (below)"
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names.get(tp, getattr(tp, "__name__", str(tp))) + limits


def _limits(metadata: list[Any]) -> str:
    parts = []
    flat = []
    for m in metadata:
        flat += [m, *getattr(m, "metadata", [])]
    for m in flat:
        for attr, word in (
            ("gt", ">"),
            ("ge", "≥"),
            ("lt", "<"),
            ("le", "≤"),
            ("min_length", "length ≥"),
            ("max_length", "length ≤"),
        ):
            value = getattr(m, attr, None)
            if value is not None and type(m).__name__ not in ("FieldInfo",):
                parts.append(f"{word} {value}")
        pattern = getattr(m, "pattern", None)
        if pattern is not None:
            parts.append(f"matches `{pattern}`")
    return f" ({', '.join(parts)})" if parts else ""


def _default_of(info: Any, model: Any) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if value is None:
        return "not set"
    if isinstance(value, BaseModel):
        return "(below)"
    if isinstance(value, Enum):
        return f'`"{value.value}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    metadata = list(info.metadata)
    validators = [getattr(m, "func", None) for m in metadata]
    if isinstance(value, int) and any(v in (model._tier_ms, model._any_ms) for v in validators):
        return f'`"{model.format_ms(value)}"`'
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, dict | tuple | list) and not value:
        return "empty"
    return f"`{value}`"


# -- the error tree -------------------------------------------------------------------------


def errors_reference() -> str:
    """The tree of `RabbitDelayError` from `rabbit_delay._errors`, each class under the
    name a user imports it by, with the builtin it also is and its docstring."""
    import rabbit_delay
    from rabbit_delay import _errors

    exported = set(rabbit_delay.__all__)
    out = ["```text"]
    out += _tree_lines(_errors.RabbitDelayError, "", True, root=True)
    out += ["```", ""]
    for cls in _subclasses(_errors.RabbitDelayError):
        public = cls.__name__ in exported
        name = f"rabbit_delay.{cls.__name__}" if public else f"{cls.__name__} (not exported)"
        bases = ", ".join(
            f"`{b.__name__}`"
            for b in cls.__bases__
            if b is not object and b.__name__ != "Exception"
        )
        out += [f"## `{name}`", ""]
        if bases:
            out += [f"Is a: {bases}.", ""]
        doc = inspect.getdoc(cls)
        if doc and (cls is _errors.RabbitDelayError or doc != inspect.getdoc(cls.__base__)):
            out += [_prose(doc), ""]
    return "\n".join(out).rstrip() + "\n"


def _subclasses(cls: type) -> list[type]:
    found = [cls]
    for sub in cls.__subclasses__():
        if sub.__module__ == cls.__module__:
            for s in _subclasses(sub):
                if s not in found:
                    found.append(s)
    return found


def _tree_lines(cls: type, indent: str, last: bool, root: bool = False) -> list[str]:
    builtins = [
        b.__name__ for b in cls.__bases__ if b.__module__ == "builtins" and b is not Exception
    ]
    label = cls.__name__ + (f" ({', '.join(builtins)})" if builtins else "")
    if root:
        line, child_indent = label, ""
    else:
        line = indent + ("└── " if last else "├── ") + label
        child_indent = indent + ("    " if last else "│   ")
    subs = [
        s for s in cls.__subclasses__() if s.__module__ == cls.__module__ and s.__bases__[0] is cls
    ]
    lines = [line]
    for i, sub in enumerate(subs):
        lines += _tree_lines(sub, child_indent, i == len(subs) - 1)
    return lines


# -- the headers ----------------------------------------------------------------------------


def header_constants() -> list[tuple[str, str, str]]:
    """(constant, header, comment) of every header named in `rabbit_delay._headers`, in
    the module's order; the comment is the one on the constant's line or right above."""
    from rabbit_delay import _headers

    source = inspect.getsource(_headers)
    lines = source.splitlines()
    body = ast.parse(source).body
    docs = {
        node.targets[0].id: _prose(following.value.value)
        for node, following in itertools.pairwise(body)
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(following, ast.Expr)
        and isinstance(following.value, ast.Constant)
        and isinstance(following.value.value, str)
    }
    found = []
    for node in body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if not (isinstance(target, ast.Name) and isinstance(node.value, ast.Constant)):
            continue
        value = node.value.value
        if not isinstance(value, str):
            continue
        found.append((target.id, value, docs.get(target.id) or _note(lines, node.lineno)))
    return found


def headers_reference() -> str:
    out = [
        "| header | constant | what it carries |",
        "|---|---|---|",
    ]
    for constant, header, comment in header_constants():
        out.append(f"| `{header}` | `{constant}` | {_cell(comment)} |")
    from rabbit_delay import _headers

    out += [
        "",
        "Broker-owned headers, stripped from every copy the worker or an operation "
        "re-publishes (a header that starts with one of these): "
        + ", ".join(f"`{p}`" for p in _headers.BROKER_HEADER_PREFIXES)
        + ".",
    ]
    return "\n".join(out) + "\n"


# -- the changelog --------------------------------------------------------------------------


def changelog() -> str:
    """CHANGELOG.md (the source, at the repository's root) without its title."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.sub(r"\A# [^\n]*\n+", "", text)


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "topology": topology_reference,
    "errors": errors_reference,
    "headers": headers_reference,
    "changelog": changelog,
}


def expand(markdown: str, where: str) -> str:
    """`markdown` with each marker replaced by what its generator makes now."""

    def replace(m: re.Match[str]) -> str:
        generator = GENERATORS.get(m["name"])
        if generator is None:
            log.warning(
                "%s: unknown generated part %r (known: %s)", where, m["name"], ", ".join(GENERATORS)
            )
            return m[0]
        return generator()

    return MARKER.sub(replace, markdown)


# -- links to the repository ----------------------------------------------------------------

LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def repository_links(markdown: str, page_path: Path, repo_url: str) -> tuple[str, list[str]]:
    """Relative links from a docs page to files of the repository outside docs/ (an
    example, the deploy folder) made links to the repository, and the ones whose file
    does not exist. Links into docs/ are left to MkDocs, which checks them."""
    missing: list[str] = []
    pieces = []
    last = 0
    for fence in FENCE.finditer(markdown):
        pieces.append((markdown[last : fence.start()], True))
        pieces.append((fence[0], False))
        last = fence.end()
    pieces.append((markdown[last:], True))

    def rewrite(m: re.Match[str]) -> str:
        target = m["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return m[0]
        resolved = (page_path.parent / target).resolve()
        if resolved.is_relative_to(DOCS):
            return m[0]
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            missing.append(target)
            return m[0]
        kind = "tree" if resolved.is_dir() else "blob"
        rel = resolved.relative_to(ROOT).as_posix()
        return f"]({repo_url.rstrip('/')}/{kind}/main/{rel}{m['anchor'] or ''})"

    out = "".join(LINK.sub(rewrite, text) if prose else text for text, prose in pieces)
    return out, missing


# -- MkDocs hooks ---------------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    where = page.file.src_uri
    markdown = expand(markdown, where)
    markdown, missing = repository_links(markdown, Path(page.file.abs_src_path), config.repo_url)
    for target in missing:
        log.warning("%s: link to %r, which is not a file of the repository", where, target)
    if where == "reference/topology.md":
        for field in missing_topology_descriptions():
            log.warning(
                "topology field %s has no description: write one beside it in "
                "rabbit_delay/_topology/model.py (a docstring under it, or a comment)",
                field,
            )
    return markdown
