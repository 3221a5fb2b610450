"""`python -m areal_metrics.dashboards`: regenerate grafana/dashboards/*.json from the code."""

from areal_metrics.dashboards.catalog import write_all

for path in write_all():
    print(path)
