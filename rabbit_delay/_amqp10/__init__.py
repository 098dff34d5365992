"""The AMQP 1.0 transport (python-qpid-proton, the `held` extra): the holders of the
[held] backend. It executes what `rabbit_delay._held.rules` decides."""
