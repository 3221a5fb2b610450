"""`python -m grafana`: regenerate grafana/dashboards/*.json and grafana/provisioning/."""

from grafana.catalog import repo_root, write_all
from grafana.provision import write_provisioning

for path in [*write_all(), *write_provisioning(repo_root() / "grafana" / "provisioning")]:
    print(path.relative_to(repo_root()))
