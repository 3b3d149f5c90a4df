"""cube-transfer (being built; see issue 4)."""


def main():
    raise SystemExit("cube-transfer is not implemented yet")
