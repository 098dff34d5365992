"""The schedule: an index of delayed messages by key (state, due time, generation). Pure."""
