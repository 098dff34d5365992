"""`rabbit-delay dashboard`: a local web UI on the core that `status`, `parked` and
`replay` use (docs/dashboard.md).

The pure decisions are in `rabbit_delay.ops.dashboard`, the broker calls in
`rabbit_delay.sync.dashboard`; this package is the HTTP layer (`_app`), the pages
(`_html`) and the script and stylesheet it serves (`static/`, package data).
"""

from rabbit_delay.dashboard._app import CSP, Backend, Dashboard, serve

__all__ = ["CSP", "Backend", "Dashboard", "serve"]
