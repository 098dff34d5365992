"""`rabbit-delay parked`: rules.py decides how parked messages are listed, paged and
shown; execute.py peeks and purges a parking lot (pika)."""
