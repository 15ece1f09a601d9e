# tasklease: every target sets up what it needs (virtualenv, Python packages, Go-built binaries).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml tools/pyproject.toml | cksum | cut -d' ' -f1)
LOCAL  := $(PY) -m tasklease_dev

.PHONY: help venv bytecode build prometheus cluster cluster-down node node-down e2e kind kind-down kind-e2e lint unit unit-all test demo bench chaos generate dist clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

# Bytecode is compiled once here, as pip compiles it into the image, but for the Kubernetes
# client (its models are most of the files, and only a kubeconfig with an exec plugin imports
# it). Where PYTHONDONTWRITEBYTECODE is set no import writes any, and every process started
# (agents, the operator, the CLI in tests) would compile all it imports again: most of an
# agent's start. `bytecode` does the same for the source folders, whose files change.
$(STAMP): pyproject.toml tools/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[operator,test]' -e tools
	$(PY) -m compileall -q -j0 -x '/kubernetes/' $(VENV)/lib >/dev/null
	rm -f $(VENV)/.installed-*; touch $@

venv: $(STAMP) ## create the virtualenv; install tasklease (operator and test extras) and tools/ (development)

bytecode: $(STAMP) ## compile the source folders' bytecode (test, bench, demo and chaos do it first; make venv the packages')
	$(PY) -m compileall -q -j0 operator tools >/dev/null

build: $(STAMP) ## build etcd, kube-apiserver, kube-controller-manager (helm, KEDA) once, cached outside the clone
	$(LOCAL) build

prometheus: ## Prometheus and promtool (Debian's package) for the alert and dashboard tests, unless on the PATH
	command -v promtool >/dev/null && command -v prometheus >/dev/null || { apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; } || \
	  echo "make prometheus: could not install Debian's prometheus package; the tests that need it will skip"

cluster: build ## start the local control plane on 127.0.0.1 and apply crds/
	$(LOCAL) up

cluster-down: venv ## stop the local control plane (and the node) and remove its data
	$(LOCAL) down

node: build ## add a real node (containerd, kubelet, scheduler; loopback only) to the control plane; root
	$(LOCAL) node-up

node-down: venv ## remove the node and everything it changed on this machine (idempotent); root
	$(LOCAL) node-down

# The node and kind change the host, so one of them runs at a time per machine, whichever clone asks.
NODE_LOCK ?= /tmp/tasklease-node.lock

e2e: build ## the chart on a real node: helm install, real pods, tasks, deletions, upgrade, uninstall
	flock $(NODE_LOCK) env TASKLEASE_E2E=1 $(PY) -m pytest -p no:cacheprovider tests/test_node_e2e.py $(PYTEST_ARGS)

kind: build ## a real 2-node kind cluster from kind-config.yaml, in a network namespace of its own; root
	$(LOCAL) kind-up

kind-down: venv ## remove the kind cluster and everything it changed on this machine (idempotent); root
	$(LOCAL) kind-down

kind-e2e: build ## e2e's scenarios on kind with the chart's default values (brings kind up and down); root
	$(LOCAL) kind-build
	flock $(NODE_LOCK) env TASKLEASE_KIND_E2E=1 $(PY) -m pytest -p no:cacheprovider tests/test_kind_e2e.py $(PYTEST_ARGS)

generate: venv ## regenerate crds/, the chart's CRD, RBAC, admission policy and README, and docs/ (layout, benchmarks, CLI, task reference)
	$(PY) -m tasklease.api.crd
	$(PY) -m tasklease.api.rbac
	$(PY) -m tasklease.protocol.policy
	$(PY) -m tasklease_dev.layout docs/development.md
	$(PY) -m tasklease_dev.benchdoc
	$(PY) -m tasklease_dev.chartdoc
	$(PY) -m tasklease_dev.clidoc
	$(PY) -m tasklease_dev.specdoc

# mypy's cache is kept beside the binaries for every clone: it compares each file's hash, so a
# fresh clone checks again only what differs from what was checked before.
lint: venv ## ruff, mypy --strict, and the import layers (lint-imports)
	$(VENV)/bin/ruff check operator tools tests
	MYPY_CACHE_DIR="$$($(PY) -c 'from tasklease_dev.binaries import cache_root; print(cache_root() / "mypy")')" \
	  $(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Pure logic: no control plane, a fake Kube or tasklease.testing, injected clocks (marker `unit`).
UNIT_TESTS := tests/test_beside.py tests/test_decode.py tests/test_chunked.py tests/test_testing.py tests/test_contract.py \
	tests/test_discovery.py tests/test_discovery_props.py tests/test_compact.py tests/test_agentmem.py tests/test_runner_unit.py tests/test_aio_unit.py \
	tests/test_worker_unit.py tests/test_jitter.py tests/test_expiry.py tests/test_rules.py tests/test_lifecycle_rules.py \
	tests/test_connection.py tests/test_retry.py tests/test_slim.py tests/test_podbound_unit.py tests/test_workqueue.py tests/test_decision.py tests/test_queues_unit.py tests/test_queues_operator_unit.py \
	tests/test_store.py tests/test_reconciler_unit.py tests/test_opmem.py tests/test_controller_unit.py tests/test_watching_unit.py tests/test_chaos.py tests/test_unitvenv.py \
	tests/test_cli_input.py tests/test_shards.py
UNIT_PYTHONS := 3.12.1 3.13.0

unit: venv ## the unit tests alone (under 30 s, no control plane)
	$(PY) -m pytest -p no:cacheprovider -m unit -q $(UNIT_TESTS)

# On 3.12 and 3.13 the tests import the source folders, in virtualenvs of the dependencies
# alone that live beside the binaries (`tasklease_dev.unitvenv`: made once, shared by clones).
unit-all: unit ## the unit tests on every supported Python (3.11, and 3.12 and 3.13 from pyenv)
	for v in $(UNIT_PYTHONS); do \
	  venv=$$($(PY) -m tasklease_dev.unitvenv $$v) || exit 1; \
	  PYTHONPATH=operator:tools $$venv/bin/python -m pytest -p no:cacheprovider -m unit -q $(UNIT_TESTS) || exit 1; \
	done

test: build bytecode lint unit-all prometheus ## lint, unit tests on 3.11-3.13, the rest of the suite (its own control plane; TASKLEASE_KUBECONFIG=... uses yours), e2e, kind-e2e
	$(PY) -m pytest -m "not unit" --ignore=tests/test_node_e2e.py --ignore=tests/test_kind_e2e.py $(PYTEST_ARGS)
	$(MAKE) e2e
	$(MAKE) kind-e2e

demo: build bytecode ## a fleet of shell agents, a crash and a requeue, on the local control plane
	$(PY) -m tasklease_dev.demo

chaos: build bytecode ## 1,000 tasks, 6 agents, 2 operators under random kill -9/SIGSTOP/API-server faults; checks every invariant
	$(PY) -m tasklease_dev.chaos $(CHAOS_ARGS)

bench: build bytecode ## every target of docs/benchmarks.md, beside floors from the same run; exits 1 on a miss (BENCH_QUICK=1: minutes)
	$(PY) -m tasklease_dev.bench $(BENCH_ARGS)

dist: venv ## a release into dist/: wheel, sdist, chart, image (OCI archive, buildah), krew plugin, SHA256SUMS
	$(PY) -m tasklease_dev.dist $(DIST_ARGS)

clean: cluster-down ## stop every control plane this clone started, remove .cache/ and the virtualenv (the binaries, unit-test virtualenvs and mypy cache in ~/.cache/tasklease stay)
	for w in .cache/test-cluster .cache/bench/cluster .cache/chaos/cluster; do \
	  test ! -d $$w || $(LOCAL) --workdir $$w --kubeconfig $$w/kubeconfig down; done
	rm -rf .cache $(VENV)
