"""The OpenAI-compatible server: ``python -m mlx_rwkvx.server`` (``main.py``), its routes
(``app.py``), its models and the thread that runs them (``engine.py``), OpenAI's schemas
(``protocol.py``) and tool calls (``tools.py``). Its dependencies (FastAPI, uvicorn) are the
``server`` extra: ``pip install "mlx_rwkvx[server]"``."""
