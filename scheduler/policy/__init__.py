"""Pure placement policy: frozen inputs, `now` passed in, no I/O (tested without a database)."""
