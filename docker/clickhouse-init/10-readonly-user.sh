#!/bin/bash
# A read-only ClickHouse user for Grafana: dashboards read, they never write.
# readonly=2 forbids every write and DDL but lets the plugin pass per-query settings.
set -euo pipefail
clickhouse client --user "${CLICKHOUSE_USER}" --password "${CLICKHOUSE_PASSWORD}" -n <<SQL
CREATE DATABASE IF NOT EXISTS ${CLICKHOUSE_DB};
CREATE USER IF NOT EXISTS ${GRAFANA_CH_USER} IDENTIFIED WITH sha256_password BY '${GRAFANA_CH_PASSWORD}'
    SETTINGS readonly = 2;
GRANT SELECT ON ${CLICKHOUSE_DB}.* TO ${GRAFANA_CH_USER};
SQL
