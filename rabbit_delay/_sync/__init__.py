"""The pika transport (private): connection, exception map, publisher, worker, declarer,
reconcile driver. Public names: `rabbit_delay.sync`."""
