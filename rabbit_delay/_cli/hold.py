"""`rabbit-delay hold`: run a holder of the [held] backend (docs/held.md): an AMQP 1.0
consumer of the holding queue that has the queue hold each message until its due time,
then dead-letter it to its business queue. Needs the `held` extra (python-qpid-proton)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import rabbit_delay._cli.options as opt
from rabbit_delay._errors import ConfigError
from rabbit_delay._stop_signals import install_stop_signals
from rabbit_delay._topology.model import Topology

if TYPE_CHECKING:
    from rabbit_delay._amqp10.holder import Holder

log = logging.getLogger("rabbit_delay.hold")


def hold(
    file: opt.TopologyArg = None,
    topology_file: opt.TopologyOpt = None,
    url: opt.UrlOpt = None,
    log_level: opt.LogLevelOpt = opt.LogLevel.INFO,
    as_json: opt.JsonOpt = False,
) -> None:
    """Hold the messages of the topology's holding queue (its held table) until their due
    time (RabbitMQ 4.3+). Run several, anywhere, for availability: the queue hands each
    message to one. Stops on SIGINT / SIGTERM; with --json, prints what it did then."""
    opt.configure_logging(log_level)
    with opt.errors_to_exit():
        holder = holder_for(opt.resolve_topology(file, topology_file), opt.url_for(url))
        restore = install_stop_signals(lambda name: holder.stop(wait_s=0))
        try:
            holder.run()
        finally:
            restore()
            s = holder.stats
            if as_json:
                opt.print_json(
                    {
                        "held": s.held,
                        "released": s.released,
                        "released_without_due_time": s.released_without_due_time,
                        "max_late_ms": s.max_late_ms,
                        "connects": s.connects,
                    }
                )
            log.info(
                "holder stopped: %d hold(s), %d release(s) (%d without a due time), "
                "at most %d ms late, %d connection(s)",
                s.held,
                s.released,
                s.released_without_due_time,
                s.max_late_ms,
                s.connects,
            )


def holder_for(topology: Topology, urls: Sequence[str]) -> Holder:
    """A holder of `topology`'s holding queue (`hold`, `worker --hold`). Raises
    ConfigError without a [held] table or without the `held` extra."""
    if topology.held is None:
        raise ConfigError(
            f"topology {topology.names.prefix!r} has no [held] table: there is nothing to "
            "hold (docs/held.md)"
        )
    try:
        from rabbit_delay._amqp10.holder import Holder
    except ImportError:
        raise ConfigError(
            "holding speaks AMQP 1.0 through python-qpid-proton: pip install 'rabbit-delay[held]'"
        ) from None
    return Holder(topology, urls)
