"""Offline evaluation of passes, the promotion gate and shadow scoring."""
