"""The Monitor (a source, its timeline and sampler, shared by claims), measured stretches of time and the
rule that says whether a peak is exact."""
