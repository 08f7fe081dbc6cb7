"""Diagnoses: why a cell ran out of memory, how much of the free reserve a request can use, the allocator's
figures explained, the operators that allocated most, and why nvidia-smi shows more than torch."""
