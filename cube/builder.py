"""cube-builder (being built; see issue 4)."""


def main():
    raise SystemExit("cube-builder is not implemented yet")
