"""Training on Paddle's parameter server: model, roles, per-pass export, tracking."""
