"""The ClickHouse HTTP interface served by the process that holds an embedded (chdb) store."""
