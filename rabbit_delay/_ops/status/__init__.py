"""`rabbit-delay status`: rules.py decides the rows and what needs a human; execute.py
reads the broker (pika and the management API)."""
