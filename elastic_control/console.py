"""One rich console for people (stderr) and plain stdout for data."""

from __future__ import annotations

import sys

from rich.console import Console

console = Console(stderr=True, highlight=False, soft_wrap=True)


def done(message: str) -> None:
    console.print(f"[green]✓[/green] {message}")


def failed(message: str) -> None:
    console.print(f"[red]⨯[/red] {message}")


def info(message: str) -> None:
    console.print(message)


def warn(message: str) -> None:
    console.print(f"[yellow]![/yellow] {message}")


def out(text: str) -> None:
    """Data for stdout (predictions, JSON), never decorated."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()
