# tasklease: every target sets up what it needs (virtualenv, Python packages, Go-built binaries).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
LOCAL  := $(PY) -m tasklease.dev

.PHONY: help venv build cluster cluster-down node node-down e2e kind kind-down kind-e2e lint test demo bench chaos generate clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*; touch $@

venv: $(STAMP) ## create the virtualenv and install tasklease with its test extra

build: $(STAMP) ## build etcd, kube-apiserver, kube-controller-manager (and helm) once, cached outside the clone
	$(LOCAL) build

cluster: build ## start the local control plane on 127.0.0.1 and apply crds/
	$(LOCAL) up

cluster-down: venv ## stop the local control plane (and the node) and remove its data
	$(LOCAL) down

node: build ## add a real node (containerd, kubelet, scheduler; loopback only) to the control plane; root
	$(LOCAL) node-up

node-down: venv ## remove the node and everything it changed on this machine (idempotent); root
	$(LOCAL) node-down

e2e: build ## the chart on a real node: helm install, real pods, tasks, deletions, upgrade, uninstall
	TASKLEASE_E2E=1 $(PY) -m pytest -p no:cacheprovider tests/test_node_e2e.py $(PYTEST_ARGS)

kind: build ## a real 2-node kind cluster from kind-config.yaml, in a network namespace of its own; root
	$(LOCAL) kind-up

kind-down: venv ## remove the kind cluster and everything it changed on this machine (idempotent); root
	$(LOCAL) kind-down

kind-e2e: build ## e2e's scenarios on kind with the chart's default values (brings kind up and down); root
	TASKLEASE_KIND_E2E=1 $(PY) -m pytest -p no:cacheprovider tests/test_kind_e2e.py $(PYTEST_ARGS)

generate: venv ## regenerate crds/, the chart's CRD and RBAC rules, and the README's layout, from their sources
	$(PY) -m tasklease.api.crd
	$(PY) -m tasklease.api.rbac
	$(PY) -m tasklease.dev.layout README.md

lint: venv ## ruff, mypy --strict, and the import layers (lint-imports)
	$(VENV)/bin/ruff check operator tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: build lint ## lint, the test suite (its own control plane; TASKLEASE_KUBECONFIG=... uses yours), e2e, kind-e2e
	$(PY) -m pytest --ignore=tests/test_node_e2e.py --ignore=tests/test_kind_e2e.py $(PYTEST_ARGS)
	$(MAKE) e2e
	$(MAKE) kind-e2e

demo: build ## a fleet of shell agents, a crash and a requeue, on the local control plane
	$(PY) -m tasklease.dev.demo

chaos: build ## 1,000 tasks, 6 agents, 2 operators under random kill -9/SIGSTOP/API-server faults; checks every invariant
	$(PY) -m tasklease.dev.chaos $(CHAOS_ARGS)

bench: build ## claim throughput and time-to-requeue, beside a baseline measured in the same run
	$(PY) -m tasklease.dev.bench

clean: cluster-down ## stop every control plane this clone started, remove .cache/ and the virtualenv (binaries stay)
	for w in .cache/test-cluster .cache/bench/cluster .cache/chaos/cluster; do \
	  test ! -d $$w || $(LOCAL) --workdir $$w --kubeconfig $$w/kubeconfig down; done
	rm -rf .cache $(VENV)
