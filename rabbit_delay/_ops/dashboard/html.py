"""The dashboard's pages: server-rendered HTML with inline SVG, no I/O.

Every value that reaches a page goes through `e()` (html.escape). Nothing here loads
anything from elsewhere: the one stylesheet and the one script are the package's own
(/static/...), and the SVG is inline (no xmlns needed in HTML). Elements that the
script refreshes carry `data-q` (a queue name) and `data-f` (which figure).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from urllib.parse import quote

from rabbit_delay._durations import format_ms, iso_ms
from rabbit_delay._names import Names
from rabbit_delay._ops.dashboard.rules import (
    NODE_H,
    NODE_W,
    TIMELINE_BUCKET_MS,
    TIMELINE_SPAN_MS,
    TOKEN_FIELD,
    Cached,
    Histogram,
    Node,
    Picture,
    Timeline,
    picture,
    timeline_labels,
)
from rabbit_delay._ops.parked.rules import ParkedPage
from rabbit_delay._ops.scheduled.rules import detail, unknown_key
from rabbit_delay._ops.status.rules import BUFFER_ROLES, Status, oldest_cell
from rabbit_delay._schedule.messages import MAX_KEY
from rabbit_delay._schedule.records import ScheduleRecord
from rabbit_delay._urls import redact

STATIC = "/static"


def e(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def q(value: str) -> str:
    """A queue name in a URL path."""
    return quote(value, safe="")


def _n(value: int | None) -> str:
    return "?" if value is None else str(value)


def layout(title: str, body: str, *, token: str | None, refresh_s: float, page: str) -> str:
    token_meta = f'<meta name="rd-token" content="{e(token)}">' if token is not None else ""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="rd-refresh" content="{refresh_s:g}">
<meta name="rd-page" content="{e(page)}">
{token_meta}
<title>{e(title)}</title>
<link rel="stylesheet" href="{STATIC}/dashboard.css">
<script src="{STATIC}/dashboard.js" defer></script>
</head>
<body>
<header><a class="home" href="/">rabbit-delay</a> <span class="title">{e(title)}</span></header>
<main>
{body}
</main>
</body>
</html>
"""


# -- the overview --------------------------------------------------------------------------


def _depth(node: Node) -> str:
    if node.role == "plugin":
        return f"{_n(node.ready)} delayed"
    parts = [f"ready {_n(node.ready)}"]
    if node.unacked:
        parts.append(f"unacked {node.unacked}")
    parts.append(f"consumers {_n(node.consumers)}")
    return " · ".join(parts)


def svg_picture(pic: Picture) -> str:
    """The topology as a picture: one box per queue with its live depth and consumers,
    a red mark where something needs attention."""
    by_key = {n.key: n for n in pic.nodes}
    out = [
        f'<svg class="topology" viewBox="0 0 {pic.width} {pic.height}" width="{pic.width}" '
        f'height="{pic.height}" role="img" aria-label="topology">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
        'class="arrowhead"/></marker></defs>',
    ]
    for a, b in pic.edges:
        src, dst = by_key[a], by_key[b]
        x1, y1 = src.x + NODE_W, src.y + NODE_H // 2
        x2, y2 = dst.x, dst.y + NODE_H // 2
        if src.column == dst.column:  # the catch-all, under the due exchange
            x1, y1, x2, y2 = src.x + NODE_W // 2, src.y + NODE_H, dst.x + NODE_W // 2, dst.y
        mid = (x1 + x2) / 2
        out.append(
            f'<path class="edge" d="M {x1} {y1} C {mid} {y1}, {mid} {y2}, {x2} {y2}" '
            'marker-end="url(#arrow)"/>'
        )
    for n in pic.nodes:
        classes = f"node role-{n.role.replace(' ', '-')}" + (" attention" if n.attention else "")
        data = f' data-q="{e(n.key)}"' if n.key not in ("publish", "due") else ""
        tip = "; ".join(n.notes)
        box = [
            f'<g class="{classes}"{data} transform="translate({n.x},{n.y})">',
            f"<title>{e(n.key)}{e(': ' + tip) if tip else ''}</title>",
            f'<rect width="{NODE_W}" height="{NODE_H}" rx="6"/>',
            f'<text class="label" x="8" y="17">{e(n.label)}</text>',
        ]
        if n.key not in ("publish", "due"):
            box.append(f'<text class="depth" x="8" y="35" data-f="depth">{e(_depth(n))}</text>')
            box.append(
                f'<text class="mark" x="{NODE_W - 16}" y="18" data-f="mark">'
                f"{'!' if n.attention else ''}</text>"
            )
        box.append("</g>")
        if n.queue is not None:
            box = [f'<a href="/parked/{e(q(n.queue))}">', *box, "</a>"]
        out += box
    out.append("</svg>")
    return "\n".join(out)


def _bound(b: float) -> str:
    return "+Inf" if math.isinf(b) else f"{b:g}"


def svg_histogram(h: Histogram, index: int) -> str:
    """Bars per bucket (not cumulative), the tallest at full height."""
    bar, gap, height, base = 26, 4, 90, 110
    width = len(h.counts) * (bar + gap) + 10
    top = max(h.counts, default=0) or 1
    out = [
        f'<svg class="histogram" viewBox="0 0 {width} 140" width="{width}" height="140" '
        f'data-h="{index}" role="img" aria-label="lateness {e(h.queue)} {e(h.tier)}">'
    ]
    for i, (b, c) in enumerate(zip(h.bounds, h.counts, strict=True)):
        tall = round(height * c / top)
        x = 5 + i * (bar + gap)
        out.append(
            f'<rect class="bar" x="{x}" y="{base - tall}" width="{bar}" height="{tall}" '
            f'data-b="{i}"><title>≤ {_bound(b)} s: {c}</title></rect>'
        )
        out.append(
            f'<text class="count" x="{x + bar / 2}" y="{base - tall - 3}" data-c="{i}">'
            f"{c if c else ''}</text>"
        )
        out.append(f'<text class="le" x="{x + bar / 2}" y="{base + 14}">{_bound(b)}</text>')
    out.append(f'<text class="axis" x="5" y="{base + 30}">seconds late (bucket upper bound)</text>')
    out.append("</svg>")
    return "".join(out)


def _histogram_caption(h: Histogram) -> str:
    p50, p99 = h.quantile(0.5), h.quantile(0.99)
    if not h.total:
        return "no delivery yet"
    mean = h.sum_s / h.total
    return (
        f"{h.total} deliveries, mean {mean:.3f} s, p50 ≤ {_bound(p50 or 0)} s, "
        f"p99 ≤ {_bound(p99 or 0)} s"
    )


def lateness_section(histograms: Sequence[Histogram], errors: Sequence[str], given: bool) -> str:
    parts = ['<section id="lateness"><h2>Lateness (handled time minus due time)</h2>']
    if not given:
        parts.append(
            '<p class="muted">no worker metrics given: start the dashboard with '
            "<code>--metrics http://WORKER:9464/metrics</code> (a worker's "
            "<code>--metrics-port</code>)</p>"
        )
    for err in errors:
        parts.append(f'<p class="error">{e(err)}</p>')
    if given and not histograms and not errors:
        parts.append('<p class="muted">the workers have recorded no delivery yet</p>')
    keys = ",".join(f"{h.queue}|{h.tier}" for h in histograms)
    parts.append(f'<div class="histograms" data-keys="{e(keys)}">')
    for i, h in enumerate(histograms):
        parts.append(
            f'<figure class="series"><figcaption><b>{e(h.queue)}</b> via <b>{e(h.tier)}</b>: '
            f'<span data-hc="{i}">{e(_histogram_caption(h))}</span></figcaption>'
            f"{svg_histogram(h, i)}</figure>"
        )
    parts.append("</div></section>")
    return "\n".join(parts)


def _age_line(state: Cached[Status], age: float | None, refresh_s: float) -> str:
    when = iso_ms(state.read_at_ms) if state.read_at_ms is not None else "never"
    shown = f"{age:.1f}" if age is not None else "?"
    return (
        f'<p class="age">read from the broker at <span data-f="read-at">{e(when)}</span> '
        f'(<span data-f="age">{e(shown)}</span> s ago, took '
        f'<span data-f="took">{state.took_s * 1000:.0f}</span> ms; at most once every '
        f"{refresh_s:g} s, for every page and client)</p>"
    )


def overview(
    state: Cached[Status],
    age: float | None,
    names: Names,
    histograms: Sequence[Histogram],
    metric_errors: Sequence[str],
    *,
    metrics_given: bool,
    refresh_s: float,
    actions: bool,
) -> str:
    status = state.value
    parts = [_age_line(state, age, refresh_s)]
    parts.append(
        f'<p class="error" data-f="error"{"" if state.error else " hidden"}>'
        f"{e(redact(state.error or ''))}</p>"
    )
    if status is None:
        parts.append("<p>no status read yet</p>")
        return "\n".join(parts)
    version = status.broker_description or (
        f"RabbitMQ {status.broker_version}" if status.broker_version else "version unknown"
    )
    parts.append(
        '<section id="broker"><h2>Broker</h2><dl>'
        f"<dt>connection</dt><dd>{e(redact(status.broker))}</dd>"
        f'<dt>broker</dt><dd data-f="broker">{e(version)}</dd>'
        f"<dt>namespace</dt><dd>{e(status.namespace)}</dd>"
        f"<dt>management API</dt><dd>{e(redact(status.management_api))}</dd>"
        f"<dt>actions</dt><dd>{'on' if actions else 'off (read-only)'}</dd>"
        "</dl>"
        + "".join(f'<p class="muted">{e(redact(note))}</p>' for note in status.notes)
        + "</section>"
    )
    items = status.attention_items()
    parts.append('<section id="attention"><h2>Needs attention</h2><ul data-f="attention">')
    for item in items:
        parts.append(f"<li><b>{e(item.subject)}</b>: {e(redact(item.hint))}</li>")
    parts.append("</ul>")
    parts.append(
        f'<p class="ok" data-f="all-ok"{" hidden" if items else ""}>nothing needs attention</p>'
    )
    parts.append("</section>")
    parts.append(
        f'<section id="picture"><h2>Topology</h2>{svg_picture(picture(status, names))}</section>'
    )
    # Per tier: messages waiting and the age of the oldest.
    parts.append(
        '<section id="tiers"><h2>Tiers</h2><table><thead><tr><th>buffer</th><th>ttl</th>'
        "<th>waiting</th><th>oldest</th><th>notes</th></tr></thead><tbody>"
    )
    for row in status.rows:
        if row.role not in BUFFER_ROLES:
            continue
        cls = ' class="attention"' if row.attention else ""
        parts.append(
            f'<tr data-q="{e(row.name)}"{cls}><td>{e(row.name)}</td>'
            f"<td>{e(format_ms(row.ttl_ms) if row.ttl_ms is not None else '')}</td>"
            f'<td data-f="ready">{e(_n(row.ready))}</td>'
            f'<td data-f="oldest">{e(oldest_cell(row))}</td>'
            f'<td data-f="notes">{e("; ".join(row.notes))}</td></tr>'
        )
    parts.append("</tbody></table></section>")
    parts.append(
        '<section id="queues"><h2>Queues</h2><table><thead><tr><th>role</th><th>queue</th>'
        "<th>ready</th><th>unacked</th><th>consumers</th><th>notes</th></tr></thead><tbody>"
    )
    for row in status.rows:
        cls = ' class="attention"' if row.attention else ""
        name = e(row.name)
        kind, detail = names.parse(row.name)
        if kind in ("q", "parking"):
            name = f'<a href="/parked/{e(q(detail))}">{name}</a>'
        parts.append(
            f'<tr data-q="{e(row.name)}"{cls}><td>{e(row.role.value)}</td><td>{name}</td>'
            f'<td data-f="ready">{e(_n(row.ready))}</td>'
            f'<td data-f="unacked">{e(_n(row.unacked))}</td>'
            f'<td data-f="consumers">{e(_n(row.consumers))}</td>'
            f'<td data-f="notes">{e("; ".join(row.notes))}</td></tr>'
        )
    parts.append("</tbody></table></section>")
    parts.append(lateness_section(histograms, metric_errors, metrics_given))
    return "\n".join(parts)


# -- a parking lot -------------------------------------------------------------------------


def _token_field(token: str | None) -> str:
    return f'<input type="hidden" name="{TOKEN_FIELD}" value="{e(token)}">' if token else ""


def _tier_select(tiers: Sequence[str]) -> str:
    options = '<option value="">now (due exchange)</option>' + "".join(
        f'<option value="{e(t)}">through tier {e(t)}</option>' for t in tiers
    )
    return f'<select name="tier" aria-label="when">{options}</select>'


def parked(
    p: ParkedPage,
    read_at_ms: int | None,
    *,
    tiers: Sequence[str],
    actions: bool,
    token: str | None,
) -> str:
    when = iso_ms(read_at_ms) if read_at_ms is not None else "?"
    parts = [
        f'<p class="age">{e(p.parking_queue)}: {p.total} message(s), peeked at {e(when)} '
        "(nothing moved, order kept; read again at most once per refresh interval)</p>",
        '<p class="result" id="result" hidden></p>',
    ]
    if actions:
        parts.append(
            f'<form class="action" method="post" action="/api/replay" data-action="replay">'
            f"{_token_field(token)}"
            f'<input type="hidden" name="queue" value="{e(p.queue)}">'
            f"{_tier_select(tiers)} "
            f'<button type="submit" id="replay-all">replay all {p.total}</button></form>'
        )
        parts.append(
            f'<form class="action" method="post" action="/api/purge" data-action="purge" '
            f'data-queue="{e(p.queue)}" data-total="{p.total}">{_token_field(token)}'
            f'<input type="hidden" name="queue" value="{e(p.queue)}">'
            f'<input type="hidden" name="confirm" value="">'
            f'<button type="submit" id="purge" class="danger">purge…</button></form>'
        )
    else:
        parts.append(
            '<p class="muted">read-only: start with <code>--allow-actions</code> to replay '
            "or purge</p>"
        )
    parts.append(
        '<table id="parked"><thead><tr><th>#</th><th>message id</th><th>reason</th>'
        "<th>error</th><th>attempts</th><th>first failure</th><th>last failure</th><th></th>"
        "</tr></thead><tbody>"
    )
    for item in p.items:
        error = ": ".join(x for x in (item.error_type, item.error_message) if x is not None)
        mid = item.message_id or ""
        act = ""
        if actions and item.message_id is not None:
            act = (
                f'<form class="action inline" method="post" action="/api/replay" '
                f'data-action="replay">{_token_field(token)}'
                f'<input type="hidden" name="queue" value="{e(p.queue)}">'
                f'<input type="hidden" name="message_id" value="{e(mid)}">'
                f"{_tier_select(tiers)} "
                f'<button type="submit" class="replay-one" data-id="{e(mid)}">replay</button>'
                "</form>"
            )
        parts.append(
            f'<tr data-id="{e(mid)}"><td>{item.position}</td><td><code>{e(mid)}</code></td>'
            f"<td>{e(item.reason)}</td><td>{e(error[:300])}</td><td>{e(item.attempts)}</td>"
            f"<td>{e(item.first_failure)}</td><td>{e(item.last_failure or item.parked_at)}</td>"
            f'<td><button type="button" class="show" data-id="{e(mid)}" '
            f'data-queue="{e(p.queue)}">details</button> {act}</td></tr>'
            f'<tr class="detail" data-detail="{e(mid)}" hidden><td colspan="8"></td></tr>'
        )
    parts.append("</tbody></table>")
    nav = []
    if p.offset > 0:
        back = max(p.offset - p.limit, 0)
        nav.append(f'<a href="?offset={back}&amp;limit={p.limit}" id="prev">« previous</a>')
    if p.items:
        nav.append(f"messages {p.items[0].position}-{p.items[-1].position} of {p.total}")
    elif p.total:
        nav.append(f"no message at position {p.offset}")
    if p.next_offset is not None:
        nav.append(f'<a href="?offset={p.next_offset}&amp;limit={p.limit}" id="next">next »</a>')
    parts.append(f'<p class="pages">{" · ".join(nav)}</p>')
    return "\n".join(parts)


# -- the schedule -----------------------------------------------------------------------

# A timeline's bars: width, gap, the tallest bar's height and the baseline (as the
# script draws them again: static/dashboard.js, applySchedule).
T_BAR, T_GAP, T_HEIGHT, T_BASE = 14, 2, 90, 110


def svg_timeline(t: Timeline, index: int) -> str:
    """A bar per bucket of what comes due, the tallest at full height; a label every
    hour from now."""
    width = len(t.counts) * (T_BAR + T_GAP) + 10
    top = max(t.counts, default=0) or 1
    labels = timeline_labels(len(t.counts), t.bucket_ms)
    edges = t.edges()
    out = [
        f'<svg class="timeline" viewBox="0 0 {width} 140" width="{width}" height="140" '
        f'data-t="{index}" role="img" aria-label="schedule of {e(t.queue)}">'
    ]
    for i, n in enumerate(t.counts):
        tall = round(T_HEIGHT * n / top)
        x = 5 + i * (T_BAR + T_GAP)
        span = f"{iso_ms(edges[i])} to {iso_ms(edges[i + 1])}"
        out.append(
            f'<rect class="bar" x="{x}" y="{T_BASE - tall}" width="{T_BAR}" height="{tall}" '
            f'data-b="{i}"><title data-w="{i}">{e(span)}: {n}</title></rect>'
        )
        out.append(
            f'<text class="count" x="{x + T_BAR / 2}" y="{T_BASE - tall - 3}" data-c="{i}">'
            f"{n if n else ''}</text>"
        )
        if labels[i]:
            out.append(
                f'<text class="le" x="{x + T_BAR / 2}" y="{T_BASE + 14}">{e(labels[i])}</text>'
            )
    out.append(
        f'<text class="axis" x="5" y="{T_BASE + 27}">coming due, per '
        f"{e(format_ms(t.bucket_ms))} from now</text>"
    )
    out.append("</svg>")
    return "".join(out)


def _search_form(key: str | None) -> str:
    value = f' value="{e(key)}"' if key else ""
    return (
        '<form class="search" id="schedule-search" method="get" action="/schedule">'
        f'<input type="search" name="key" required maxlength="{MAX_KEY}" '
        f'placeholder="a schedule key, e.g. order-42" aria-label="schedule key"{value}> '
        '<button type="submit">find</button></form>'
    )


def schedule_section(state: Cached[tuple[Timeline, ...]], *, refresh_s: float) -> str:
    """The overview's schedule: a key search box and, per queue, what comes due over the
    next hours (a topology with [schedule] only)."""
    when = iso_ms(state.read_at_ms) if state.read_at_ms is not None else "never"
    parts = [
        '<section id="schedule"><h2>Schedule</h2>',
        f'<p class="age">scheduled messages coming due in the next '
        f"{e(format_ms(TIMELINE_SPAN_MS))}, per {e(format_ms(TIMELINE_BUCKET_MS))} and queue, "
        f'from the schedule\'s store; read at <span data-f="schedule-read-at">{e(when)}</span> '
        f"(at most once every {refresh_s:g} s)</p>",
        f'<p class="error" data-f="schedule-error"{"" if state.error else " hidden"}>'
        f"{e(redact(state.error or ''))}</p>",
        _search_form(None),
    ]
    found = state.value or ()
    queues = ",".join(t.queue for t in found)
    parts.append(f'<div class="timelines" data-queues="{e(queues)}">')
    for i, t in enumerate(found):
        parts.append(
            f'<figure class="series" data-tq="{e(t.queue)}"><figcaption><b>{e(t.queue)}</b>: '
            f'<span data-tc="{i}">{e(t.caption())}</span></figcaption>{svg_timeline(t, i)}</figure>'
        )
    parts.append("</div></section>")
    return "\n".join(parts)


def schedule_key_page(key: str | None, record: ScheduleRecord | None, *, now_ms: int) -> str:
    """A schedule key's record in full (`scheduled show`'s lines), or that it is unknown;
    the search box above it."""
    parts = ['<section id="schedule-key"><h2>Schedule key</h2>', _search_form(key)]
    if key is not None and record is None:
        parts.append(f'<p class="error" id="schedule-missing">{e(unknown_key(key))}</p>')
    elif record is not None:
        parts.append(f'<dl id="schedule-record"><dt>key</dt><dd><code>{e(record.key)}</code></dd>')
        for label, value in detail(record, now_ms):
            parts.append(f'<dt>{e(label)}</dt><dd data-f="{e(label)}">{e(redact(value))}</dd>')
        parts.append("</dl>")
    parts.append('<p><a href="/">back to the overview</a></p></section>')
    return "\n".join(parts)


def error_page(message: str) -> str:
    return f'<p class="error">{e(redact(message))}</p><p><a href="/">back</a></p>'


__all__ = [
    "e",
    "error_page",
    "layout",
    "overview",
    "parked",
    "schedule_key_page",
    "schedule_section",
    "svg_histogram",
    "svg_picture",
    "svg_timeline",
]
