"""`rabbit-delay scheduled`: rules.py decides how the schedule's records are asked for
and shown (times, keys, outcomes); the store calls and publishes are
`rabbit_delay.sync.Schedule`'s (no execute.py of its own)."""
