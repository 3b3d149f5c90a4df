"""``python -m client``."""

from client.cli import main

main()
