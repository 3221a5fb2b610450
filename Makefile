# The two set-up commands of the README: `make demo` and `make test`.
# Each installs what it needs, idempotently: a virtual environment with the
# pinned packages, and the Kafka broker jars (fetched by Maven once).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Two stamps: `make demo` installs what the demo needs (the stack and the trainer);
# `make test` (and install, bench, fault-soak) adds the tests', benchmarks' and
# integrations' packages on top.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP      := $(VENV)/.installed
# setuptools tells every editable install of a package-dir layout that it uses an import
# hook ("Editable installation ... be careful with folders ..."), as a UserWarning: a
# screen of text on a user's first run, and nothing they can act on.
PIP    := PYTHONWARNINGS=ignore::UserWarning $(PY) -m pip
# The integrations' tests run against these from PyPI, installed without their
# requirements (which pin torch < 2.11, packaging < 26, protobuf < 7, pillow < 13
# against the stack's); what their modules import comes with the `integrations`
# extra. See docs/INTEGRATIONS.md.
NO_DEPS := areal==1.0.4 verl==0.9.1 swanlab==0.10.3 trackio==0.43.0
# helm, for tests/test_helm_chart.py: built from its Go module into the venv's bin, once per
# version (Go from PATH or /usr/local/go; GOTOOLCHAIN=auto fetches a newer Go if the module needs one).
HELM_VERSION ?= v4.3.2
HELM_STAMP   := $(VENV)/.helm-$(HELM_VERSION)
GO           ?= $(shell command -v go || echo /usr/local/go/bin/go)

.PHONY: install demo test test-loaded bench clean-state fault-soak

$(DEMO_STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed"'
	@command -v java >/dev/null || { echo "Java 17+ is needed for the local Kafka broker"; exit 2; }
	@command -v mvn >/dev/null || { echo "Maven is needed to fetch the Kafka jars"; exit 2; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Installing the stack and the trainer into $(VENV) (torch, Faust, the ClickHouse engine...): a few minutes the first time"
	@$(PIP) install --quiet --upgrade pip
	@$(PIP) install --quiet -e '.[stack,train]'
	@$(PY) -c 'from areal_metrics.stack.kafka_broker import ensure_jars; from areal_metrics.stack.settings import StackSettings; print("kafka jars:", ensure_jars(StackSettings.from_env()))'
	@$(PY) tools/rooms_tree.py >/dev/null  # the rooms as links, for pyright and editors (docs/ARCHITECTURE.md)
	@touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	@echo "Installing the tests', benchmarks' and integrations' packages into $(VENV) (TRL, ray, verl...): several minutes the first time"
	@$(PIP) install --quiet -e '.[stack,train,test,bench,fast,integrations]'
	@$(PIP) install --quiet --no-deps $(NO_DEPS)
	@$(VENV)/bin/pyright --version >/dev/null  # fetches pyright's own package once, at install rather than in a test
	@touch $(STAMP)

$(HELM_STAMP): | $(STAMP)  # order-only: a new package list does not rebuild helm
	@test -x "$(GO)" || { echo "Go is needed to build helm for the chart's tests (https://go.dev/dl)"; exit 2; }
	GOBIN=$(abspath $(VENV))/bin GOTOOLCHAIN=auto $(GO) install helm.sh/helm/v4/cmd/helm@$(HELM_VERSION)
	touch $(HELM_STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/areal-metrics demo

test: $(STAMP) $(HELM_STAMP)
	$(PY) -m pytest -q -rs

# The fault tests, SOAK_N times in fresh pytest sessions (a new broker each time), to
# count rare failures; each run's output is kept in $(SOAK_DIR)/run-N.log, and a failed
# run's files (worker, sink, trainer logs) in $(SOAK_DIR)/tmp-N/.
SOAK_N     ?= 30
SOAK_DIR   ?= .areal/soak
SOAK_TESTS ?= tests/test_faults.py tests/test_cluster_faults.py \
	tests/test_streams_e2e.py::test_worker_killed_and_restarted_mid_scenario_gives_the_same_events \
	tests/test_fuzz_strings.py tests/test_sink_poison.py tests/test_clickhouse_http_bounds.py \
	tests/test_sink_broker.py::test_sigkill_mid_batch_repeatedly_loses_and_duplicates_nothing \
	tests/test_structure_fuzz.py tests/test_client_hostile_values.py \
	tests/test_supervision.py

fault-soak: $(STAMP)
	@mkdir -p $(SOAK_DIR); failed=0; \
	for i in $$(seq 1 $(SOAK_N)); do \
	  start=$$(date +%s); \
	  if $(PY) -m pytest -q -p no:cacheprovider --basetemp=$(SOAK_DIR)/tmp-$$i $(SOAK_TESTS) \
	       > $(SOAK_DIR)/run-$$i.log 2>&1; \
	  then echo "run $$i/$(SOAK_N): pass ($$(( $$(date +%s) - start )) s)"; rm -rf $(SOAK_DIR)/tmp-$$i; \
	  else failed=$$((failed + 1)); \
	    echo "run $$i/$(SOAK_N): FAIL ($$(( $$(date +%s) - start )) s; $(SOAK_DIR)/run-$$i.log, $(SOAK_DIR)/tmp-$$i)"; fi; \
	done; \
	echo "fault-soak: $$failed of $(SOAK_N) runs failed ($(SOAK_TESTS))"; \
	test $$failed -eq 0

# The tests of the store's query bounds beside a CPU hog: HOG_N busy processes (more than the
# cores of a CI machine) for at most HOG_S seconds, stopped when the tests end. A legitimate
# query must wait or finish on a loaded machine; only its own time bound or a gone client stops it.
HOG_N ?= 4
HOG_S ?= 900
HOG_TESTS ?= tests/test_clickhouse_http_go.py::test_every_dashboard_query_reads_the_same_through_clickhouse_go \
	tests/test_sink_broker.py::test_replay_rebuilds_identical_tables tests/test_clickhouse_http_bounds.py

test-loaded: $(STAMP)
	@hogs=""; for i in $$(seq 1 $(HOG_N)); do timeout $(HOG_S) sh -c 'while :; do :; done' & hogs="$$hogs $$!"; done; \
	$(PY) -m pytest -q -rs -p no:cacheprovider $(HOG_TESTS); rc=$$?; kill $$hogs 2>/dev/null; exit $$rc

bench: $(STAMP)
	$(PY) -m benchmarks

clean-state:
	$(VENV)/bin/areal-metrics down || true
	rm -rf .areal
