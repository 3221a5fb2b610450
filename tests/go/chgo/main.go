// Command chgo runs SQL over ClickHouse's HTTP interface with clickhouse-go v2,
// configured as Grafana's ClickHouse data source configures it (database/sql
// through clickhouse.OpenDB, protocol HTTP, gzip compression), and prints what
// came back as JSON. The Python tests (tests/test_clickhouse_http_go.py) build
// it, give it a DSN and a file of queries, and compare its answers with theirs.
//
//	chgo -dsn http://USER:PASSWORD@127.0.0.1:PORT/DATABASE -queries queries.json
//
// queries.json: [{"name": "...", "sql": "..."}, ...]. Output, one JSON array:
// [{"name", "columns", "types", "rows": [[...], ...], "error", "code"}, ...].
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"net/url"
	"os"
	"reflect"
	"strings"
	"time"

	"github.com/ClickHouse/clickhouse-go/v2"
)

type query struct {
	Name string `json:"name"`
	SQL  string `json:"sql"`
}

type result struct {
	Name    string   `json:"name"`
	Columns []string `json:"columns"`
	Types   []string `json:"types"`
	Rows    [][]any  `json:"rows"`
	Error   string   `json:"error,omitempty"`
	Code    int32    `json:"code,omitempty"`
}

// options turns http://user:password@host:port/database into the data source's options.
func options(dsn string) (*clickhouse.Options, error) {
	u, err := url.Parse(dsn)
	if err != nil {
		return nil, err
	}
	if u.Scheme != "http" {
		return nil, fmt.Errorf("expected an http:// DSN, got %q", u.Scheme)
	}
	password, _ := u.User.Password()
	return &clickhouse.Options{
		Protocol: clickhouse.HTTP,
		Addr:     []string{u.Host},
		Auth: clickhouse.Auth{
			Database: strings.Trim(u.Path, "/"),
			Username: u.User.Username(),
			Password: password,
		},
		Compression: &clickhouse.Compression{Method: clickhouse.CompressionGZIP}, // what Grafana sets for HTTP
		DialTimeout: 10 * time.Second,
		ReadTimeout: 60 * time.Second,
	}, nil
}

// plain makes a scanned value JSON-friendly: times in UTC RFC 3339, NaN/Inf as strings,
// UUIDs, IP addresses and decimals as their text, an Array(UInt8) as numbers.
func plain(v any) any {
	switch x := v.(type) {
	case nil:
		return nil
	case time.Time:
		return x.UTC().Format(time.RFC3339Nano)
	case float64:
		if math.IsNaN(x) || math.IsInf(x, 0) {
			return fmt.Sprint(x)
		}
		return x
	case float32:
		return plain(float64(x))
	case fmt.Stringer: // UUID, IP addresses, decimals
		return x.String()
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Pointer:
		if rv.IsNil() {
			return nil
		}
		return plain(rv.Elem().Interface())
	case reflect.Slice, reflect.Array:
		out := make([]any, rv.Len())
		for i := range out {
			out[i] = plain(rv.Index(i).Interface())
		}
		return out
	case reflect.Map:
		out := map[string]any{}
		for _, k := range rv.MapKeys() {
			out[fmt.Sprint(k.Interface())] = plain(rv.MapIndex(k).Interface())
		}
		return out
	}
	return v
}

func run(ctx context.Context, db *sql.DB, q query) result {
	r := result{Name: q.Name, Rows: [][]any{}}
	rows, err := db.QueryContext(ctx, q.SQL)
	if err != nil {
		r.Error = err.Error()
		var ex *clickhouse.Exception
		if errors.As(err, &ex) {
			r.Code = ex.Code
		}
		return r
	}
	defer rows.Close()
	r.Columns, _ = rows.Columns()
	types, _ := rows.ColumnTypes()
	for _, t := range types {
		r.Types = append(r.Types, t.DatabaseTypeName())
	}
	for rows.Next() {
		values := make([]any, len(r.Columns))
		pointers := make([]any, len(values))
		for i := range values {
			pointers[i] = &values[i]
		}
		if err := rows.Scan(pointers...); err != nil {
			r.Error = err.Error()
			return r
		}
		row := make([]any, len(values))
		for i, v := range values {
			row[i] = plain(v)
		}
		r.Rows = append(r.Rows, row)
	}
	if err := rows.Err(); err != nil {
		r.Error = err.Error()
	}
	return r
}

func main() {
	dsn := flag.String("dsn", os.Getenv("CLICKHOUSE_DSN"), "http://USER:PASSWORD@HOST:PORT/DATABASE")
	file := flag.String("queries", "", "JSON file: [{\"name\", \"sql\"}, ...]")
	flag.Parse()
	opts, err := options(*dsn)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chgo:", err)
		os.Exit(2)
	}
	data, err := os.ReadFile(*file)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chgo:", err)
		os.Exit(2)
	}
	var queries []query
	if err := json.Unmarshal(data, &queries); err != nil {
		fmt.Fprintln(os.Stderr, "chgo: queries:", err)
		os.Exit(2)
	}
	db := clickhouse.OpenDB(opts)
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "chgo: ping:", err)
		os.Exit(1)
	}
	out := make([]result, 0, len(queries))
	for _, q := range queries {
		out = append(out, run(ctx, db, q))
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "chgo:", err)
		os.Exit(1)
	}
}
