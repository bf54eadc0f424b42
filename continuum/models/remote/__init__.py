"""``models.remote(url)``: every generator against a ``continuum serve``, states exact on the client, KV on the
server (docs/remote.md). ``model.py``: the model and its calls; ``handle.py``: a remote state's KV; ``client.py``:
HTTP and errors; ``wire.py``: what travels. Imports nothing until used (``continuum.models`` imports this package
first, so that its function ``remote`` owns the name)."""
