"""The timeline and its sampler: one background thread reads a source into bounded numpy rings that keep
min and max at every zoom; threshold alerts ride on its samples."""
