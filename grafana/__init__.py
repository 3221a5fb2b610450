"""Grafana dashboards as code (grafana-foundation-sdk, Grafana 11.6 types).

- `catalog`: every dashboard, built and written to grafana/dashboards/*.json
- `clickhouse`: the ClickHouse datasource's query type for the SDK
- `macros`: the SQL Grafana and the plugin send to ClickHouse for a panel
- `validate`: round trip through the SDK types, datasource uids
- `provision`: push datasource and dashboards to a running Grafana
"""
