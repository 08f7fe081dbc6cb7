"""Callbacks for training frameworks: ``gpumem.integrations.lightning`` and ``gpumem.integrations.huggingface``.

Each logs :meth:`gpumem.Monitor.metrics` through the framework's own logger, every N steps. Install the
framework with ``pip install jupyter-gpumem[lightning]`` or ``pip install jupyter-gpumem[huggingface]``.
"""
