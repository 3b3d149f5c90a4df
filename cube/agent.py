"""cube-agent (being built; see issue 4)."""


def main():
    raise SystemExit("cube-agent is not implemented yet")
