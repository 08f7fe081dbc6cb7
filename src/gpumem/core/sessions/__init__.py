"""Sessions on disk: ``%gpumem export`` and ``%gpumem load`` (JSON or Parquet), and a loaded session drawn
read-only."""
