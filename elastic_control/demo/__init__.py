"""``elastic-control demo``: the whole local pipeline on generated (or Criteo) data, ending with predictions."""
