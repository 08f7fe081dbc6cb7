"""Callbacks for training frameworks: ``gpumem.integrations.lightning`` and ``gpumem.integrations.huggingface``.

Each logs :meth:`gpumem.Monitor.metrics` through the framework's own logger, every N steps. Install the
framework with ``pip install gpumem[lightning]`` or ``pip install gpumem[huggingface]``.
"""
