"""`rabbit-delay dashboard`: rules.py (pure: auth, page bounds, the picture, lateness
histograms, the one poller), html.py (pure: the pages), execute.py (pika: the broker
side), server.py (the WSGI app and server: HTTP I/O)."""
