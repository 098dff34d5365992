"""The schedule's facades, `Schedule` and `AsyncSchedule`: the store calls and publishes of
what `rabbit_delay._schedule.operations` decides."""
