"""`rabbit-delay asyncapi`: rules.py builds the AsyncAPI 3.0 document of a topology (pure;
no broker side)."""
