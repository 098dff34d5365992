"""What the CLI (and a dashboard) show and do, as pure functions: the transports read
the broker, these modules decide what it means."""
