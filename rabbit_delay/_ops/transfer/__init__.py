"""`rabbit-delay transfer`: rules.py decides what a pending message becomes in the target
topology, and holds the report; execute.py reads, publishes and settles (pika)."""
