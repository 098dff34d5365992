"""The [held] backend's holders: what they decide (`rules`), pure. The AMQP 1.0 driver
that executes it is `rabbit_delay._amqp10`."""
