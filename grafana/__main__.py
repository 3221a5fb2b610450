"""`python -m areal_metrics.grafana [--out DIR]`: write the dashboards' JSON and the provisioning files.

The committed copies live in `grafana/` (DIR's default): `DIR/dashboards/*.json`
and `DIR/provisioning/` (the Docker stack of compose.yaml mounts both). A test
checks that the committed files are what this command writes.
"""

import argparse
from pathlib import Path

from areal_metrics.grafana.catalog import repo_root, write_all
from areal_metrics.grafana.provision import write_provisioning

parser = argparse.ArgumentParser(prog="python -m areal_metrics.grafana", description=__doc__.splitlines()[0])
parser.add_argument("--out", type=Path, default=repo_root() / "grafana", metavar="DIR",
                    help="folder to write dashboards/ and provisioning/ into (default: the repository's grafana/)")
out = parser.parse_args().out
for path in [*write_all(out / "dashboards"), *write_provisioning(out / "provisioning")]:
    print(path)
