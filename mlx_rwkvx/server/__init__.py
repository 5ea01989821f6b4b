"""The OpenAI-compatible server: ``python -m mlx_rwkvx.server`` (``main.py``), its routes
(``app.py``; a request checked in ``requests.py``, answered in ``replies.py``, embeddings in
``embeddings.py``), its models (``served.py``) and the thread that runs their jobs
(``engine.py``, ``jobs.py``), OpenAI's schemas (``protocol.py``) and tool calls
(``tools.py``). Its dependencies (FastAPI, uvicorn) are the
``server`` extra: ``pip install "mlx_rwkvx[server]"``."""
