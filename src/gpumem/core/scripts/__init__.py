"""Scripts and ranks: ``python -m gpumem run``, what a script asks a Monitor for (tags, scopes, step
metrics and their writers), its report, and every rank's memory gathered on rank 0."""
