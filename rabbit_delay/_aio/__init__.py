"""The aio-pika transport (private): connection, exception map, publisher, worker,
declarer, reconcile driver, its thread pool and store batches. Public names:
`rabbit_delay.aio`."""
