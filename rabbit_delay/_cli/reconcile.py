"""reconcile: run an App's reconcilers once, now (for cron, or by hand)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

import rabbit_delay._cli.options as opt
from rabbit_delay._consumer.app import App
from rabbit_delay._consumer.worker import worker_identity
from rabbit_delay._reconcile import Reconciler, ReconcileResult

NameOpt = Annotated[
    list[str] | None,
    typer.Option("--name", "-n", help="Run only this reconciler (repeatable); default: all."),
]


def reconcile(
    target: opt.TargetArg,
    name: NameOpt = None,
    app_dir: opt.AppDirOpt = Path("."),
    log_level: opt.LogLevelOpt = opt.LogLevel.WARNING,
    json_out: opt.JsonOpt = False,
    url: opt.UrlOpt = None,
) -> None:
    """Run the reconcilers of MODULE:APP once, now: each finds what should have fired and
    did not, and re-submits it (the guard runs each handler once).

    A reconciler already running elsewhere (a worker, another `reconcile`) is skipped.
    The run counts for the workers' schedule: they skip it for its `every`. Exit 0 when
    each one ran or was running elsewhere, 1 when one failed (its function raised, a
    re-submission was refused or not confirmed, the store failed).
    """
    opt.configure_logging(log_level)
    with opt.errors_to_exit():
        the_app = opt.load_app(target, app_dir)
        chosen = the_app.select_reconcilers(name)
        if not chosen:
            opt.fail('the app has no reconcilers: register one with @app.reconcile(every="10m")')
        urls = opt.url_for(url)
        if any(r.is_async for r in chosen):
            results = asyncio.run(_run_async(the_app, chosen, urls))
        else:
            results = _run_sync(the_app, chosen, urls)
    if json_out:
        opt.print_json({"reconcilers": [r.as_dict() for r in results]})
    else:
        for result in results:
            opt.out.print(describe(result), markup=False)
    raise typer.Exit(opt.EXIT_ERROR if any(r.failed for r in results) else opt.EXIT_OK)


def describe(result: ReconcileResult) -> str:
    """One line (and the refused items under it) for a run."""
    if not result.ran:
        head = f"{result.name}: not run: {result.skipped}"
    else:
        ids = ", ".join(result.resubmitted[:10])
        more = f" (+{len(result.resubmitted) - 10} more)" if len(result.resubmitted) > 10 else ""
        head = (
            f"{result.name}: ran in {result.seconds:.2f}s, "
            f"{len(result.resubmitted)} message(s) re-submitted" + (f": {ids}{more}" if ids else "")
        )
        if result.error is not None:
            head += f"; failed: {result.error}"
    return "\n".join([head, *(f"  refused: {why}" for why in result.refused)])


def _run_sync(
    the_app: App, chosen: list[Reconciler], urls: tuple[str, ...]
) -> list[ReconcileResult]:
    from rabbit_delay._sync.publisher import Publisher
    from rabbit_delay._sync.reconcile import run_reconciler

    topology, identity = the_app.topology, worker_identity()

    def connect() -> Publisher:
        return Publisher.connect(topology, urls)

    try:
        return [
            run_reconciler(the_app, r, f"{identity}:reconcile:{i}", connect, scheduled=False)
            for i, r in enumerate(chosen, 1)
        ]
    finally:
        the_app.close()


async def _run_async(
    the_app: App, chosen: list[Reconciler], urls: tuple[str, ...]
) -> list[ReconcileResult]:
    from rabbit_delay._aio.publisher import AsyncPublisher
    from rabbit_delay._aio.reconcile import arun_reconciler

    topology, identity = the_app.topology, worker_identity()

    async def connect() -> AsyncPublisher:
        return await AsyncPublisher.connect(topology, urls)

    try:
        return [
            await arun_reconciler(the_app, r, f"{identity}:reconcile:{i}", connect, scheduled=False)
            for i, r in enumerate(chosen, 1)
        ]
    finally:
        await the_app.aclose()


__all__ = ["describe", "reconcile"]
