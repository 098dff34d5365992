"""`rabbit-delay delete`: rules.py decides what goes, in which order, and what blocks it;
execute.py surveys the broker and deletes (pika)."""
