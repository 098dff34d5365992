"""I/O that is not AMQP: the management HTTP client (management.py, urllib), the worker's
HTTP endpoints (endpoints.py, wsgiref) and the SQLite helpers (sql.py)."""
