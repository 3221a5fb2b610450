"""`python -m areal_metrics.dashboards`: regenerate grafana/dashboards/*.json and grafana/provisioning/."""

from areal_metrics.dashboards.catalog import repo_root, write_all
from areal_metrics.dashboards.provision import write_provisioning

for path in [*write_all(), *write_provisioning(repo_root() / "grafana" / "provisioning")]:
    print(path.relative_to(repo_root()))
