"""Click-log data: the slot line format, key transform, readers and generators."""
