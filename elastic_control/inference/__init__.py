"""Scoring with a trained pass: its dense inference program and (in memory) its sparse table."""
