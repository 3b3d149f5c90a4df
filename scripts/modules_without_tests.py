"""List product modules that no test file imports by name (`import X`, `from X import Y` naming a submodule,
or a dotted string such as `-m cube.server`): python scripts/modules_without_tests.py [REPO]."""

import ast
import re
import subprocess
import sys
from pathlib import Path

repo = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
files = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True).stdout.split()
mods = {}
for f in files:
    if f.endswith(".py") and f.split("/")[0] in ("ctr_foundation", "elastic_control", "cube", "client"):
        m = f[:-3].replace("/", ".")
        if m.endswith(".__init__"):
            continue
        mods[m] = f
seen = set()
for f in files:
    if not (f.startswith("tests/") and f.endswith(".py")):
        continue
    text = (repo / f).read_text()
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                seen.add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            seen.add(node.module)
            for a in node.names:
                seen.add(f"{node.module}.{a.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", node.value):
                seen.add(node.value)
missing = sorted(m for m in mods if m not in seen and not m.endswith("__main__"))
for m in missing:
    print(m)
print(len(missing), "of", len(mods), file=sys.stderr)
