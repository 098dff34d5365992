"""What the CLI (and a future dashboard) show and do, as pure functions: no I/O.

The transports (`rabbit_delay.sync`, `rabbit_delay.aio`) read and write the broker and
hand what they read to these modules; the CLI renders what they return.
"""
