"""What a running job shows: its event history (``events``), Prometheus metrics (``metrics``),
the observer the launcher feeds (``observer``), the dashboard and JSON API it serves
(``server``, ``static/``) and the timeline picture of an event file (``timeline``)."""
