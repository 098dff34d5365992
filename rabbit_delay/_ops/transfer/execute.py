"""`rabbit-delay transfer` on pika: read the pending messages of a source topology,
publish each copy into the target (confirmed), only then ack the originals.

What each copy is, and what stays, is decided in the core (`rabbit_delay._ops.transfer.rules`);
this module reads, publishes and settles, a batch at a time:

- A batch is one consumer (a "window"): a channel of its own with a prefetch of the
  batch size, consuming the source queue from its head (oldest first: soonest due)
  until the window is full or the queue runs dry. A full window gets nothing more from
  the broker, so cancelling it then leaves no delivery in flight (pika rejects what
  arrives after a cancel, and a reject counts towards a quorum queue's delivery limit).
- The batch's copies go through `Publisher.publish_outgoing`: confirms pipelined, a
  lost target connection recovered and the unconfirmed copies re-sent. The originals
  of the confirmed copies are then acked, with one multiple ack when all moved (one
  settle command for a quorum queue), and the channel is closed.
- A message that stays (a `Leave`) and, in a dry run, every message stays unacked on
  its window's channel until its queue is done, so the next window gets the next
  messages; then one multiple nack with requeue per channel gives them back (on 4.3
  it does not count towards the delivery limit).
- Anything not confirmed is never acked: a failure stops the run, and what was unacked
  goes back to its queue (nacked, or with the channel). A crash leaves copies that were
  confirmed but whose originals were not acked yet: a re-run moves those originals
  again, as duplicates with the same message_id, which the idempotency guard absorbs.

A held (delivered, unacked) message does not expire: quorum and classic queues only
expire ready messages, and one held past its TTL expires when it is given back (checked
on 3.10 and 4.3: tests/integration/test_transfer.py::test_held_message_does_not_expire).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pika
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

from rabbit_delay._broker import QueueCounts
from rabbit_delay._envelope import now_ms
from rabbit_delay._errors import ConfigError, MissingObjectError, PublishError, RabbitDelayError
from rabbit_delay._ops.queues import passive_counts, queue_counts, stored
from rabbit_delay._ops.stored import Stored
from rabbit_delay._ops.transfer.rules import (
    DEFAULT_TRANSFER_BATCH,
    Address,
    Leave,
    Move,
    QueueTally,
    Transfer,
    TransferReport,
    check_distinct,
    held_for_people,
    same_vhost,
    skip_reason,
    target_queues,
)
from rabbit_delay._sync.connection import broker_info
from rabbit_delay._sync.errors import CLIENT_ERRORS, mapped, translate
from rabbit_delay._sync.publisher import Publisher
from rabbit_delay._urls import redact

__all__ = ["MAX_PASSES", "Progress", "transfer"]

# A run reads every source queue again while the previous round moved something: what
# fell due into a business queue meanwhile, or dead-lettered between two cascade levels
# while its level was read, is found by the next round.
MAX_PASSES = 3
# A window that gets no delivery for this long asks whether its queue is empty...
_IDLE_S = 0.25
# ...and gives up waiting after this long without one (the next round reads the rest).
_STALL_S = 5.0
# A crashed run's consumers linger on a buffer this long at most before a new run
# takes them for someone else's.
_DEAD_CONSUMER_S = 3.0
# What stops a run (reported in TransferReport.error, never raised past the preflight).
_FAILURES: tuple[type[BaseException], ...] = (*CLIENT_ERRORS, RabbitDelayError)

Progress = Callable[[int, int], None]  # (messages moved so far, messages expected in all)


def _address(connection: pika.BlockingConnection) -> Address:
    params = connection._impl.params
    return str(params.host), int(params.port), str(params.virtual_host)


class _Window:
    """One batch: a consumer with a prefetch of `size` on a channel of its own."""

    def __init__(self, connection: pika.BlockingConnection, queue: str, size: int) -> None:
        self.connection = connection
        self.queue = queue
        self.size = size
        self.got: list[tuple[int, Stored]] = []
        self.held = 0  # delivered, neither acked nor given back
        self.channel: BlockingChannel = connection.channel()
        self.channel.basic_qos(prefetch_count=size)
        self.tag: str | None = self.channel.basic_consume(queue, self._on_message, auto_ack=False)

    def _on_message(
        self,
        _ch: BlockingChannel,
        method: pika.spec.Basic.Deliver,
        props: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        self.got.append((method.delivery_tag or 0, stored(method, props, body)))
        self.held += 1

    def fill(self) -> None:
        """Wait until the window is full, or the queue has nothing more to give now."""
        last = time.monotonic()
        while len(self.got) < self.size:
            before = len(self.got)
            self.connection.process_data_events(time_limit=0.05)
            now = time.monotonic()
            if len(self.got) > before:
                last = now
                continue
            if now - last < _IDLE_S:
                continue
            counts = queue_counts(self.connection, self.queue)
            if counts is None or counts.ready == 0 or now - last > _STALL_S:
                break
        self.connection.process_data_events(0)  # dispatch what already came
        self.stop()

    def stop(self) -> None:
        """Cancel the consumer (messages got stay held)."""
        tag, self.tag = self.tag, None
        if tag is not None and self.channel.is_open:
            self.channel.basic_cancel(tag)

    def ack(self, tags: list[int], *, all_of_batch: bool) -> None:
        if all_of_batch:
            # every message of this channel: one ack (one settle command in a quorum queue)
            self.channel.basic_ack(tags[-1], multiple=True)
        else:
            for tag in tags:
                self.channel.basic_ack(tag)
        self.held -= len(tags)

    def release(self) -> None:
        """Give every held message back to the queue, in order, and close the channel."""
        with contextlib.suppress(*CLIENT_ERRORS):
            if self.channel.is_open:
                self.stop()
                if self.held:
                    # a multiple nack: RabbitMQ 4.3 does not count it towards a delivery
                    # limit (a message left in place is not a failed delivery)
                    self.channel.basic_nack(0, multiple=True, requeue=True)
                    self.held = 0
                self.channel.close()


class _Run:
    """One transfer run: the rounds over the source queues, and the report."""

    def __init__(
        self,
        source: pika.BlockingConnection,
        target: Publisher,
        rules: Transfer,
        report: TransferReport,
        *,
        limit: int | None,
        batch: int,
        progress: Progress | None,
    ) -> None:
        self.source = source
        self.target = target
        self.rules = rules
        self.report = report
        self.limit = limit
        self.batch = batch
        self.progress = progress
        self.expected = 0
        # messages moved (dry run: that would move), and read but not yet decided: what
        # counts against the limit (a message left in place does not)
        self.taken = 0

    @property
    def budget(self) -> int | None:
        return None if self.limit is None else self.limit - self.taken

    def _size(self, queue_left: int) -> int:
        """The next window's size: a batch, never more than the queue held when counted
        nor more than the limit leaves."""
        budget = self.budget
        return min(self.batch, queue_left, budget if budget is not None else queue_left)

    def survey(self) -> None:
        """Counts of every source queue, before anything is read."""
        report = self.report
        names = [t.source.name for t in report.queues]
        with mapped("counting the source queues", permission="read"):
            counts = passive_counts(self.source, names)
            people = passive_counts(self.source, held_for_people(self.rules.source))
        if all(counts[name] is None for name in names):
            raise MissingObjectError(
                f"none of the queues of {report.source} exist on the source broker: is the "
                "topology (-f) or the broker (--url) wrong? (nothing was moved)"
            )
        for tally in report.queues:
            found = counts[tally.source.name]
            tally.ready = found.ready if found is not None else None
            tally.consumers = (found.consumers or 0) if found is not None else 0
            if skip_reason(tally.source, tally.ready, tally.consumers) is None:
                self.expected += tally.ready or 0
        if self.limit is not None:
            self.expected = min(self.expected, self.limit)
        report.people = {q: c.ready for q, c in people.items() if c is not None and c.ready}

    def rounds(self) -> None:
        report = self.report
        for round_no in range(1, (1 if report.dry_run else MAX_PASSES) + 1):
            if self.budget == 0:
                return
            report.passes = round_no
            before = report.moved
            for tally in report.queues:
                if self.budget == 0:
                    return
                self.read(tally, round_no)
            if report.moved == before:
                return

    def read(self, tally: QueueTally, round_no: int) -> None:
        """Move what `tally`'s queue holds now (at most what it held when counted)."""
        src = tally.source
        if round_no > 1 and tally.skipped is not None:
            return  # decided by the first round
        with mapped(f"checking queue {src.name!r}", permission="read"):
            counts = queue_counts(self.source, src.name)
            if round_no == 1 and src.buffer and counts is not None and counts.consumers:
                counts = self._without_the_dead(src.name, counts)
        ready = counts.ready if counts is not None else None
        # After the first round, consumers on a queue it read are its own, cancelled a
        # moment ago: a quorum queue may count them for a while (seen on 4.3).
        consumers = (counts.consumers or 0) if counts is not None and round_no == 1 else 0
        reason = skip_reason(src, ready, consumers)
        if reason is not None:
            tally.skip(reason, ready)
            return
        tally.skipped = None
        tally.left.clear()
        assert ready is not None
        queue_left = ready  # never read more than it held when counted
        if self._size(queue_left) <= 0:
            return  # (a prefetch of 0 would be no limit at all)
        windows: list[_Window] = []  # open: filling, or holding messages to give back
        doing = f"reading queue {src.name!r}"
        try:
            with mapped(doing, permission="read"):
                windows.append(_Window(self.source, src.name, self._size(queue_left)))
            while True:
                window = windows[-1]
                with mapped(doing, permission="read"):
                    window.fill()
                    got = len(window.got)
                    queue_left -= got
                    self.taken += got
                    full = got == window.size
                    ahead = full and self._size(queue_left) > 0
                    if ahead:
                        # the next batch is delivered while this one is published
                        windows.append(_Window(self.source, src.name, self._size(queue_left)))
                if got:
                    self.settle(window, tally)
                if not window.held:
                    windows.remove(window)
                    window.release()  # nothing to give back: just the channel
                if ahead:
                    continue
                if not full or self._size(queue_left) <= 0:
                    return  # the queue has nothing more now, or the limit is reached
                with mapped(doing, permission="read"):  # messages left gave the limit back
                    windows.append(_Window(self.source, src.name, self._size(queue_left)))
        finally:
            for window in windows:
                window.release()

    def _without_the_dead(self, queue: str, counts: QueueCounts) -> QueueCounts | None:
        """The counts of `queue` once the consumers of a run that just died are gone (the
        broker removes them a moment after their connection), or as they stay."""
        deadline = time.monotonic() + _DEAD_CONSUMER_S
        found: QueueCounts | None = counts
        while found is not None and found.consumers and time.monotonic() < deadline:
            time.sleep(0.2)
            found = queue_counts(self.source, queue)
        return found

    def settle(self, window: _Window, tally: QueueTally) -> None:
        """Decide each message of the window; publish the moves; ack their originals."""
        now = now_ms()
        moves: list[tuple[int, Move]] = []
        leaves = 0
        for tag, msg in window.got:
            decision = self.rules.decide(msg, tally.source, now)
            if isinstance(decision, Leave):
                tally.record(decision)
                leaves += 1
            else:
                moves.append((tag, decision))
        self.taken -= leaves  # a message left in place does not count against the limit
        if self.report.dry_run:
            for _tag, move in moves:
                tally.record(move)
            self._progress()
            return
        if not moves:
            return
        failed: set[str] = set()
        error: RabbitDelayError | None = None
        try:
            self.target.publish_outgoing(
                [self.target.scheduled(move.outgoing) for _tag, move in moves]
            )
        except RabbitDelayError as exc:
            error = exc
            if isinstance(exc, PublishError) and exc.message_ids:
                failed = set(exc.message_ids)  # every other copy was confirmed
            else:
                failed = {move.outgoing.message_id for _tag, move in moves}
        confirmed = [(tag, move) for tag, move in moves if move.outgoing.message_id not in failed]
        if confirmed:
            with mapped(f"acking moved messages in {tally.source.name!r}", permission="read"):
                window.ack(
                    [tag for tag, _move in confirmed],
                    all_of_batch=leaves == 0 and len(confirmed) == len(window.got),
                )
            for _tag, move in confirmed:
                tally.record(move)
        self._progress()
        if error is not None:
            raise error

    def _progress(self) -> None:
        if self.progress is not None:
            moved = self.report.moved
            self.progress(moved, max(self.expected, moved))

    def final_counts(self) -> None:
        """What is still in each source queue that was read, and for people."""
        report = self.report
        read = [t for t in report.queues if t.skipped is None or t.source.buffer]
        with mapped("counting the source queues", permission="read"):
            counts = passive_counts(self.source, [t.source.name for t in read])
            people = passive_counts(self.source, held_for_people(self.rules.source))
        for tally in read:
            found = counts[tally.source.name]
            tally.remaining = found.ready if found is not None else None
        report.people = {q: c.ready for q, c in people.items() if c is not None and c.ready}


def preflight(source: pika.BlockingConnection, target: Publisher, rules: Transfer) -> None:
    """Refuse a transfer that could only go wrong, before reading anything: the same
    queues on both sides, or a target topology that is not (fully) declared.

    Raises ConfigError, MissingObjectError, and what opening the target raises."""
    target.open()
    assert target.connection is not None
    same = same_vhost(
        broker_info(source),
        broker_info(target.connection),
        _address(source),
        _address(target.connection),
    )
    check_distinct(rules.source, rules.target, same_broker=same)
    with mapped("checking the target topology's queues", permission="read"):
        found = passive_counts(target.connection, target_queues(rules.target))
    missing = [name for name, counts in found.items() if counts is None]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise MissingObjectError(
            f"the target topology {rules.target.names.prefix} is not declared on the target "
            f"broker (missing: {shown}); run `rabbit-delay declare` for it there first "
            "(nothing was moved)"
        )


def transfer(
    source: pika.BlockingConnection,
    target: Publisher,
    rules: Transfer,
    *,
    dry_run: bool = False,
    limit: int | None = None,
    ready: bool = True,
    batch: int = DEFAULT_TRANSFER_BATCH,
    progress: Progress | None = None,
) -> TransferReport:
    """Move the pending messages of `rules.source` (read on `source`) into
    `rules.target` (published by `target`, a Publisher of the target topology); see
    the module docstring and docs/transfer.md.

    `dry_run` reads every message and gives it back (nothing is published or acked):
    the report tells what would move where. `limit` caps the messages read for moving;
    `ready` (default) also moves the ready messages of business queues nobody consumes.

    Raises ConfigError (a bad batch or limit, or source and target are the same queues),
    MissingObjectError (the target topology is not declared, or no source queue exists)
    and BrokerUnavailable / ConnectionLost / AccessRefused before anything is read. A
    failure once moving has begun is reported in `TransferReport.error`: every message
    counted as moved was confirmed in the target before its original was acked; the
    rest is in the source.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 65_535:
        raise ConfigError(f"batch must be a whole number in 1..65535, got {batch!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit must be a whole number of at least 1, got {limit!r}")
    report = TransferReport.start(
        rules, dry_run=dry_run, ready=ready, broker=broker_info(source), limit=limit
    )
    run = _Run(source, target, rules, report, limit=limit, batch=batch, progress=progress)
    preflight(source, target, rules)
    run.survey()
    started = time.monotonic()
    try:
        run.rounds()
    except _FAILURES as exc:
        error = translate(exc, doing=f"moving messages from {report.source}", permission="read")
        report.error = (
            f"stopped after moving {report.moved} message(s): {redact(str(error))}; every "
            "message not moved is still in its source queue: run transfer again to finish"
        )
    report.elapsed_s = time.monotonic() - started
    if not dry_run and source.is_open:
        with contextlib.suppress(*_FAILURES):  # the report says what moved either way
            run.final_counts()
    return report
