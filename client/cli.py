"""ctr-client (being built; see issue 5)."""


def main():
    raise SystemExit("ctr-client is not implemented yet")
