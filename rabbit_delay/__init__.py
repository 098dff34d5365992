"""rabbit-delay: reliable "do this later" on RabbitMQ."""
