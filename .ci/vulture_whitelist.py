"""Names vulture (the dead-code check of .ci/run, configured in pyproject.toml) reports
as unused in rabbit_delay/ although something it cannot see uses them. Started from
`vulture --make-whitelist`, then reviewed: each entry says who uses it. Not executed.

A new entry needs a user outside the package (a framework calling it by name, an
application using the public API); anything else that vulture reports is dead: delete it.
"""

# -- called by a framework or a protocol, by name -----------------------------------------

__getattr__  # PEP 562: the lazy exports of rabbit_delay/__init__.py
__dir__  # PEP 562: the lazy exports of rabbit_delay/__init__.py
_root  # typer: the app's callback (rabbit_delay/_cli/app.py)
permissions_command  # typer: the `permissions` command (rabbit_delay/_cli/declare.py)
_.exit_code  # click reads it from a usage error (rabbit_delay/_cli/app.py)
rabbit_delay_broker  # pytest: a fixture of the plugin (rabbit_delay/testing/pytest_plugin.py)
model_config  # pydantic (rabbit_delay/_topology/model.py)
_._one_schedule  # pydantic validator (rabbit_delay/_topology/model.py)
_._limit_fits_retries  # pydantic validator (rabbit_delay/_topology/model.py)
_._ttl_fits  # pydantic validator (rabbit_delay/_topology/model.py)
_._absolute_path  # pydantic validator (rabbit_delay/_topology/model.py)
_._url_fits_the_store  # pydantic validator (rabbit_delay/_topology/model.py)
_._idempotency_in_context  # pydantic validator (rabbit_delay/_topology/model.py)
_._consistent  # pydantic validator (rabbit_delay/_topology/model.py)
_.submit  # concurrent.futures.Executor: run_in_executor calls it (rabbit_delay/_aio/worker.py)
daemon_threads  # socketserver (rabbit_delay/_io/endpoints.py, _ops/dashboard/server.py)
allow_reuse_address  # socketserver (rabbit_delay/_io/endpoints.py, _ops/dashboard/server.py)
request_queue_size  # socketserver (rabbit_delay/_ops/dashboard/server.py)
address_family  # socketserver (rabbit_delay/_ops/dashboard/server.py)
_.log_message  # http.server: an override (rabbit_delay/_io/endpoints.py, dashboard)
_.log_request  # http.server: an override (rabbit_delay/_ops/dashboard/server.py)
_.__annotations__  # typing.get_type_hints reads it (rabbit_delay/_consumer/inputs.py: _OneHint)
_.formatTime  # logging.Formatter: an override (rabbit_delay/_observe/logs.py)
datefmt  # logging.Formatter.formatTime's parameter (rabbit_delay/_observe/logs.py)
tb  # __exit__ / __aexit__'s parameter (rabbit_delay/testing/_kit.py)
_.client_properties  # read by pika: ConnectionParameters (rabbit_delay/_sync/connection.py)
_.connection_attempts  # read by pika: ConnectionParameters
_.socket_timeout  # read by pika: ConnectionParameters
_.stack_timeout  # read by pika: ConnectionParameters
_.blocked_connection_timeout  # read by pika: ConnectionParameters
_.ssl_options  # read by pika: ConnectionParameters

# Enum members chosen by value (a CLI argument, a topology file, a metric label).
WORKER  # Role("worker"): `rabbit-delay permissions worker` (rabbit_delay/_plan/permissions.py)
CLIENT_LOCAL  # LeaderLocator("client-local"): [scaling] (rabbit_delay/_topology/model.py)
SUCCESS  # metrics.Outcome("success"): the outcome label (rabbit_delay/_observe/metrics.py)
PARK  # metrics.Outcome("park"): the outcome label (rabbit_delay/_observe/metrics.py)

# Counters read through dataclasses.fields() (as_dict: metrics, /healthz, logs).
deferred  # WorkerStats (rabbit_delay/_observe/report.py)
duplicates  # WorkerStats
publish_failures  # WorkerStats
reconnects  # WorkerStats
consumer_cancels  # WorkerStats
leases_lost  # WorkerStats
duplicates_skipped  # GuardStats (rabbit_delay/_idempotency/guard.py)
in_progress_deferred  # GuardStats
cancelled_dropped  # GuardStats

# -- the public API: used by applications, documented ------------------------------------

_.publish_delayed  # Publisher, AsyncPublisher (rabbit_delay/_publishing/core.py)
_.publish_many  # Publisher, AsyncPublisher
_.connected_url  # Publisher, AsyncPublisher
_.acancel  # App (rabbit_delay/_consumer/app.py)
_.traceparent  # HandlerContext (rabbit_delay/_consumer/context.py)
_.scheduled_at  # HandlerContext
_.is_last_attempt  # HandlerContext
started_at  # ReconcileContext (docs/reconciliation.md)
_.tier_for_ms  # Topology (rabbit_delay/_topology/model.py)

_.mark_done_in  # SQLiteStore: the inbox pattern (docs/idempotency.md)
_.cancel_in  # SQLiteStore (docs/idempotency.md, examples/inbox_sqlite.py)
_.async_publisher  # rabbit_delay.testing.TestBroker (docs/testing.md)
_.aadvance  # TestBroker
_.arun_until_idle  # TestBroker
_.queue_depth  # TestBroker
_.delete_queue  # rabbit_delay.testing.MemoryBroker
_.has_exchange  # MemoryBroker
_.queue_arguments  # MemoryBroker
_.next_cursor  # Schedule, AsyncSchedule (docs/schedule.md): a page's cursor
_.timeline  # Schedule, AsyncSchedule (docs/schedule.md, the dashboard)
SchedulingStore  # rabbit_delay/_idempotency/guard.py: the protocol a scheduling store implements
AsyncSchedulingStore
AsyncScheduleBook  # rabbit_delay/_schedule/book.py: the protocol of an async store's schedule

# -- NOT used: found when this check was added (issue 20) in modules that others were
# reshaping at the time. Delete the code (and the tests that only exercise it), then
# the line here. This section only shrinks.

# -- read by tests, or by name -------------------------------------------------------------
_.coalescing  # AckTracker: tests assert when coalescing switches off (white box)
_.outages  # Recovery: tests count outages (white box)
TRACE_HEADERS  # rabbit_delay/_headers.py: the wire contract's list (tests, docs)
broker_url  # rabbit_delay/_urls.py: benchmarks and tools resolve $RABBIT_DELAY_URL with it
# WorkerStats counters: incremented by name (WorkerStats.count), read by users and tests
_.duplicate
_.requeued
_.handed_back
_.store_failures
_.superseded  # WorkerStats (outcome superseded)
_.superseded_dropped  # GuardStats

# -- python-qpid-proton calls them by name (rabbit_delay/_amqp10/holder.py) ----------------

_.on_connection_error  # proton MessagingHandler event
_.on_session_error  # proton MessagingHandler event
_.on_link_error  # proton MessagingHandler event
_.on_transport_error  # proton MessagingHandler event
_.on_transport_closed  # proton handler event
_.on_timer_task  # proton Container.schedule callback
_.annotations  # proton Disposition: sent with the `modified` settle
_.undeliverable  # proton Disposition: sent with the `modified` settle
_.on_start  # proton MessagingHandler event
_.on_connection_opened  # proton MessagingHandler event
_.on_link_opened  # proton MessagingHandler event
_.connected_ms  # HolderStats: read by callers (tests bound lateness from the reconnect)
