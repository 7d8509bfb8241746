"""One module per benchmark item; each ``run(ctx)`` returns a JSON-ready dict of figures."""
