"""The README's Python API example, run as written (so it cannot drift from the code)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_api_example_runs_as_written():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "make_round" in code and "jax.jit(make_round" in code   # the user jits the round themselves
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    fair, ea = map(float, lines[-2].split())
    assert 0.0 <= fair <= 1.0 and 0.0 <= ea <= 1.0
    # the host runner computes what the user's jitted pure round computes
    assert abs(float(lines[-1]) - ea) < 1e-3


def test_every_public_name_is_in_the_readmes_table():
    """``import pfedkdh_jax as p``: each name of ``p.__all__`` has a row in the README's table of names."""
    import pfedkdh_jax
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("Every public name"):]
    table = table[:table.index("\n\n", table.index("| name |"))]
    first = [line.split("|")[1] for line in table.splitlines() if line.startswith("| ")]   # the name column
    listed = set(re.findall(r"`(\w+)`", " ".join(first)))
    per_method = any("`<Method>Config`" in cell for cell in first)   # the configs, one per listed method
    missing = [n for n in pfedkdh_jax.__all__ if n not in listed
               and not (per_method and n.endswith("Config") and n[:-len("Config")] in listed)]
    assert not missing, f"public names without a row in README.md's table: {missing}"
