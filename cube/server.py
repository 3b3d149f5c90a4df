"""cube-server (being built; see issue 4)."""


def main():
    raise SystemExit("cube-server is not implemented yet")
