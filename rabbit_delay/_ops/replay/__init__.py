"""`rabbit-delay replay`: rules.py decides what a replayed parked or catch-all message
becomes, and holds the reports; execute.py moves the messages (pika)."""
